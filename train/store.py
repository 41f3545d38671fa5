"""Compute the target's hidden states over a training set once and store them, for the
trainers to read (`trainer.features=<folder>`) instead of running the target at every step.

    python train/store.py                                          # tiny target, its rows
    python train/store.py 'store.layers=[eagle3,2,4,6]' store.dtype=fp8 store.out=features/tiny
    torchrun --nproc_per_node 2 train/store.py store.out=features/tiny    # ranks share shards
    python train/store.py model=smollm2-135m train_data.source=jsonl train_data.path=a.jsonl

Give it the train_data and trainer.seq_len overrides of the trainers that will read it. A run
killed midway resumes where it stopped when run again with the same settings.
"""

from __future__ import annotations

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.features import build_feature_store, describe, store_settings


@hydra_entry_point("store")
def main(cfg: DictConfig) -> None:
    index = build_feature_store(cfg)
    if index is not None:  # rank 0
        print(describe(index, store_settings(cfg)["out"].resolve()))


if __name__ == "__main__":
    main()
