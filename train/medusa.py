"""Train Medusa heads on a target, then measure tau and speedup on held-out prompts.

    python train/medusa.py                                         # tiny target, CPU minutes
    python train/medusa.py medusa.version=2                        # Medusa-2: + LoRA on target
    python train/medusa.py model=llama2-70b dry_run=true           # memory plan, no weights
    torchrun --nproc_per_node 2 train/medusa.py deepspeed=zero2 hydra.run.dir=runs/m1
    python train/medusa.py trainer.resume=true hydra.run.dir=runs/m1   # continue a run

The method's trainer entry: selfspec/from_config/methods/medusa.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_medusa")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "medusa")


if __name__ == "__main__":
    main()
