"""Heads and drafters from configs: eval/generate.py's drafter, Medusa heads, trees and
their settings."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.build.common import checked_settings, device, sampling_params
from selfspec.build.models import (
    draft_model_config,
    load_model,
    load_target,
    model_config,
    resolve_model_path,
)
from selfspec.decode import GenerationSettings
from selfspec.drafters import (
    Drafter,
    MedusaDrafter,
    MedusaProductDrafter,
    NgramDrafter,
    SmallModelDrafter,
)
from selfspec.heads.io import load_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.lora import ADAPTER_DIR, LoraSettings, merge_adapter
from selfspec.model import ModelConfig, Transformer
from selfspec.tree import Tree

DRAFTERS = ("small_model", "ngram", "none")


def generation_settings(cfg: DictConfig) -> GenerationSettings:
    """eval/generate.py's settings, checked with its device, target folder and drafter choice
    before any model loads."""
    device(cfg)
    resolve_model_path(cfg.model)
    drafter_choice(cfg)
    return GenerationSettings(max_new_tokens=cfg.max_new_tokens,
                              sampling=sampling_params(cfg.sampling), seed=int(cfg.seed))


def drafter_choice(cfg: DictConfig) -> tuple[str, int]:
    """(cfg.drafter, cfg.num_draft_tokens), checked; the small draft model must be on disk."""
    kind, k = cfg.drafter, cfg.num_draft_tokens
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DRAFTERS)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
    if kind == "small_model":
        resolve_model_path(draft_model_config(cfg, "use drafter=ngram"), "model.draft")
    return kind, k


def build_drafter(cfg: DictConfig, target: Transformer) -> Drafter | None:
    """The drafter named by cfg.drafter (small_model | ngram | none); None = plain decoding."""
    kind, k = drafter_choice(cfg)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(num_draft_tokens=k)
    draft_cfg = draft_model_config(cfg, "use drafter=ngram")
    draft = load_model(draft_cfg, "model.draft", cfg.model.dtype, device(cfg))
    return SmallModelDrafter(draft, num_draft_tokens=k)


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


def medusa_config(cfg: DictConfig, target_config: ModelConfig) -> MedusaConfig:
    return checked_settings(MedusaConfig, "medusa", hidden_size=target_config.hidden_size,
                            vocab_size=target_config.vocab_size,
                            num_heads=int(cfg.medusa.num_heads),
                            num_layers=int(cfg.medusa.num_layers))


def check_medusa_settings(cfg: DictConfig) -> int:
    """Every cfg.medusa setting checked from the config alone (no weights); returns the
    version. A model without an `arch` block has its config.json read, nothing more."""
    version = medusa_version(cfg)
    medusa_config(cfg, model_config(cfg.model))
    if not float(cfg.medusa.decay) > 0:
        raise ValueError(f"medusa.decay must be > 0 (head k weighs decay**k), "
                         f"got {cfg.medusa.decay}")
    if version == 2:
        lora_settings(cfg)
        if not float(cfg.medusa.lm_weight) >= 0:
            raise ValueError(f"medusa.lm_weight must be >= 0, got {cfg.medusa.lm_weight}")
    return version


def medusa_heads(cfg: DictConfig, target: Transformer) -> tuple[MedusaHeads, MedusaConfig]:
    """Fresh Medusa heads sized for the target (output layers copied from its LM head)."""
    config = medusa_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    heads = MedusaHeads(config).to(target.embed_tokens.weight.dtype)
    if cfg.medusa.init_from_lm_head:
        heads.init_from_lm_head(target.lm_head.weight.detach())
    return heads, config


def medusa_version(cfg: DictConfig) -> int:
    """1: heads on the frozen target (Medusa-1); 2: heads and LoRA on the target (Medusa-2)."""
    version = cfg.medusa.get("version", 1)
    if version not in (1, 2):
        raise ValueError(f"medusa.version must be 1 (frozen target) or 2 (joint training with "
                         f"LoRA on the target), got {version!r}")
    return int(version)


def lora_settings(cfg: DictConfig) -> LoraSettings:
    lora = cfg.medusa.lora
    return LoraSettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=tuple(str(m) for m in lora.target_modules))


def load_medusa(
    cfg: DictConfig, folder: str | Path, target: Transformer
) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of a train/medusa.py export, and for a Medusa-2 export the target they draft
    for: a fresh copy of cfg's target with the export's LoRA adapter merged (None for
    Medusa-1, whose heads draft for `target` itself, which is never modified)."""
    heads = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    adapter = Path(folder) / ADAPTER_DIR
    return heads, merge_adapter(load_target(cfg), adapter) if adapter.is_dir() else None
