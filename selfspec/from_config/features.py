"""Feature stores from configs: the store command (`train/store.py`) and a trainer's
`trainer.features`, the store it reads the target's states from."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_int_in
from selfspec.from_config.common import positive_int, set_threads
from selfspec.from_config.methods import store_layer_names
from selfspec.from_config.models import load_target, load_tokenizer
from selfspec.from_config.training import training_rows
from selfspec.model import Transformer
from selfspec.model.fingerprint import cache_key
from selfspec.training.features import (
    FeatureStore,
    StoredFeatures,
    StoreIndex,
    StoreWriter,
    build_store,
    store_spec,
)
from selfspec.training.rows import TokenRows

DTYPES = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class Launch:
    """This process's place among the processes building one store (torchrun's RANK and
    WORLD_SIZE; one process alone is rank 0 of 1)."""

    rank: int
    world: int

    @classmethod
    def from_environment(cls) -> Launch:
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def build_feature_store(cfg: DictConfig) -> StoreIndex | None:
    """The store command: the target's states over cfg's training rows (train_data,
    trainer.seq_len; the first store.heldout_rows held-out rows too, which evaluation reads)
    written into store.out. Corpus rows the target writes itself (stdlib, self-distilled)
    are stored as they are generated; other rows in batched forwards afterwards. Under
    torchrun each rank writes every WORLD_SIZE-th shard (rank 0 prepares the rows first).
    Returns the index (None on ranks other than 0)."""
    set_threads(cfg, "trainer.threads")
    settings = store_settings(cfg)
    launch = Launch.from_environment()
    if launch.world > 1:  # the others wait while rank 0 writes the rows: hours, for answers
        torch.distributed.init_process_group("gloo", timeout=timedelta(days=2))
    target = load_target(cfg)
    layers = store_layers(cfg, target.config.num_layers)
    writer = StoreWriter(settings["out"], store_spec(target, layers, settings["dtype"],
                                                     data_settings_key(cfg)))
    if launch.rank > 0:
        launch.barrier()  # rank 0 writes the rows (and any self-distilled shards) first
    train, heldout = training_rows(cfg, load_tokenizer(target.source), target, writer)
    if launch.rank == 0:
        launch.barrier()
    heldout = heldout.select(torch.arange(min(settings["heldout_rows"], len(heldout))))
    options = {"batch_size": settings["batch_size"], "rows_per_shard": settings["rows_per_shard"],
               "rank": launch.rank, "world": launch.world}
    parts = [build_store(target, rows, writer, prefix=prefix, **options)
             for prefix, rows in (("train", train), ("heldout", heldout))]
    if launch.world > 1:
        mine = [name for part in parts for name in part[launch.rank :: launch.world]]
        print(f"rank {launch.rank} of {launch.world}: shards {', '.join(mine)}", flush=True)
    launch.barrier()
    if launch.rank > 0:
        return None
    index = writer.finish([name for part in parts for name in part])
    if index is None:
        raise RuntimeError(f"{writer.folder}: shards are missing after every rank finished")
    return index


def store_settings(cfg: DictConfig) -> dict:
    """cfg.store, checked before any model loads."""
    store = cfg.store
    if not store.get("out"):
        raise ValueError("store.out: give the folder to write the feature store into")
    if store.dtype not in DTYPES:
        raise ValueError(f"store.dtype must be one of {', '.join(DTYPES)}, got {store.dtype!r}")
    return {"out": Path(str(store.out)).expanduser(), "dtype": str(store.dtype),
            "batch_size": positive_int(cfg, "store.batch_size"),
            "rows_per_shard": positive_int(cfg, "store.rows_per_shard"),
            "heldout_rows": positive_int(cfg, "store.heldout_rows", 0)}


def store_layers(cfg: DictConfig, num_layers: int) -> tuple[int, ...]:
    """store.layers: residual streams kept beside the last hidden state, each a layer count l
    (the stream after l layers: an early exit at E reads E) or a trainer's name for its
    module's default streams on this target (its `TrainerEntry.store_layers`)."""
    named = store_layer_names()
    layers: list[int] = []
    for item in OmegaConf.to_container(cfg.store.layers) or []:
        if item in named:
            layers += named[item](num_layers)
        elif is_int_in(item, range(num_layers + 1)):
            layers.append(item)
        else:
            raise ValueError(f"store.layers: each entry is a layer count in [0, {num_layers}], "
                             f"{' or '.join(named)}, got {item!r}")
    return tuple(sorted(set(layers)))


def data_settings_key(cfg: DictConfig) -> str:
    """What decides a store's rows: the data settings, the row length and (for corpus rows
    the target writes) how many rows the run draws. A folder holding another key's store is
    refused (`StoreWriter`)."""
    data = {k: v for k, v in OmegaConf.to_container(cfg.train_data, resolve=True).items()
            if k != "cache_dir"}
    t = cfg.trainer
    drawn = [t.seq_len, t.max_steps, t.micro_batch_size, t.grad_accum, t.eval_rows,
             cfg.store.heldout_rows]
    return cache_key(json.dumps(data, sort_keys=True), *drawn)


def trainer_features(cfg: DictConfig, target: Transformer, train: TokenRows,
                     heldout: TokenRows, layers: Iterable[int] = ()) -> StoredFeatures | None:
    """The feature store of trainer.features (None: the target runs at every step), checked
    against the run: the same target weights, the residual streams `layers` the trainer
    needs, and every training row and evaluated held-out row."""
    folder = cfg.trainer.get("features")
    if not folder:
        return None
    store = FeatureStore(str(folder))
    evaluated = heldout.select(torch.arange(min(int(cfg.trainer.eval_rows), len(heldout))))
    layers = tuple(layers)
    store.check(target, [train, evaluated], layers)
    return StoredFeatures(store, layers)


def describe(index: StoreIndex, folder: Path) -> str:
    """A line on a finished store, and how a trainer reads it."""
    size = sum(s.bytes for s in index.shards) / 2**30
    return (f"feature store {folder}: {index.rows:,} rows, {index.tokens:,} tokens "
            f"({index.supervised_tokens:,} learned), layers {list(index.spec.layers)} and the "
            f"last hidden state in {index.spec.dtype}, {len(index.shards)} shards, {size:.2f} GiB"
            f"\ntrain from it: trainer.features={folder}")
