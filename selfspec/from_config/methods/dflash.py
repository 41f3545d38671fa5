"""DFlash (`DFlashHead`, drafted by `DFlashDrafter`): a block drafter of a few decoder layers
over the target's fused features, drafting k tokens in one forward; trained by
train/dflash.py (`from_config.trainers`).

Rows: dflash (a chain of the k per-position tokens) and dflash/tree{N} for each N in
dflash.tree_nodes (DDTree's best-first tree of N nodes, at most k deep), at each draft length
k up to the head's block size - 1 (longer lengths fold into that one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from selfspec.checks import is_count
from selfspec.drafters import DFlashDrafter
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    head_folder,
    required_head_folder,
    when_set,
)
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.model import Transformer

HEAD = "dflash_head"  # the setting naming the head's export folder


@dataclass(frozen=True)
class DFlashVariant(Variant):
    method: str = "dflash"
    tree_nodes: int | None = None  # None: a chain

    def label(self) -> str:
        return self.method + ("" if self.tree_nodes is None else f"/tree{self.tree_nodes}")


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[DFlashVariant, ...]:
    nodes = as_list(cfg.get("dflash", {}).get("tree_nodes")) or [None]
    if not all(n is None or is_count(n) for n in nodes):
        raise ValueError(f"dflash.tree_nodes: give node counts >= 1 (null: a chain), got "
                         f"{nodes}")
    return tuple(DFlashVariant(tree_nodes=n) for n in nodes)


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEAD, "dflash", "dflash", "a trained head")


def fold_lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """One forward drafts at most block_size - 1 tokens: longer lengths fold into that one."""
    meta = json.loads((head_folder(cfg, HEAD) / "head_config.json").read_text())
    most = int(meta["config"]["block_size"]) - 1
    return tuple(sorted({min(k, most) for k in lengths}))


def head(loaded: Loaded) -> DFlashHead:
    return loaded.once(HEAD, lambda: load_dflash(head_folder(loaded.cfg, HEAD), loaded.target))


def load(loaded: Loaded, chosen: tuple[DFlashVariant, ...]) -> None:
    head(loaded)


def drafter(loaded: Loaded, variant: DFlashVariant, k: int) -> DFlashDrafter:
    return DFlashDrafter(head(loaded), k, tree_nodes=variant.tree_nodes,
                         sampled_children=bool(loaded.cfg.dflash.sampled_children))


ENTRIES = (MethodEntry(
    name="dflash", summary="a DFlash block drafter: k tokens in one forward over the target's "
                           "features, as a chain or a best-first tree",
    variants=variants, load=load, drafter=drafter, check=check, lengths=fold_lengths,
    default_when=when_set(HEAD), head=DFlashHead,
    color="tab:olive", order=45),)


def load_dflash(folder: str | Path, target: Transformer) -> DFlashHead:
    """The head of a train/dflash.py export (refused when trained for another target)."""
    return load_head(folder, DFlashHead, DFlashConfig, target=target)

