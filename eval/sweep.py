"""Sweep methods x draft lengths x sampling settings on one target; every speedup is measured
against plain decoding of the same target in the same process, on the same prompts.

    python eval/sweep.py                                        # tiny target, quick bench
    python eval/sweep.py bench=full medusa_heads=<train/medusa.py run>/checkpoints/step_N/export
    python eval/sweep.py methods=[small_model,hf_assisted] num_draft_tokens=[2,4] samplings=[greedy]
    python eval/sweep.py -m methods=ngram,small_model num_draft_tokens=2,4   # a folder per job
    python eval/sweep.py model=llama2-70b model.device_map=auto device=cuda:0 dry_run=true

Writes to the run folder: results.json, results.csv, *.png plots, metrics.jsonl, summary.json
and a W&B run (offline unless logged in). results.json holds the cost profile c(N) of the
target, measured once after the rows, from which each row's bound and efficiency come.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.cli import hydra_entry_point
from selfspec.from_config.common import set_threads
from selfspec.from_config.models import load_tokenizer
from selfspec.from_config.prompts import encode_prompt_texts, stop_ids
from selfspec.from_config.sweeps import (
    bench_settings,
    build_method,
    cuda_graphs,
    load_sweep_models,
    longest_forward,
    method_colors,
    plan_sweep,
    size_chooser,
    split_time,
    sweep_cost_profile,
    sweep_dry_run,
)
from selfspec.measure.costs import PROFILE_MAX_TOKENS
from selfspec.measure.peers import quiet_transformers
from selfspec.measure.plots import plot_sweep
from selfspec.measure.results import (
    best_rows,
    describe_auto,
    describe_profile,
    format_table,
    log_sweep,
    machine_facts,
    write_results,
)
from selfspec.measure.sweep import add_bounds, run_sweep
from selfspec.tracking import Tracker


@hydra_entry_point("sweep")
def main(cfg: DictConfig) -> None:
    run(cfg)


def run(cfg: DictConfig) -> None:
    """The whole sweep; bad settings are refused before any weights load."""
    set_threads(cfg)
    if cfg.dry_run:
        print(sweep_dry_run(cfg))
        return
    plan = plan_sweep(cfg, int(cfg.bench.num_prompts))
    bench_settings(cfg, ())  # checked now; the stop ids need the tokenizer
    models = load_sweep_models(cfg, plan.grid.variants)
    tokenizer = load_tokenizer(models.target.source)
    quiet_transformers()
    prompts = encode_prompt_texts(cfg.data, plan.prompts, tokenizer, models.target)
    settings = bench_settings(cfg, stop_ids(cfg, models.target, tokenizer))
    config = OmegaConf.to_container(cfg, resolve=True)
    tracker = Tracker(cfg.run_dir, project=cfg.wandb.project, use_wandb=cfg.wandb.enabled,
                      name=Path(cfg.run_dir).name, config=config)
    split, ids = split_time(cfg), [p.ids for p in prompts]
    profile = chooser = None
    if plan.grid.auto:  # auto rows predict from c(N): measured first, over every length
        profile = sweep_cost_profile(cfg, models.target, ids, PROFILE_MAX_TOKENS)
        calibration = encode_prompt_texts(cfg.data, plan.calibration, tokenizer,
                                          models.target)
        chooser = size_chooser(models, [p.ids for p in calibration], profile, settings)
    rows = run_sweep(
        plan.grid.points(),
        lambda variant, k: build_method(models, variant, k, split, cuda_graphs(cfg)),
        ids, settings, shared_baseline=plan.shared_baseline, device=cfg.device,
        progress=bool(cfg.progress), choose_length=chooser,
    )
    longest = longest_forward(rows)
    profiles = {b: profile if b == 1 and profile is not None else
                sweep_cost_profile(cfg, models.target, ids, longest, b)
                for b in plan.grid.batch_sizes}
    profiles = {b: cost for b, cost in profiles.items() if cost is not None}
    if profiles:
        rows = add_bounds(rows, profiles)
    machine = machine_facts()
    write_results(rows, cfg.run_dir, {
        "machine": machine, "settings": asdict(settings), "shared_baseline": plan.shared_baseline,
        "prompt_ids": [p.prompt.id for p in prompts], "config": config,
        "calibration_prompt_ids": [p.id for p in plan.calibration],
        "cost_profile": profiles[1].as_dict() if 1 in profiles else None,
        "cost_profiles": {b: p.as_dict() for b, p in profiles.items()},
    })
    figures = plot_sweep([r.as_dict() for r in rows], cfg.run_dir, method_colors())
    log_sweep(tracker, rows, figures, {"machine": machine, "best": best_rows(rows)})
    tracker.finish()
    print(format_table(rows))
    if plan.grid.auto:
        print(describe_auto(rows))
    for cost in profiles.values():
        print(describe_profile(cost))
    print(f"results, plots and W&B run in {Path(cfg.run_dir).resolve()}")


if __name__ == "__main__":
    main()
