"""Learning curves of finished training runs: held-out tau at each evaluation against training
minutes and tokens seen (the records `selfspec.training.loop.fit` logs), and what each run's report
measured at its end (summary.json: tau and speedup over plain decoding).

`train/learning_curves.py` trains every method for the same budget and draws them with these.
"""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.tracking import read_metrics


def tau_curve(run_dir: str | Path) -> list[dict[str, float]]:
    """[{"step", "minutes", "tokens_seen", "epochs", "tau", "tau_se", "tau_seconds"}] of every
    evaluation that judged tau (tau_se: its standard error over the prompts, None when not
    logged; tau_seconds: what judging it took)."""
    return [{"step": r["step"], "minutes": r["minutes"], "tokens_seen": r["tokens_seen"],
             "epochs": r.get("epochs"), "tau": r["eval/tau"], "tau_se": r.get("eval/tau_se"),
             "tau_seconds": r.get("eval/tau_seconds", 0.0)}
            for r in read_metrics(run_dir) if "eval/tau" in r]


def judge_share(curve: list[dict[str, float]]) -> float:
    """The share of training plus judging time that judging tau took."""
    judging = sum(p["tau_seconds"] for p in curve)
    training = curve[-1]["minutes"] * 60 if curve else 0.0
    return judging / (training + judging) if judging else 0.0


def final_report(run_dir: str | Path) -> dict[str, float | None]:
    """The report's tau and speedup; of a trainer of several drafters (one exit adapter per
    E: "E2/adapter/speedup"), the trained drafter with the highest speedup (not the untrained
    norm exits it reports beside them)."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    tau, speedup = summary.get("tau"), summary.get("speedup")
    if speedup is None:
        names = [k.removesuffix("/speedup") for k in summary
                 if k.endswith("/speedup") and "/norm" not in k]
        name = max(names, key=lambda n: summary[f"{n}/speedup"], default=None)
        if name is not None:
            tau, speedup = summary.get(f"{name}/tau"), summary[f"{name}/speedup"]
    return {"tau": tau, "speedup": speedup}


def rising(curve: list[dict[str, float]], tail: float = 0.25, margin: float = 0.02) -> bool:
    """Whether tau still climbed over the last `tail` of the evaluations: their last value
    beats the best before them by more than `margin` (relative)."""
    if len(curve) < 2:
        return False
    cut = max(1, int(len(curve) * (1 - tail)))
    before = max(p["tau"] for p in curve[:cut])
    return curve[-1]["tau"] > before * (1 + margin)
