"""Held-out tau by training objective: a row per run of a `trainer.objective` sweep.

    python train/eagle.py -m eagle.version=3 trainer.objective=kl,tv,reverse_kl,jsd,lk \\
        trainer.keep_best=last trainer.tau_prompts=32 hydra.sweep.dir=outputs/objectives/eagle3
    python scripts/objectives_table.py outputs/objectives/eagle3 [--out objectives.json]

Hydra's multirun trains one head per objective, in folders 0, 1, ... of the sweep folder, on the
same rows for the same steps. A run's held-out tau is its last evaluation's (`eval/tau`: greedy
tau over the trainer.tau_prompts prompts held out from training) with its standard error over
those prompts; beside it, its difference from the kl run's, with both errors combined as if
independent (sqrt(se^2 + se_kl^2): conservative, the prompts are the same).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from selfspec.cli import exit_on_user_error
from selfspec.measure.curves import tau_curve
from selfspec.training.checkpoints import RUN_CONFIG


@dataclass(frozen=True)
class ObjectiveRun:
    """One run of the sweep: its folder, trainer.objective, its last evaluation's step,
    held-out tau and that tau's standard error (None with one prompt)."""

    folder: Path
    objective: str
    step: int
    tau: float
    tau_se: float | None


def objective_runs(sweep: Path) -> list[ObjectiveRun]:
    """The runs under `sweep` (folders holding a run's config), in folder order."""
    runs = []
    for config in sorted(sweep.glob(f"*/{RUN_CONFIG}")):
        recorded = json.loads(config.read_text())
        curve = tau_curve(config.parent)
        if not curve:
            raise ValueError(f"{config.parent}: no held-out tau logged; train with "
                             f"trainer.tau_prompts > 0")
        last = curve[-1]
        runs.append(ObjectiveRun(config.parent, recorded["trainer"].get("objective") or "kl",
                                 int(last["step"]), float(last["tau"]), last["tau_se"]))
    if not runs:
        raise FileNotFoundError(f"{sweep}: no runs there ({RUN_CONFIG} in its folders); give "
                                f"the hydra.sweep.dir of a trainer.objective sweep")
    return runs


def table(runs: list[ObjectiveRun]) -> str:
    """A markdown table: objective, step, held-out tau +- its error, difference from kl."""
    kl = next((r for r in runs if r.objective == "kl"), None)
    lines = ["| objective | step | held-out tau | vs kl |", "|---|---|---|---|"]
    for run in runs:
        lines.append(f"| {run.objective} | {run.step} | {run.tau:.3f}{_error(run.tau_se)} | "
                     f"{_versus(run, kl)} |")
    return "\n".join(lines)


def _error(se: float | None) -> str:
    return "" if se is None else f" +- {se:.3f}"


def _versus(run: ObjectiveRun, kl: ObjectiveRun | None) -> str:
    if kl is None or run is kl:
        return ""
    errors = [e for e in (run.tau_se, kl.tau_se) if e is not None]
    combined = math.sqrt(sum(e * e for e in errors)) if len(errors) == 2 else None
    return f"{run.tau - kl.tau:+.3f}{_error(combined)}"


def records(runs: list[ObjectiveRun]) -> list[dict]:
    """The table's rows as JSON records (vs_kl and its combined error None for kl itself)."""
    kl = next((r for r in runs if r.objective == "kl"), None)
    rows = []
    for run in runs:
        row = {"objective": run.objective, "folder": str(run.folder), "step": run.step,
               "tau": run.tau, "tau_se": run.tau_se, "vs_kl": None, "vs_kl_se": None}
        if kl is not None and run is not kl:
            row["vs_kl"] = run.tau - kl.tau
            if run.tau_se is not None and kl.tau_se is not None:
                row["vs_kl_se"] = math.sqrt(run.tau_se**2 + kl.tau_se**2)
        rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", type=Path, nargs="+",
                        help="hydra.sweep.dir of a trainer.objective sweep (one per method)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the rows of every sweep here as JSON")
    args = parser.parse_args(argv)
    found = {}
    for sweep in args.sweeps:
        runs = objective_runs(sweep)
        print(f"{sweep}:\n{table(runs)}")
        found[str(sweep)] = records(runs)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python scripts/objectives_table.py " + " ".join(
            argv), "sweeps": found}, indent=1) + "\n")


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
