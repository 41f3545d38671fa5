"""EAGLE heads (`EagleHead`, drafted by `EagleDrafter`): a one-layer head over the target's
features, trained by train/eagle.py. eagle.version 1: an EAGLE-1 head drafting a static tree;
2: the same head drafting EAGLE-2 dynamic trees; 3: an EAGLE-3 head (fused target layers, a
draft vocabulary, trained with the training-time test) drafting dynamic trees.

Rows: eagle, at each draft length k an EAGLE-2 dynamic tree k deep with eagle.total_tokens
nodes and eagle.top_k children per frontier node (whatever the head's version).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.drafters import EagleDrafter
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    head_folder,
    is_count,
    one_variant,
    required_head_folder,
)
from selfspec.from_config.models import model_config
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.model import ModelConfig, Transformer
from selfspec.tree import Tree

HEAD = "eagle_head"  # the setting naming the head's export folder


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEAD, "eagle", "eagle", "a trained head")
    check_eagle_tree(cfg, lengths)


def check_eagle_tree(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """EAGLE drafts an EAGLE-2 tree as deep as each draft length k, with eagle.total_tokens
    nodes and eagle.top_k children per frontier node: every k must fit in total_tokens."""
    e = cfg.eagle
    for key in ("total_tokens", "top_k"):
        if not is_count(e[key]):
            raise ValueError(f"eagle.{key} must be an integer >= 1, got {e[key]!r}")
    if max(lengths) > e.total_tokens:
        raise ValueError(f"eagle.total_tokens ({e.total_tokens}) < the longest draft length "
                         f"({max(lengths)}): a tree that deep needs that many nodes; raise "
                         f"eagle.total_tokens or lower num_draft_tokens")


def head(loaded: Loaded) -> EagleHead:
    return loaded.once(HEAD, lambda: load_eagle(head_folder(loaded.cfg, HEAD), loaded.target))


def drafter(loaded: Loaded, variant: Variant, k: int) -> EagleDrafter:
    e = loaded.cfg.eagle
    return EagleDrafter(head(loaded), total_tokens=e.total_tokens, depth=k, top_k=e.top_k,
                        sampled_children=e.sampled_children)


ENTRIES = (MethodEntry(
    "eagle", "an EAGLE-1/EAGLE-3 head over the target's features, drafting EAGLE-2 trees",
    one_variant("eagle"), lambda loaded, chosen: head(loaded), drafter, check=check,
    default_when=lambda cfg: bool(cfg.get(HEAD)), head=EagleHead, color="tab:red", order=40),)


# ---- heads and their training (train/eagle.py) -----------------------------------------------

EAGLE_VERSIONS = {1: "EAGLE-1 head, static tree", 2: "EAGLE-1 head, EAGLE-2 dynamic tree",
                  3: "EAGLE-3 head, EAGLE-2 dynamic tree"}


def eagle_version(cfg: DictConfig) -> int:
    """1: an EAGLE-1 head drafting cfg.tree (static); 2: the same head drafting EAGLE-2 dynamic
    trees; 3: an EAGLE-3 head (fused layers, draft vocabulary) drafting dynamic trees."""
    version = cfg.eagle.get("version", 1)
    if version not in EAGLE_VERSIONS:
        choices = "; ".join(f"{v}: {what}" for v, what in EAGLE_VERSIONS.items())
        raise ValueError(f"eagle.version must be 1, 2 or 3 ({choices}), got {version!r}")
    return int(version)


def eagle_config(cfg: DictConfig, target_config: ModelConfig) -> EagleConfig:
    """The head's config for the target: EAGLE-1 (versions 1, 2) or EAGLE-3 (version 3, with
    eagle.draft_vocab_size and eagle.target_layers, null = the inputs of 2, L//2, L-3)."""
    e, version = cfg.eagle, eagle_version(cfg)
    layers, fc_bias = e.get("target_layers"), e.get("fc_bias")
    if fc_bias is not None and not isinstance(fc_bias, bool):
        raise ValueError(f"eagle.fc_bias must be null, true or false, got {fc_bias!r}")
    try:
        if version < 3:
            return EagleConfig.for_target(target_config, 1, fc_bias=fc_bias)
        return EagleConfig.for_target(
            target_config, 3, draft_vocab_size=e.draft_vocab_size, fc_bias=fc_bias,
            target_layers=None if layers is None else tuple(OmegaConf.to_container(layers)))
    except ValueError as exc:
        raise ValueError(str(exc).replace("EagleConfig: ", "eagle.", 1)) from None


def check_eagle_settings(cfg: DictConfig) -> int:
    """Every cfg.eagle setting checked from the config alone (a head on the meta device, no
    weights): the head's config, loss weights, and the drafter the report will use (tree
    sizes, total_tokens >= depth, top_k within the vocabulary). Returns the version."""
    version = eagle_version(cfg)
    with torch.device("meta"):
        meta_head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    eagle_drafter(cfg, meta_head)
    e = cfg.eagle
    for key in ("feature_weight", "token_weight", "feature_noise"):
        if not float(e[key]) >= 0:
            raise ValueError(f"eagle.{key} must be >= 0, got {e[key]}")
    if not float(e.ttt_decay) > 0:
        raise ValueError(f"eagle.ttt_decay must be > 0 (step j weighs decay**j), "
                         f"got {e.ttt_decay}")
    if not is_count(e.ttt_steps):
        raise ValueError(f"eagle.ttt_steps must be an integer >= 1, got {e.ttt_steps!r}")
    return version


def eagle_drafter(cfg: DictConfig, eagle: EagleHead) -> EagleDrafter:
    """train/eagle.py's drafter: version 1 a static tree (cfg.tree's `choices`), versions 2
    and 3 an EAGLE-2 dynamic tree (eagle.total_tokens, eagle.depth, eagle.top_k)."""
    e, sampled = cfg.eagle, bool(cfg.eagle.sampled_children)
    if eagle_version(cfg) == 1:
        if cfg.tree.get("choices") is None:
            raise ValueError(f"eagle.version=1 drafts a static tree: pick one with `choices` "
                             f"(tree=chain4|medusa_small|medusa_63), not tree={cfg.tree.name}; "
                             f"or draft dynamic trees with eagle.version=2")
        choices = OmegaConf.to_container(cfg.tree.choices)
        return EagleDrafter(eagle, Tree.from_paths(choices), sampled_children=sampled)
    return EagleDrafter(eagle, total_tokens=e.total_tokens, depth=e.depth, top_k=e.top_k,
                        sampled_children=sampled)


def eagle_head(cfg: DictConfig, target: Transformer) -> tuple[EagleHead, EagleConfig]:
    """A fresh head sized for the target (EAGLE-3: its draft vocabulary, and then its LM head
    rows, come from the training rows: `from_config.eagle_draft_vocab`)."""
    config = eagle_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    fresh = EagleHead(config).to(target.embed_tokens.weight.dtype)
    return fresh, config


def load_eagle(folder: str | Path, target: Transformer) -> EagleHead:
    """The head of a train/eagle.py export (refused when trained for another target)."""
    return load_head(folder, EagleHead, EagleConfig, target=target)
