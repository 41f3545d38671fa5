"""Train a DFlash block drafter on a frozen target, then measure tau and speedup on held-out
prompts.

    python train/dflash.py                                          # tiny target, CPU minutes
    python train/dflash.py dflash.tree_nodes=8                      # judged as DDTree's trees
    python train/dflash.py dflash.loss=kl                           # against the target's law
    python train/dflash.py model=llama2-70b dry_run=true            # memory plan, no weights
    torchrun --nproc_per_node 2 train/dflash.py deepspeed=zero2 hydra.run.dir=runs/d1
    python train/dflash.py trainer.resume=true hydra.run.dir=runs/d1    # continue a run
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig

from selfspec import from_config
from selfspec.cli import hydra_entry_point
from selfspec.heads.dflash import DFlashHead
from selfspec.heads.io import describe_target, save_head
from selfspec.model.plan import head_training_lines
from selfspec.tracking import Tracker
from selfspec.training.loop import fit, make_accelerator, state_part


@hydra_entry_point("train_dflash")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    from_config.set_threads(cfg, "trainer.threads")
    if cfg.dry_run:
        return dry_run(cfg)
    settings, target, tokenizer = from_config.start_training(cfg,
                                                             from_config.check_dflash_settings)
    judge = from_config.tau_judge(cfg, target, partial(from_config.dflash_drafters, cfg))
    train, heldout = from_config.training_rows(cfg, tokenizer, target)
    head = from_config.dflash_head(cfg, target, train)
    accelerator = make_accelerator(settings, from_config.deepspeed_config(cfg))
    target_info = describe_target(target)
    features = from_config.trainer_features(cfg, target, train, heldout,
                                            head.config.target_layers)
    objective = from_config.dflash_objective(cfg, target, head, features)
    tracker = from_config.run_tracker(cfg, settings, accelerator.is_main_process)
    buffers = {name: b.detach().clone() for name, b in head.named_buffers()}

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        """The head alone (safetensors + config), in the published checkpoints' names."""
        trained = DFlashHead(head.config)
        trained.load_state_dict(state_part(state, "head.") | buffers)
        save_head(folder, trained, head.config, target_info)

    result = fit(objective, train, heldout, settings, accelerator=accelerator,
                 tracker=tracker, export=export, judge=judge)
    from_config.report_and_finish(cfg, settings, result, tracker, report)


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the head, on meta tensors."""
    print(from_config.model_plan(cfg).format())
    config = from_config.model_config(cfg.model)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        head = DFlashHead(from_config.dflash_config(cfg, config, 0))
    print(head_training_lines(head, int(cfg.num_gpus)))


def report(cfg: DictConfig, head_folder: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the trained head over plain decoding of the
    target, on fresh weights, whatever DeepSpeed did to the trained ones."""
    target = from_config.load_target(cfg)
    drafter, _ = from_config.dflash_drafters(cfg, target, head_folder)[""]
    comparison = from_config.compare_on_final_eval(cfg, target, drafter)
    top1 = {k.removeprefix("eval/"): round(v, 3) for k, v in metrics.items()
            if k.startswith("eval/dflash/") and k.endswith("top1")}  # held-out
    tracker.log_summary({**comparison.as_dict(), **top1, "head": str(head_folder)})
    shape = (f"a chain of {drafter.k}" if drafter.shape.nodes is None
             else f"a best-first tree of {drafter.shape.nodes} nodes, {drafter.k} deep")
    layers = drafter.head.config.num_layers
    print(f"DFlash head ({layers} layer{'s' if layers > 1 else ''}, blocks of "
          f"{drafter.head.config.block_size}, drafting {shape}): {head_folder}")
    print(f"top-1 agreement with the data per slot (held-out): {top1}")
    print(comparison.describe(cfg.data.name))


if __name__ == "__main__":
    main()
