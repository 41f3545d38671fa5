"""Train early-exit adapters (Kangaroo) at several layers E of a frozen target in one run, then
measure, for each E, the trained adapter against the untrained norm exit: tau, speedup over
plain decoding and draft time share on held-out prompts.

    python train/early_exit.py                                     # tiny target, CPU minutes
    python train/early_exit.py early_exit.exit_layers=[3,5]        # which E to train
    python train/early_exit.py early_exit.confidence_threshold=null    # always draft k tokens
    python train/early_exit.py model=llama2-70b dry_run=true       # memory plan, no weights
    torchrun --nproc_per_node 2 train/early_exit.py deepspeed=zero2 hydra.run.dir=runs/x1
    python train/early_exit.py trainer.resume=true hydra.run.dir=runs/x1    # continue a run
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig

from selfspec import from_config
from selfspec.cli import hydra_entry_point
from selfspec.heads.early_exit import ExitConfig, ExitHead
from selfspec.heads.io import describe_target, save_head
from selfspec.model.plan import trainable_line
from selfspec.tracking import Tracker
from selfspec.training.loop import fit, make_accelerator, state_part


@hydra_entry_point("train_early_exit")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    from_config.set_threads(cfg, "trainer.threads")
    if cfg.dry_run:
        return dry_run(cfg)
    settings, target, tokenizer = from_config.start_training(
        cfg, from_config.check_early_exit_settings)
    judge = from_config.tau_judge(cfg, target, partial(from_config.early_exit_drafters, cfg),
                                  replayable=False)
    heads = from_config.early_exit_heads(cfg, target)
    train, heldout = from_config.training_rows(cfg, tokenizer, target)
    accelerator = make_accelerator(settings, from_config.deepspeed_config(cfg))
    target_info = describe_target(target)
    features = from_config.trainer_features(cfg, target, train, heldout,
                                            [head.exit_layer for head in heads])
    objective = from_config.early_exit_objective(cfg, target, heads, features)
    tracker = from_config.run_tracker(cfg, settings, accelerator.is_main_process)
    configs = [head.config for head in heads]

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        """One head folder per exit layer: export/E{E} (safetensors + config)."""
        for i, config in enumerate(configs):
            trained = ExitHead(config)
            trained.load_state_dict(state_part(state, f"heads.{i}."))
            save_head(folder / f"E{config.exit_layer}", trained, config, target_info)

    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=export, judge=judge)
    from_config.report_and_finish(cfg, settings, result, tracker, report)


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the adapters, on meta tensors."""
    print(from_config.model_plan(cfg).format())
    config = from_config.model_config(cfg.model)
    layers = from_config.early_exit_layers(cfg, config.num_layers)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        heads = [ExitHead(ExitConfig.for_target(config, e)) for e in layers]
    count = sum(p.numel() for head in heads for p in head.parameters())
    print(trainable_line(f"trainable exits (ExitHead adapters at E={list(layers)})", count,
                         int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """For each trained E: tau, speedup and draft time share of the adapter and of the norm
    exit over plain decoding of the target, on fresh weights, whatever DeepSpeed did to the
    trained ones."""
    target = from_config.load_target(cfg)
    summary, lines = {"exits": str(export)}, []
    adapters = from_config.early_exit_drafters(cfg, target, export)
    for e in from_config.early_exit_layers(cfg, target.config.num_layers):
        norm = from_config.early_exit_drafter(cfg, from_config.norm_exit(target, e))
        for kind, drafter in (("norm", norm), ("adapter", adapters[f"E{e}"][0])):
            comparison = from_config.compare_on_final_eval(cfg, target, drafter)
            summary |= {f"E{e}/{kind}/{k}": v for k, v in comparison.as_dict().items()}
            lines.append(f"E={e} {kind:<7}: {comparison.describe(cfg.data.name)}")
        top1 = metrics.get(f"eval/exit/E{e}_top1")
        if top1 is not None:
            summary[f"E{e}/adapter/heldout_top1"] = round(top1, 3)
    tracker.log_summary(summary)
    threshold = from_config.early_exit_thresholds(cfg)[0]
    print(f"early exits: {export}/E*; up to {cfg.early_exit.num_draft_tokens} draft tokens, "
          f"confidence stop {threshold}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
