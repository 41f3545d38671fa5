"""DFlash (`DFlashHead`, drafted by `DFlashDrafter`): a block drafter of a few decoder layers
over the target's fused features, drafting k tokens in one forward; trained by
train/dflash.py.

Rows: dflash (a chain of the k per-position tokens) and dflash/tree{N} for each N in
dflash.tree_nodes (DDTree's best-first tree of N nodes, at most k deep), at each draft length
k up to the head's block size - 1 (longer lengths fold into that one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.drafters import DFlashDrafter
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    head_folder,
    is_count,
    required_head_folder,
)
from selfspec.from_config.models import model_config
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.draft_vocab import draft_vocabulary, rarest_token, token_counts
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.model import ModelConfig, Transformer
from selfspec.training.loop import TokenRows
from selfspec.training.objectives import DFlashObjective

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


def drafter(loaded: Loaded, variant: DFlashVariant, k: int) -> DFlashDrafter:
    return DFlashDrafter(head(loaded), k, tree_nodes=variant.tree_nodes,
                         sampled_children=bool(loaded.cfg.dflash.sampled_children))


ENTRIES = (MethodEntry(
    name="dflash", summary="a DFlash block drafter: k tokens in one forward over the target's "
                           "features, as a chain or a best-first tree",
    variants=variants, load=lambda loaded, chosen: head(loaded), drafter=drafter, check=check,
    lengths=fold_lengths, default_when=lambda cfg: bool(cfg.get(HEAD)), head=DFlashHead,
    color="tab:olive", order=45),)


def load_dflash(folder: str | Path, target: Transformer) -> DFlashHead:
    """The head of a train/dflash.py export (refused when trained for another target)."""
    return load_head(folder, DFlashHead, DFlashConfig, target=target)


# ---- training (train/dflash.py) ----------------------------------------------------------------

LOSSES = ("ce", "kl")  # against the data; against the target's law


@dataclass(frozen=True)
class DFlashTraining:
    """What train/dflash.py trains: a fresh head, its config and the objective."""

    head: DFlashHead
    config: DFlashConfig
    objective: DFlashObjective


def dflash_config(cfg: DictConfig, target: ModelConfig, mask_token_id: int) -> DFlashConfig:
    """The head's config for the target from cfg.dflash (target_layers null: num_features
    streams spaced as the references space them)."""
    d = cfg.dflash
    layers = d.get("target_layers")
    try:
        return DFlashConfig.for_target(
            target, mask_token_id=mask_token_id, num_layers=d.num_layers,
            block_size=d.block_size, num_features=d.num_features,
            target_layers=None if layers is None else tuple(OmegaConf.to_container(layers)),
            draft_vocab_size=d.get("draft_vocab_size"), qk_norm=bool(d.qk_norm))
    except ValueError as exc:
        raise ValueError(str(exc).replace("DFlashConfig: ", "dflash.", 1)) from None


def check_dflash_settings(cfg: DictConfig) -> None:
    """Every cfg.dflash setting checked from the config alone (a head on the meta device, no
    weights): the head, its objective's settings and the drafter the report uses."""
    d, target = cfg.dflash, model_config(cfg.model)
    mask = d.get("mask_token_id")
    with torch.device("meta"):
        meta_head = DFlashHead(dflash_config(cfg, target, 0 if mask is None else mask))
    dflash_drafter(cfg, meta_head)
    if not is_count(d.anchors):
        raise ValueError(f"dflash.anchors must be an integer >= 1, got {d.anchors!r}")
    if not float(d.gamma) > 0:
        raise ValueError(f"dflash.gamma must be > 0 (slot k weighs exp(-(k-1)/gamma)), got "
                         f"{d.gamma}")
    if d.loss not in LOSSES:
        raise ValueError(f"dflash.loss must be ce (against the data) or kl (against the "
                         f"target's law), got {d.loss!r}")


def dflash_drafter(cfg: DictConfig, trained: DFlashHead) -> DFlashDrafter:
    """train/dflash.py's drafter (held-out tau, the report): dflash.num_draft_tokens (null:
    the block's B - 1) as a chain, or DDTree's tree of dflash.tree_nodes nodes."""
    d = cfg.dflash
    return DFlashDrafter(trained, d.get("num_draft_tokens"), tree_nodes=d.get("tree_nodes"),
                         sampled_children=bool(d.sampled_children))


def dflash_training(cfg: DictConfig, target: Transformer, train: TokenRows) -> DFlashTraining:
    """A fresh head sized for the target, and its objective. The mask token is
    dflash.mask_token_id, or (null) the training rows' rarest token (the highest id among
    equals), so that it stands for nothing the rows say; with dflash.draft_vocab_size the
    draft vocabulary is the rows' most frequent tokens (where the loss counts). The head's
    final norm (and LM head rows) start from the target's."""
    d = cfg.dflash
    mask = d.get("mask_token_id")
    if mask is None:
        mask = rarest_token(token_counts(train.tokens, target.config.vocab_size))
    config = dflash_config(cfg, target.config, int(mask))
    torch.manual_seed(int(cfg.seed))
    head = DFlashHead(config).to(target.embed_tokens.weight)
    if config.draft_vocab_size is not None:
        head.set_draft_vocab(draft_vocabulary(train.tokens, config.vocab_size,
                                              config.draft_vocab_size, train.loss_mask))
    head.init_from_target(target)
    objective = DFlashObjective(target, head, anchors=int(d.anchors), gamma=float(d.gamma),
                                teacher=d.loss == "kl",
                                cache_features=bool(d.get("cache_features", False)))
    return DFlashTraining(head, config, objective)
