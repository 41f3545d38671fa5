"""Fine-tune the target's own MTP module on its own answers (FastMTP), the rest of the target
frozen, then measure tau and speedup on held-out prompts.

    python train/mtp.py                                            # tiny target, a fresh module
    python train/mtp.py model=local model.path=/path/to/deepseek   # the module a target ships
    python train/mtp.py model=random-deepseek-v3 dry_run=true      # memory plan, no weights

The export is the target's folder with the fine-tuned MTP keys (model=local model.path=...).
The method's trainer entry: selfspec/from_config/methods/mtp.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_mtp")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "mtp")


if __name__ == "__main__":
    main()
