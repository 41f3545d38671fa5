"""Train Medusa heads on a frozen target, then measure tau and speedup on held-out prompts.

    python train/medusa.py                                         # tiny target, CPU minutes
    python train/medusa.py model=llama2-70b dry_run=true           # memory plan, no weights
    torchrun --nproc_per_node 2 train/medusa.py deepspeed=zero2 hydra.run.dir=runs/m1
    python train/medusa.py trainer.resume=true hydra.run.dir=runs/m1   # continue a run
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from selfspec import build
from selfspec.bench import compare_with_plain
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.objectives import MedusaObjective
from selfspec.plan import head_training_lines
from selfspec.tracking import Tracker
from selfspec.training import fit, make_accelerator


@hydra.main(config_path="../conf", config_name="train_medusa", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    if cfg.trainer.get("threads"):
        torch.set_num_threads(int(cfg.trainer.threads))
    if cfg.dry_run:
        print(build.model_plan(cfg).format())
        with torch.device("meta"):  # sized from the config: no weights, no memory
            heads = MedusaHeads(build.medusa_config(cfg, build.model_config(cfg.model)))
        print(head_training_lines(heads, int(cfg.num_gpus)))
        return
    try:  # configuration and availability errors carry their fix: no traceback
        target = build.load_target(cfg)
        tokenizer = build.load_tokenizer(target.source)
        tree = build.draft_tree(cfg)
        settings = build.train_settings(cfg)
        train, heldout = build.training_rows(cfg, tokenizer, target)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    accelerator = make_accelerator(settings, build.deepspeed_config(cfg))
    heads, head_config = build.medusa_heads(cfg, target)
    tracker = None
    if accelerator.is_main_process:
        tracker = Tracker(settings.run_dir, project=cfg.wandb.project, use_wandb=cfg.wandb.enabled,
                          config=OmegaConf.to_container(cfg, resolve=True))

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        trained = MedusaHeads(head_config)
        trained.load_state_dict({k.removeprefix("heads."): v for k, v in state.items()})
        save_head(folder, trained, head_config, describe_target(target))

    objective = MedusaObjective(target, heads, decay=float(cfg.medusa.decay))
    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=export)
    if tracker is not None:
        if result.step == settings.max_steps and cfg.final_eval.num_prompts > 0:
            report(cfg, result.checkpoint / "export", tree, result.metrics, tracker)
        tracker.finish()


def report(cfg: DictConfig, heads_folder: Path, tree, metrics: dict, tracker: Tracker) -> None:
    """tau and speedup of the trained heads over plain decoding, on a fresh copy of the target."""
    target = build.load_target(cfg)  # unpartitioned, whatever DeepSpeed did to the trained one
    heads = load_head(heads_folder, MedusaHeads, MedusaConfig, target=target)
    prompts = build.load_prompts(cfg.data, build.load_tokenizer(target.source))
    prompts = [p.ids for p in prompts[: int(cfg.final_eval.num_prompts)]]
    comparison = compare_with_plain(
        target, MedusaDrafter(heads, tree), prompts, sampling=build.sampling_params(cfg.sampling),
        max_new_tokens=int(cfg.final_eval.max_new_tokens), seed=int(cfg.seed),
    )
    top1 = {k: round(v, 3) for k, v in metrics.items() if k.endswith("_top1")}
    summary = {**comparison.as_dict(), **top1, "heads": str(heads_folder)}
    tracker.log_summary(summary)
    print(f"Medusa heads: {heads_folder}")
    print(f"per-head top-1 (held-out): {top1}")
    print(f"tau {comparison.tau:.2f}, speedup x{comparison.speedup:.2f} over plain decoding "
          f"({comparison.tokens_per_s:.1f} vs {comparison.plain_tokens_per_s:.1f} tokens/s) on "
          f"{comparison.prompts} {cfg.data.name} prompts, lossless={comparison.lossless}, "
          f"repeated 4-grams {comparison.repeated_4gram_share:.2f}")


if __name__ == "__main__":
    main()
