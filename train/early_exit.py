"""Train early-exit adapters (Kangaroo) at several layers E of a frozen target in one run, then
measure, for each E, the trained adapter against the untrained norm exit: tau, speedup over
plain decoding and draft time share on held-out prompts.

    python train/early_exit.py                                     # tiny target, CPU minutes
    python train/early_exit.py early_exit.exit_layers=[3,5]        # which E to train
    python train/early_exit.py early_exit.confidence_threshold=null    # always draft k tokens
    python train/early_exit.py model=llama2-70b dry_run=true       # memory plan, no weights
    torchrun --nproc_per_node 2 train/early_exit.py deepspeed=zero2 hydra.run.dir=runs/x1
    python train/early_exit.py trainer.resume=true hydra.run.dir=runs/x1    # continue a run

The method's trainer entry: selfspec/from_config/methods/early_exit.py (`TRAINER`).
"""

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.train_method import train_method


@hydra_entry_point("train_early_exit")
def main(cfg: DictConfig) -> None:
    train_method(cfg, "early_exit")


if __name__ == "__main__":
    main()
