"""Experiment tracking: Weights & Biases, plus a plain JSON-lines record that never needs it.

W&B runs online when a key is configured (WANDB_API_KEY, or a `wandb login` in ~/.netrc) and
offline otherwise, so a run on a machine without network still leaves a W&B run folder that
`wandb sync` can upload later. An explicit WANDB_MODE always wins; WANDB_MODE=disabled, or a
machine without the wandb package (a GPU machine the package does not travel to), keeps the
JSON-lines record alone. Every logged number goes to `metrics.jsonl` in the run folder, for
tests and for users without W&B.
"""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def wandb_mode() -> str:
    """'online' with a configured key, else 'offline'; WANDB_MODE overrides both."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"
    return "online" if any("wandb" in host for host in hosts) else "offline"


class Tracker:
    """Logs scalars to W&B and to run_dir/metrics.jsonl. Create it on the main process only.

    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        project: str = "selfspec",
        name: str | None = None,
        config: dict[str, Any] | None = None,
        use_wandb: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._run = (_start_wandb(self.run_dir, project, name, config)
                     if use_wandb and wandb_available() else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def resumed_at(self, step: int) -> None:
        """Drop records the interrupted run logged past its last checkpoint, so the JSON-lines
        file reads as one clean run."""
        _drop_records_after(self.path, step)

    def log_summary(self, values: dict[str, Any]) -> None:
        """Final figures: W&B summary and run_dir/summary.json."""
        (self.run_dir / "summary.json").write_text(json.dumps(values, indent=2, default=str))
        if self._run is not None:
            self._run.summary.update(values)

    def log_media(
        self,
        tables: Mapping[str, tuple[Sequence[str], Sequence[Sequence[Any]]]] | None = None,
        images: Mapping[str, Path] | None = None,
    ) -> None:
        """Tables (name: (columns, rows)) as wandb.Table and image files as wandb.Image, in one
        W&B history entry. Without W&B it does nothing: the JSON/CSV record is the caller's."""
        if self._run is None:
            return
        import wandb  # only when W&B is on: it is slow to import

        media: dict[str, Any] = {
            name: wandb.Table(columns=list(columns), data=[list(row) for row in rows])
            for name, (columns, rows) in (tables or {}).items()
        }
        media.update({name: wandb.Image(str(path)) for name, path in (images or {}).items()})
        self._run.log(media)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self._run.dir).parent if self._run is not None else None


def wandb_available() -> bool:
    """Whether W&B can record: WANDB_MODE is not `disabled` and the package is installed
    (without it, one line says so and the JSON-lines record goes on alone)."""
    if os.environ.get("WANDB_MODE") == "disabled":
        return False
    if importlib.util.find_spec("wandb") is None:
        print("wandb is not installed: metrics go to metrics.jsonl alone (pip install wandb "
              "for W&B runs)", file=sys.stderr)
        return False
    return True


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The JSON-lines records of a run, in logging order."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start_wandb(run_dir: Path, project: str, name: str | None, config: dict | None):
    import wandb  # imported here: slow to import, and only the main process needs it

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=project, name=name, config=config, dir=str(run_dir), mode=wandb_mode(),
        reinit="finish_previous",
    )


def _drop_records_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _plain(value: Any) -> Any:
    """JSON-safe scalars: tensors and numpy numbers become floats, NaN becomes None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
