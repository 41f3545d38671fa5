"""Each method's tau at temperature 0, replayed over recorded plain greedy answers.

    python eval/replay.py
    python eval/replay.py model=smollm2-135m data=mt_bench num_prompts=8 max_new_tokens=128 \
           'methods=[ngram]' ngram.corpus=shipped 'ngram.tree_nodes=[null,5,8]' \
           'num_draft_tokens=[1,3]' record=runs/mt_bench_greedy.json

Greedy speculative decoding emits plain greedy's tokens, so a drafter's accepted lengths follow
from the answer (selfspec/measure/replay.py): one target forward per prompt, then drafting
alone. The tau printed is the one eval/sweep.py would measure at temperature 0 (a few differ where a
verification forward breaks a near-tie differently from the recording's); no speed. Writes
replay.json (and the recording, greedy.json) into the run folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from selfspec.cli import hydra_entry_point
from selfspec.from_config.common import positive_int, set_threads
from selfspec.from_config.methods import entry
from selfspec.from_config.models import load_tokenizer
from selfspec.from_config.prompts import encode_prompt_texts, stop_ids
from selfspec.from_config.sweeps import load_sweep_models, our_drafter, plan_sweep, verified_target
from selfspec.measure.replay import GreedyRecord, record_greedy, replay
from selfspec.metrics import POSITION_SPAN, GenerationStats, TauEstimate


@hydra_entry_point("replay")
def main(cfg: DictConfig) -> None:
    run(cfg)


def run(cfg: DictConfig) -> list[dict]:
    """Every method x draft length replayed; returns (and writes) the rows."""
    set_threads(cfg)
    plan = plan_sweep(cfg, int(cfg.num_prompts), greedy_only=True)
    n = positive_int(cfg, "max_new_tokens")
    if peers := [v.label() for v in plan.grid.variants if not entry(v.method).ours]:
        raise ValueError(f"eval/replay.py replays selfspec's drafters; drop {', '.join(peers)} "
                         f"(eval/sweep.py measures them)")
    models = load_sweep_models(cfg, plan.grid.variants)
    tokenizer = load_tokenizer(models.target.source)
    encoded = encode_prompt_texts(cfg.data, plan.prompts, tokenizer, models.target)
    stops = stop_ids(cfg, models.target, tokenizer)
    records = recorded(cfg, models.target, {p.prompt.id: p.ids for p in encoded}, n, stops)
    if any(verified_target(models, v)[0] is not models.target
           for v in plan.grid.variants):
        raise ValueError("eval/replay.py replays drafts verified on the target itself; Medusa-2 "
                         "heads verify on their LoRA-adapted target: measure them with "
                         "eval/sweep.py")
    rows = []
    for point in plan.grid.points():
        stats, per_prompt = GenerationStats(), []
        for record in records:
            drafter = our_drafter(models, point.variant, point.draft_length)
            per_prompt.append(replay(models.target, drafter, record))
            stats.merge(per_prompt[-1])
        rows.append({"method": point.method, "draft_length": point.draft_length,
                     "tau": stats.tau,
                     "tau_standard_error": standard_error(per_prompt),
                     "mean_draft_nodes": stats.drafted / max(stats.steps, 1),
                     "accepted_share_by_depth": stats.acceptance_by_position,
                     "tau_by_position": stats.tau_by_position})
        error = rows[-1]["tau_standard_error"]
        print(f"{point.method:<28} k={point.draft_length}  tau {stats.tau:.3f}"
              + ("" if error is None else f" ± {error:.3f}") + "  "
              f"nodes {rows[-1]['mean_draft_nodes']:.2f}  accepted by depth "
              + " ".join(f"{a:.2f}" for a in stats.acceptance_by_position))
    out = Path(cfg.run_dir) / "replay.json"
    out.write_text(json.dumps({"prompts": len(records), "max_new_tokens": n,
                               "position_span": POSITION_SPAN, "rows": rows}, indent=2) + "\n")
    print(f"replayed over {len(records)} recorded answers: {out.resolve()}")
    return rows


def standard_error(per_prompt: list[GenerationStats]) -> float | None:
    """tau's standard error over the prompts (TauEstimate); None with a single prompt."""
    error = TauEstimate.of(per_prompt).standard_error
    return None if math.isnan(error) else error


def recorded(cfg: DictConfig, target, prompts: dict[str, list[int]], n: int,
             stops: tuple[int, ...]) -> list[GreedyRecord]:
    """Plain greedy answers of the prompts: read from cfg.record when it holds them for this
    target and length, else recorded (and written there, or to the run folder)."""
    path = Path(str(cfg.record or Path(cfg.run_dir) / "greedy.json")).expanduser()
    key = {"target": str(target.source), "max_new_tokens": n, "stop_ids": list(stops)}
    saved = json.loads(path.read_text()) if path.is_file() else {}
    answers = saved.get("answers", {}) if saved.get("key") == key else {}
    for pid, ids in tqdm(prompts.items(), desc="recording greedy answers"):
        if answers.get(pid, {}).get("prompt") != ids:
            answers[pid] = asdict(record_greedy(target, ids, n, stops))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "answers": answers}) + "\n")
    return [GreedyRecord(**answers[pid]) for pid in prompts]


if __name__ == "__main__":
    main()
