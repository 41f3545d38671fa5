"""Medusa heads (`MedusaHeads`, drafted by `MedusaDrafter` / `MedusaProductDrafter`): K heads on
the target's last hidden state, trained by train/medusa.py on the frozen target (Medusa-1) or
with LoRA on it (Medusa-2, whose drafts verify on the adapted target).

Rows: medusa, at each draft length k a tree's nodes of depth <= k (conf/tree/: static `choices`,
or the heads' top-k products), lengths beyond the tree's depth folded into one row.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.drafters import MedusaDrafter, MedusaProductDrafter
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    head_folder,
    one_variant,
    required_head_folder,
    when_set,
)
from selfspec.from_config.models import load_target
from selfspec.heads.io import load_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.measure.grid import Variant
from selfspec.model import Transformer
from selfspec.model.lora import ADAPTER_DIR, merge_adapter
from selfspec.tree import Tree

HEADS = "medusa_heads"  # the setting naming the heads' export folder


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEADS, "medusa", "medusa")


def fold_lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """At draft length k Medusa drafts the tree's nodes of depth <= k, so lengths beyond the
    tree's depth would repeat the whole tree: they fold into one at that depth."""
    depth = medusa_depth(cfg)
    return tuple(sorted({min(k, depth) for k in lengths}))


def medusa_depth(cfg: DictConfig) -> int:
    """The deepest Medusa draft: cfg.tree's depth (a top-k-products tree without one: every
    head), capped by the heads' count read from the export's head_config.json (no weights):
    node depth d needs head d-1."""
    num_heads = num_medusa_heads(cfg)
    depth = tree_depth(cfg.tree) or num_heads
    return min(depth, num_heads or depth)


def num_medusa_heads(cfg: DictConfig) -> int:
    """The heads' count of the medusa_heads export, from its head_config.json (0: unknown)."""
    meta = json.loads((head_folder(cfg, HEADS) / "head_config.json").read_text())
    return int(meta.get("config", {}).get("num_heads", 0))


def heads_and_target(loaded: Loaded) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of medusa_heads, loaded once, and for a Medusa-2 export its adapted target."""
    cfg = loaded.cfg
    return loaded.once(HEADS, lambda: load_medusa(cfg, head_folder(cfg, HEADS), loaded.target))


def verified_on(loaded: Loaded) -> tuple[Transformer, str]:
    """Medusa-2 heads draft for, and are compared with plain decoding of, their LoRA-adapted
    target ("plain_adapted"); Medusa-1 heads for the target itself."""
    _, adapted = heads_and_target(loaded)
    return (loaded.target, "plain") if adapted is None else (adapted, "plain_adapted")


def drafter(loaded: Loaded, variant: Variant, k: int) -> MedusaDrafter | MedusaProductDrafter:
    heads, _ = heads_and_target(loaded)
    return medusa_drafter(loaded.cfg.tree, heads, max_depth=k)


def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
    heads_and_target(loaded)


ENTRIES = (MethodEntry(
    name="medusa", summary="Medusa heads on the target's last hidden state, drafting a tree",
    variants=one_variant("medusa"), load=load, drafter=drafter, check=check,
    verified_on=verified_on, lengths=fold_lengths, default_when=when_set(HEADS),
    head=MedusaHeads, color="tab:green", order=20),)


# ---- trees ---------------------------------------------------------------------------------


def tree_depth(cfg_tree: DictConfig) -> int | None:
    """How deep a tree config drafts: a static tree's depth, a top-k-products config's `depth`
    (None: as many heads as there are)."""
    if cfg_tree.get("choices") is not None:
        return Tree.from_paths(OmegaConf.to_container(cfg_tree.choices)).max_depth
    return None if cfg_tree.get("depth") is None else int(cfg_tree.depth)


def medusa_drafter(
    cfg_tree: DictConfig, heads: MedusaHeads, max_depth: int | None = None
) -> MedusaDrafter | MedusaProductDrafter:
    """The Medusa drafter of a tree config (conf/tree/), at most max_depth deep: a static tree
    (`choices`: its nodes of depth <= max_depth) or a dynamic one (`top_k`, `max_nodes`,
    optional `depth`: each step's best paths of the heads' top-k products)."""
    name = cfg_tree.get("name")
    if cfg_tree.get("choices") is not None:
        choices = OmegaConf.to_container(cfg_tree.choices)
        if max_depth is not None:
            choices = [c for c in choices if len(c) <= max_depth]
        return MedusaDrafter(heads, Tree.from_paths(choices))
    if cfg_tree.get("top_k") is None or cfg_tree.get("max_nodes") is None:
        raise ValueError(f"tree config {name!r} needs `choices` (a static tree) or `top_k` and "
                         f"`max_nodes` (a tree of the heads' top-k products); see conf/tree/")
    depth = tree_depth(cfg_tree) or heads.config.num_heads
    depth = depth if max_depth is None else min(depth, max_depth)
    return MedusaProductDrafter(heads, top_k=int(cfg_tree.top_k),
                                max_nodes=int(cfg_tree.max_nodes), depth=depth)


# ---- loading ---------------------------------------------------------------------------------


def load_medusa(
    cfg: DictConfig, folder: str | Path, target: Transformer
) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of a train/medusa.py export, and for a Medusa-2 export the target they draft
    for: a fresh copy of cfg's target with the export's LoRA adapter merged (None for
    Medusa-1, whose heads draft for `target` itself, which is never modified)."""
    heads = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    adapter = Path(folder) / ADAPTER_DIR
    return heads, merge_adapter(load_target(cfg), adapter) if adapter.is_dir() else None
