"""Train a small draft model for a target: the target's embedding and first layers, its final
norm and LM head, distilled on the frozen target's law; then measure tau and speedup over
plain decoding on held-out prompts. The export is a Hugging Face model folder (the target's
tokenizer beside it), so `model.draft.path=` takes it for selfspec's small_model drafter and
for transformers' assisted generation alike.

    python train/draft.py                                          # tiny target, CPU minutes
    python train/draft.py draft_model.num_layers=3 draft_model.draft_vocab=2048
    python train/draft.py draft_model.parallel=4        # PARD: 4 tokens from one forward
    python train/draft.py model=llama2-70b dry_run=true            # memory plan, no weights
    torchrun --nproc_per_node 2 train/draft.py deepspeed=zero2 hydra.run.dir=runs/d1
    python train/draft.py trainer.resume=true hydra.run.dir=runs/d1     # continue a run
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
from selfspec.model import Transformer
from selfspec.model.plan import trainable_line
from selfspec.tracking import Tracker
from selfspec.training.loop import fit, make_accelerator, state_part


@hydra_entry_point("train_draft")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    from_config.set_threads(cfg, "trainer.threads")
    if cfg.dry_run:
        return dry_run(cfg)
    settings, target, tokenizer = from_config.start_training(
        cfg, from_config.check_draft_model_settings)
    train, heldout = from_config.training_rows(cfg, tokenizer, target)
    judge = from_config.tau_judge(cfg, target, partial(from_config.draft_model_drafters, cfg))
    draft = from_config.draft_from_target(cfg, target)
    accelerator = make_accelerator(settings, from_config.deepspeed_config(cfg))
    counts = token_counts(train.tokens, target.config.vocab_size, train.loss_mask)
    mask = from_config.draft_model_mask(cfg, target, train)  # PARD's; None: token by token
    objective = from_config.draft_model_objective(
        cfg, target, draft, counts, mask, from_config.trainer_features(cfg, target, train, heldout))
    tracker = from_config.run_tracker(cfg, settings, accelerator.is_main_process)

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        """The draft as a Hugging Face folder, the target's tokenizer and the training data's
        token counts (any draft vocabulary size is chosen from them later)."""
        trained = from_config.draft_from_target(cfg, target)
        trained.load_state_dict(state_part(state, "draft."), strict=False)
        trained.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        save_token_counts(folder, counts)
        if mask is not None:
            from_config.write_pard(folder, mask, int(cfg.draft_model.parallel))

    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=export, judge=judge)
    from_config.report_and_finish(cfg, settings, result, tracker, report)


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the draft, on meta tensors."""
    print(from_config.model_plan(cfg).format())
    config = from_config.model_config(cfg.model)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        draft = Transformer(config).first_layers(from_config.check_draft_model_settings(cfg))
    from_config.freeze_draft_embeddings(cfg, draft)
    count = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(trainable_line(f"trainable draft (the target's first {draft.config.num_layers} "
                         f"layers and final norm)", count, int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the exported draft over plain decoding of the
    target, on fresh weights, whatever DeepSpeed did to the trained ones."""
    target = from_config.load_target(cfg)
    drafter, _ = from_config.draft_model_drafters(cfg, target, export)[""]
    size = cfg.draft_model.draft_vocab
    comparison = from_config.compare_on_final_eval(cfg, target, drafter)
    top1 = metrics.get("eval/draft/top1")
    tracker.log_summary({**comparison.as_dict(), "draft": str(export),
                         "heldout_top1": None if top1 is None else round(top1, 3)})
    parallel = int(cfg.draft_model.get("parallel", 1))
    print(f"draft model: {export} (draft vocabulary: {size or 'whole'}"
          f"{f'; PARD, up to {parallel} tokens a forward' if parallel > 1 else ''})")
    print(f"held-out top-1 agreement with the target: {top1}")
    print(comparison.describe(cfg.data.name))


if __name__ == "__main__":
    main()
