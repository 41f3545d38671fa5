"""A sweep's results: machine facts, results.json / results.csv, the terminal table, and
the tracker's record (JSON lines, and W&B history, table and figures when W&B is on)."""

from __future__ import annotations

import csv
import json
import os
import platform
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from selfspec.measure.costs import CostProfile
from selfspec.measure.grid import COLUMNS, SweepRow
from selfspec.metrics import OTHER, PHASES
from selfspec.tracking import Tracker


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: cores, threads, versions, accelerator."""
    import transformers

    facts = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        facts["cuda_device"] = torch.cuda.get_device_name(0)
    return facts


def write_results(
    rows: Sequence[SweepRow], folder: str | Path, extra: Mapping[str, Any] | None = None
) -> tuple[Path, Path]:
    """results.json ({**extra, "columns", "rows"}) and results.csv (one line per row; list
    cells as JSON) in folder; returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    records = [r.as_dict() for r in rows]
    json_path, csv_path = folder / "results.json", folder / "results.csv"
    payload = {**(extra or {}), "columns": list(COLUMNS), "rows": records}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table_rows(records))
    return json_path, csv_path


def table_rows(records: Sequence[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows with list and dict cells turned into JSON text (for CSV files and W&B tables)."""
    for record in records:
        yield {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in record.items()}


def format_table(rows: Sequence[SweepRow]) -> str:
    """A plain-text summary, one line per row, for the terminal: the figures, the bound and
    efficiency (blank without a cost profile), and the time split in percent of wall time."""
    split_head = "/".join(("pre", "draft", "fwd", "probs", "verify", "commit", "other"))
    head = (f"{'method':<17}{'k':>3}{'B':>3} {'sampling':<8}{'tau':>6}{'acc':>6}{'tok/s':>9}"
            f"{'speedup':>9}{'bound':>8}{'eff':>6}{'rep4':>6}  {'lossless':<9}"
            f"time % {split_head}")
    lines = [head]
    for r in rows:
        bound = "" if r.bound is None else f"{r.bound:.2f}x"
        efficiency = "" if r.efficiency is None else f"{r.efficiency:.2f}"
        lines.append(
            f"{r.method:<17}{r.draft_length:>3}{r.batch_size:>3} {r.sampling:<8}{r.tau:>6.2f}"
            f"{r.acceptance_rate:>6.2f}{r.tokens_per_s:>9.1f}{r.speedup:>8.2f}x{bound:>8}"
            f"{efficiency:>6}{r.repeated_4gram_share:>6.2f}  "
            f"{'' if r.lossless is None else str(r.lossless):<9}{split_percent(r.time_split)}"
        )
    return "\n".join(lines)


def describe_auto(rows: Sequence[SweepRow]) -> str:
    """A line per auto row: the length chosen, its predicted and measured speedup, and how
    it fares against the best fixed length (measured on the same, evaluated, prompts)."""
    lines = []
    for r in rows:
        if r.auto_choice is None:
            continue
        chosen = next(e for e in r.auto_choice["estimates"] if e["size"] == r.draft_length)
        fixed = [x for x in rows if x.method == r.method.removesuffix("/auto")
                 and x.sampling == r.sampling and x.auto_choice is None]
        best = max(fixed, key=lambda x: x.speedup, default=None)
        versus = "" if best is None or r.auto_vs_best is None else (
            f"; best fixed k={best.draft_length} {best.speedup:.2f}x, auto / best "
            f"{r.auto_vs_best:.2f}")
        lines.append(f"{r.method} {r.sampling}: k={r.draft_length} chosen on "
                     f"{r.auto_choice['calibration_prompts']} calibration prompts, predicted "
                     f"{chosen['predicted_speedup']:.2f}x, measured {r.speedup:.2f}x{versus}")
    return "\n".join(lines)


def describe_profile(profile: CostProfile) -> str:
    """The cost profile as one line: the one-token forward and c(N) at every measured N."""
    c = profile.as_dict()["c"]
    batch = f", batch {profile.batch_size}" if profile.batch_size > 1 else ""
    return (f"cost profile ({profile.device}, {profile.dtype}, cache length "
            f"{profile.cache_length}{batch}): one-token forward "
            f"{1000 * profile.seconds[1]:.2f} ms; c(N) "
            + ", ".join(f"{n}: {v:.2f}" for n, v in c.items()))


def split_percent(split: Mapping[str, Mapping[str, float]] | None) -> str:
    """A time split's shares of wall time in percent, "2/30/51/3/5/8/1" in PHASES order then
    other; "-" where the split was not measured."""
    if split is None:
        return "-"
    return "/".join(f"{100 * split[phase]['share']:.0f}" for phase in (*PHASES, OTHER))


def log_sweep(tracker: Tracker, rows: Sequence[SweepRow], figures: Mapping[str, Path],
              summary: Mapping[str, Any]) -> None:
    """Rows as JSON-lines records and W&B history (step = row index), the whole grid as a
    W&B table, the figures as W&B images, and `summary` as the run summary."""
    # List cells as JSON text: W&B history and tables take scalars only.
    records = list(table_rows([r.as_dict() for r in rows]))
    for i, record in enumerate(records):
        tracker.log(record, step=i)
    tracker.log_summary(dict(summary))
    tracker.log_media(
        tables={"results": (COLUMNS, [[r[c] for c in COLUMNS] for r in records])},
        images={f"plots/{name}": path for name, path in figures.items()},
    )


def best_rows(rows: Sequence[SweepRow]) -> dict[str, dict[str, Any]]:
    """Per "method/sampling": the draft length with the highest speedup, and its figures."""
    best: dict[str, SweepRow] = {}
    for row in rows:
        key = f"{row.method}/{row.sampling}"
        if key not in best or row.speedup > best[key].speedup:
            best[key] = row
    keep = ("draft_length", "speedup", "tau", "tokens_per_s", "bound", "efficiency",
            "repeated_4gram_share", "lossless")
    return {key: {k: getattr(r, k) for k in keep} for key, r in best.items()}
