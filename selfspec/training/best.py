"""Which training step to keep, judged at each evaluation: the best held-out tau (what a
drafter is for), the best held-out loss, or simply the last step; and when to stop early.

`BestStep` remembers the best value of the chosen metric and how many evaluations passed
since it improved, in `best.json` beside the best step's export, so a resumed run keeps the
best it had. The export itself is written by the trainer's own export function.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from selfspec.files import write_atomically

KEEP = ("last", "loss", "tau")  # trainer.keep_best
METRIC = {"loss": "eval/loss", "tau": "eval/tau"}  # what each judges by
BEST_FILE = "best.json"


@dataclass
class BestStep:
    """keep: "tau" (higher is better), "loss" (lower is better) or "last" (nothing judged).
    folder: where the best step's export and best.json live. history: (step, value) of every
    judged evaluation."""

    keep: str
    folder: Path
    step: int | None = None
    value: float | None = None
    since_gain: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.keep not in KEEP:
            raise ValueError(f"trainer.keep_best must be one of {', '.join(KEEP)}, "
                             f"got {self.keep!r}")
        self.folder = Path(self.folder)

    @classmethod
    def resumed(cls, keep: str, folder: Path) -> BestStep:
        """The record a run left in folder (a resume keeps its best), or a fresh one."""
        saved = Path(folder) / BEST_FILE
        if not saved.is_file():
            return cls(keep, folder)
        record = json.loads(saved.read_text())
        if record.get("keep") != keep:  # judged by another metric before: start afresh
            return cls(keep, folder)
        return cls(keep, folder, record["step"], record["value"], record["since_gain"],
                   [tuple(h) for h in record["history"]])

    @property
    def judges(self) -> bool:
        return self.keep != "last"

    @property
    def export(self) -> Path:
        return self.folder / "export"

    def offer(self, step: int, metrics: dict[str, float], export: Path) -> bool:
        """Judge step by its metrics; a better one's export (a folder the trainer wrote) is
        copied to `self.export`. Returns whether it is the new best."""
        value = metrics[METRIC[self.keep]]
        self.history.append((step, value))
        better = self.value is None or (value > self.value if self.keep == "tau"
                                        else value < self.value)
        if better:
            self.step, self.value, self.since_gain = step, value, 0
            if self.export.exists():
                shutil.rmtree(self.export)
            shutil.copytree(export, self.export)
        else:
            self.since_gain += 1
        self._save()
        return better

    def should_stop(self, patience: int | None) -> bool:
        """Whether `patience` evaluations in a row brought no gain (None: never stop)."""
        return patience is not None and self.judges and self.since_gain >= patience

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        write_atomically(self.folder / BEST_FILE, json.dumps(record, indent=2) + "\n")
