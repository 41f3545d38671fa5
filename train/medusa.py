"""Train Medusa heads on a target, then measure tau and speedup on held-out prompts.

    python train/medusa.py                                         # tiny target, CPU minutes
    python train/medusa.py medusa.version=2                        # Medusa-2: + LoRA on target
    python train/medusa.py model=llama2-70b dry_run=true           # memory plan, no weights
    torchrun --nproc_per_node 2 train/medusa.py deepspeed=zero2 hydra.run.dir=runs/m1
    python train/medusa.py trainer.resume=true hydra.run.dir=runs/m1   # continue a run
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
from selfspec.heads.io import describe_target, save_head
from selfspec.heads.medusa import MedusaHeads
from selfspec.measure.lossless import greedy_agreement
from selfspec.model import Transformer
from selfspec.model.lora import ADAPTER_DIR, lora_parameter_count, save_adapter
from selfspec.model.plan import head_training_lines, trainable_line
from selfspec.tracking import Tracker
from selfspec.training.loop import fit, make_accelerator, state_part


@hydra_entry_point("train_medusa")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    from_config.set_threads(cfg, "trainer.threads")
    version = from_config.medusa_version(cfg)
    if cfg.dry_run:
        return dry_run(cfg, version)
    settings, target, tokenizer = from_config.start_training(cfg, from_config.check_medusa_settings)
    from_config.check_medusa_tree(cfg, target)  # a tree the heads cannot fill fails now, not later
    train, heldout = from_config.training_rows(cfg, tokenizer, target)
    # Before Medusa-2 wraps the target: the judge records its answers and replays on it.
    judge = from_config.tau_judge(cfg, target, partial(from_config.medusa_drafters, cfg),
                                  replayable=version == 1)
    heads, head_config = from_config.medusa_heads(cfg, target, train)
    accelerator = make_accelerator(settings, from_config.deepspeed_config(cfg))
    target_info = describe_target(target)  # before Medusa-2 wraps the target with adapters
    features = from_config.trainer_features(cfg, target, train, heldout)
    objective = from_config.medusa_objective(cfg, target, heads, features)
    tracker = from_config.run_tracker(cfg, settings, accelerator.is_main_process)

    buffers = {name: b.detach().clone() for name, b in heads.named_buffers()}  # d2t, t2d
    counts = token_counts(train.tokens, target.config.vocab_size, train.loss_mask)

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        """Heads alone (safetensors + config) and the training data's token counts (from which
        scripts/export_heads.py --draft-vocab narrows them); Medusa-2 adds its adapter in
        peft's format."""
        trained = MedusaHeads(head_config)
        trained.load_state_dict(state_part(state, "heads.") | buffers)
        save_head(folder, trained, head_config, target_info)
        save_token_counts(folder, counts)
        if version == 2:
            save_adapter(objective.target, folder / ADAPTER_DIR, state_part(state, "target."))

    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=export, judge=judge)
    from_config.report_and_finish(cfg, settings, result, tracker, report)


def dry_run(cfg: DictConfig, version: int) -> None:
    """The memory plan of the target, the heads and (Medusa-2) the adapters, on meta tensors."""
    print(from_config.model_plan(cfg).format())
    config, gpus = from_config.model_config(cfg.model), int(cfg.num_gpus)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        heads = MedusaHeads(from_config.medusa_config(cfg, config))
        target = Transformer(config) if version == 2 else None
    print(head_training_lines(heads, gpus))
    if target is not None:
        settings = from_config.lora_settings(cfg)
        print(trainable_line(f"LoRA adapters on the target (rank {settings.rank})",
                             lora_parameter_count(target, settings), gpus))
        print("  Medusa-2 also back-propagates through the target: plan activation memory "
              "(micro_batch_size x seq_len) on top")


def report(cfg: DictConfig, heads_folder: Path, metrics: dict, tracker: Tracker) -> None:
    """tau and speedup of the trained heads over plain decoding of the target they draft for
    (Medusa-2: the adapted target), on fresh weights, whatever DeepSpeed did to the trained
    ones; for Medusa-2 also how much of the original's greedy output the adapted target keeps."""
    target = from_config.load_target(cfg)
    drafter, verified = from_config.medusa_drafters(cfg, target, heads_folder)[""]
    adapted = verified if verified is not target else None
    comparison = from_config.compare_on_final_eval(cfg, verified, drafter)
    top1 = {k.removeprefix("eval/"): round(v, 3) for k, v in metrics.items()
            if k.startswith("eval/") and k.endswith("_top1")}  # held-out, not the last batch
    summary = {**comparison.as_dict(), **top1, "heads": str(heads_folder)}
    if adapted is not None:
        summary["greedy_agreement_with_original"] = greedy_agreement(
            target, adapted, from_config.final_eval_prompts(cfg, target),
            int(cfg.final_eval.max_new_tokens))
        summary["eval_kl_to_original"] = metrics.get("eval/medusa/lm_kl")
    tracker.log_summary(summary)
    print(f"Medusa heads: {heads_folder}")
    print(f"per-head top-1 (held-out): {top1}")
    print(comparison.describe(cfg.data.name))
    if adapted is not None:
        print(f"Medusa-2: verified against the LoRA-adapted target (held-out KL to the original "
              f"{summary['eval_kl_to_original']}); its greedy output keeps "
              f"{summary['greedy_agreement_with_original']:.0%} of the original's tokens before "
              f"the first difference")


if __name__ == "__main__":
    main()
