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

The method's trainer entry: selfspec/from_config/methods/small_model.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_draft")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "draft")


if __name__ == "__main__":
    main()
