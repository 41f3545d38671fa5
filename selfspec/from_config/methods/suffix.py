"""Suffix decoding (`SuffixDrafter`): suffix trees over this generation's tokens and over a
store of the target's earlier answers, learnt online; frequency-scored chains or trees whose
size follows the match length. No weights.

Rows: suffix (chains) and suffix/tree (best-first trees), one per suffix.tree entry. Each
(row, draft length) builds one drafter with an empty `SuffixStore`, and that store persists
across everything the row then times: its prompts in order and its repeats (a batch's rows
write to it together; the warmup's answers are forgotten first), so later prompts draft from
earlier answers, and a repeat finds its own prompt's earlier answer (online learning, as a
server would see it).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from selfspec.checks import is_count, is_number
from selfspec.drafters.suffix import SuffixDrafter, SuffixSettings, SuffixStore
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.measure.grid import Variant


@dataclass(frozen=True)
class SuffixVariant(Variant):
    method: str = "suffix"
    tree: bool = False  # best-first trees of k nodes, not chains of k tokens

    def label(self) -> str:
        return f"{self.method}/tree" if self.tree else self.method


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[SuffixVariant, ...]:
    """A row per suffix.tree entry (a single generation takes one)."""
    check_suffix_settings(cfg.suffix)
    trees = as_list(cfg.suffix.get("tree"))
    if not trees or not all(isinstance(t, bool) for t in trees):
        raise ValueError(f"suffix.tree: give true or false (or a list of them), got {trees}")
    if not for_sweep and len(trees) > 1:
        raise ValueError(f"suffix.tree: give one value here, got {trees}; a list is for "
                         f"eval/sweep.py")
    return tuple(SuffixVariant(tree=t) for t in trees)


def check_suffix_settings(cfg_suffix: DictConfig) -> None:
    """suffix.*'s values, checked before anything loads."""
    if not is_count(cfg_suffix.max_tree_depth, 2):
        raise ValueError(f"suffix.max_tree_depth must be an integer >= 2, got "
                         f"{cfg_suffix.max_tree_depth!r}")
    for key in ("max_spec_factor", "max_spec_offset", "min_token_prob"):
        if not is_number(cfg_suffix[key]):
            raise ValueError(f"suffix.{key} must be a number, got {cfg_suffix[key]!r}")
    suffix_settings(cfg_suffix, 1, False)  # the ranges (SuffixSettings' own check)


def suffix_settings(cfg_suffix: DictConfig, k: int, tree: bool) -> SuffixSettings:
    return SuffixSettings(num_draft_tokens=k, max_spec_factor=float(cfg_suffix.max_spec_factor),
                          max_spec_offset=float(cfg_suffix.max_spec_offset),
                          min_token_prob=float(cfg_suffix.min_token_prob), tree=tree)


def suffix_drafter(cfg_suffix: DictConfig, k: int, tree: bool) -> SuffixDrafter:
    """Suffix decoding drafting at most k tokens (a tree of at most k nodes when `tree`), over
    a store of its own that learns from everything it then decodes."""
    return SuffixDrafter(SuffixStore(int(cfg_suffix.max_tree_depth)),
                         suffix_settings(cfg_suffix, k, tree))


def drafter(loaded: Loaded, variant: SuffixVariant, k: int) -> SuffixDrafter:
    return suffix_drafter(loaded.cfg.suffix, k, variant.tree)


ENTRIES = (MethodEntry(
    name="suffix",
    summary="suffix decoding: suffix trees over the context and the target's earlier answers, "
            "learnt online",
    variants=variants, drafter=drafter, color="goldenrod", order=12),)
