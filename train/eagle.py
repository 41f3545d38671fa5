"""Train an EAGLE head on a frozen target, then measure tau and speedup on held-out prompts.

    python train/eagle.py                                          # tiny target, CPU minutes
    python train/eagle.py eagle.version=2                          # EAGLE-2 dynamic trees
    python train/eagle.py eagle.version=3                          # EAGLE-3 head
    python train/eagle.py model=llama2-70b dry_run=true            # memory plan, no weights
    torchrun --nproc_per_node 2 train/eagle.py deepspeed=zero2 hydra.run.dir=runs/e1
    python train/eagle.py trainer.resume=true hydra.run.dir=runs/e1    # continue a run
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig

from selfspec import from_config
from selfspec.cli import hydra_entry_point
from selfspec.heads.draft_vocab import save_token_counts, token_counts
from selfspec.heads.eagle import EagleHead
from selfspec.heads.io import describe_target, save_head
from selfspec.model.plan import head_training_lines
from selfspec.tracking import Tracker
from selfspec.training.loop import fit, make_accelerator, state_part


@hydra_entry_point("train_eagle")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    from_config.set_threads(cfg, "trainer.threads")
    from_config.eagle_version(cfg)
    if cfg.dry_run:
        return dry_run(cfg)
    settings, target, tokenizer = from_config.start_training(cfg, from_config.check_eagle_settings)
    judge = from_config.tau_judge(cfg, target, partial(from_config.eagle_drafters, cfg))
    train, heldout = from_config.training_rows(cfg, tokenizer, target)
    head, head_config = from_config.eagle_head(cfg, target, train)
    accelerator = make_accelerator(settings, from_config.deepspeed_config(cfg))
    target_info = describe_target(target)
    features = from_config.trainer_features(cfg, target, train, heldout,
                                            head.config.target_layers)
    objective = from_config.eagle_objective(cfg, target, head, features)
    tracker = from_config.run_tracker(cfg, settings, accelerator.is_main_process)
    buffers = {name: b.detach().clone() for name, b in head.named_buffers()}  # EAGLE-3 d2t, t2d
    counts = token_counts(train.tokens, target.config.vocab_size, train.loss_mask)

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        """The head alone (safetensors + config), in the published checkpoints' names, and the
        training data's token counts (an EAGLE-1 head's eagle.draft_vocab is chosen from them)."""
        trained = EagleHead(head_config)
        trained.load_state_dict(state_part(state, "head.") | buffers)
        save_head(folder, trained, head_config, target_info)
        save_token_counts(folder, counts)

    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=export, judge=judge)
    from_config.report_and_finish(cfg, settings, result, tracker, report)


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the head, on meta tensors."""
    print(from_config.model_plan(cfg).format())
    with torch.device("meta"):  # sized from the config: no weights, no memory
        head = EagleHead(from_config.eagle_config(cfg, from_config.model_config(cfg.model)))
    print(head_training_lines(head, int(cfg.num_gpus)))


def report(cfg: DictConfig, head_folder: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the trained head over plain decoding of the
    target, on fresh weights, whatever DeepSpeed did to the trained ones."""
    target = from_config.load_target(cfg)
    drafter, _ = from_config.eagle_drafters(cfg, target, head_folder)[""]
    comparison = from_config.compare_on_final_eval(cfg, target, drafter)
    top1 = {k.removeprefix("eval/"): round(v, 3) for k, v in metrics.items()
            if k.startswith("eval/") and k.endswith("top1")}  # held-out, not the last batch
    version = from_config.eagle_version(cfg)
    tracker.log_summary({**comparison.as_dict(), **top1, "head": str(head_folder),
                         "eagle_version": version})
    parallel = int(cfg.eagle.get("parallel", 1))
    kind = (f"P-EAGLE: EAGLE-3 head, {parallel} tokens a forward" if parallel > 1
            else from_config.EAGLE_VERSIONS[version])
    print(f"EAGLE head ({kind}): {head_folder}")
    print(f"top-1 agreement with the target (held-out): {top1}")
    print(comparison.describe(cfg.data.name))


if __name__ == "__main__":
    main()
