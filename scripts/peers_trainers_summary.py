"""Gather the trainers-side-by-side runs into one summary (docs/results/peers_trainers_small/).

    python scripts/peers_trainers_summary.py runs/peers docs/results/peers_trainers_small

Reads each head's training record under <runs>/<trainer>-<kind>/ (selfspec's metrics.jsonl:
tokens seen over training minutes at the last step; a peer's summary.json: tokens/s over its
own step time) and its replay (<head>/../replay/replay.json, selfspec's evaluator for every
head), copies each replay beside the summary, and writes summary.json there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

RUNS = ("selfspec-eagle3", "speculators-eagle3", "selfspec-dflash", "speculators-dflash",
        "specforge-dflash")
STEPS = 80
DRAFT_LENGTH = 3  # EAGLE-3's tree 3 deep, DFlash's chains of 3
WHAT = ("held-out tau (selfspec's replay of the target's greedy answers to 24 MT-bench prompts, "
        "128 tokens; EAGLE-3: an EAGLE-2 tree of 8 nodes, top 2, 3 deep; DFlash: chains of 3) "
        "and training tokens/s, 80 steps of 4 rows of 256 tokens from one fp32 store, 2 threads, "
        "alone on the machine")
STORE = ("python train/store.py model=smollm2-135m train_data.source=instructions "
         "train_data.num_prompts=120 train_data.general_prompts=400 "
         "train_data.self_distill_max_new_tokens=128 trainer.seq_len=256 "
         "'store.layers=[eagle3,28,30]' store.dtype=fp32 store.out=features/smollm2-peers-small")


def selfspec_record(run: Path) -> tuple[Path, float, str]:
    """(its exported head, training tokens/s, where that came from)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(records) if r.get("step") == STEPS and "minutes" in r)
    head = run / "checkpoints" / f"step_{STEPS:07d}" / "export"
    return head, last["tokens_seen"] / (60 * last["minutes"]), \
        f"tokens_seen over minutes (metrics.jsonl, step {STEPS})"


def peer_record(run: Path) -> tuple[Path, float, str]:
    summary = json.loads((run / "summary.json").read_text())
    return Path(summary["export"]), summary["tokens_per_s"], \
        "summary.json tokens_per_s (the peer's step profile)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    heads = {}
    for name in RUNS:
        run = args.runs / name
        trainer, kind = name.split("-")
        if not run.is_dir():
            sys.exit(f"error: {run} is missing: run docs/results/peers_trainers_small/compare.sh "
                     f"and replay.sh first")
        head, tokens_per_s, source = (selfspec_record if trainer == "selfspec"
                                      else peer_record)(run)
        replay = head.parent / "replay" / "replay.json"
        if not replay.is_file():
            sys.exit(f"error: {replay} is missing: run docs/results/peers_trainers_small/replay.sh")
        row = next(r for r in json.loads(replay.read_text())["rows"]
                   if r["draft_length"] == DRAFT_LENGTH)
        kept = args.out / f"{name}_replay.json"
        shutil.copyfile(replay, kept)
        heads[f"{kind}/{trainer}"] = {
            "tau": row["tau"], "tau_standard_error": row["tau_standard_error"],
            "accepted_share_by_depth": row["accepted_share_by_depth"],
            "training_tokens_per_s": tokens_per_s, "tokens_per_s_from": source,
            "replay": str(kept), "trained_by": str(run / ("metrics.jsonl" if trainer == "selfspec"
                                                            else "summary.json"))}
    summary = {"what": WHAT, "commands": [
        STORE, "bash docs/results/peers_trainers_small/compare.sh",
        "bash docs/results/peers_trainers_small/replay.sh",
        f"python scripts/peers_trainers_summary.py {args.runs} {args.out}"],
        "store_rows": 343, "heads": heads}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, head in heads.items():
        print(f"{name:22s} tau {head['tau']:.3f} +- {head['tau_standard_error']:.3f}  "
              f"{head['training_tokens_per_s']:.0f} training tokens/s")


if __name__ == "__main__":
    main()
