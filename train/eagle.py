"""Train an EAGLE head on a frozen target, then measure tau and speedup on held-out prompts.

    python train/eagle.py                                          # tiny target, CPU minutes
    python train/eagle.py eagle.version=2                          # EAGLE-2 dynamic trees
    python train/eagle.py eagle.version=3                          # EAGLE-3 head
    python train/eagle.py model=llama2-70b dry_run=true            # memory plan, no weights
    torchrun --nproc_per_node 2 train/eagle.py deepspeed=zero2 hydra.run.dir=runs/e1
    python train/eagle.py trainer.resume=true hydra.run.dir=runs/e1    # continue a run

The method's trainer entry: selfspec/from_config/methods/eagle.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_eagle")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "eagle")


if __name__ == "__main__":
    main()
