"""Train a DFlash block drafter on a frozen target, then measure tau and speedup on held-out
prompts.

    python train/dflash.py                                          # tiny target, CPU minutes
    python train/dflash.py dflash.tree_nodes=8                      # judged as DDTree's trees
    python train/dflash.py dflash.loss=kl                           # against the target's law
    python train/dflash.py model=llama2-70b dry_run=true            # memory plan, no weights
    torchrun --nproc_per_node 2 train/dflash.py deepspeed=zero2 hydra.run.dir=runs/d1
    python train/dflash.py trainer.resume=true hydra.run.dir=runs/d1    # continue a run

The method's trainer entry: selfspec/from_config/methods/dflash.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_dflash")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "dflash")


if __name__ == "__main__":
    main()
