"""Medusa's candidates and n-gram lookup's, merged into one tree (`UnionDrafter`): a static
tree of head ranks (ngram.medusa_choices) and the lookup draft, Medusa's first, at most
ngram.merged_nodes nodes. Needs medusa_heads.

Rows: ngram+medusa (lookup chains), or with a corpus ngram+medusa/tree{N} (lookup trees of N
nodes) for each of ngram.tree_nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_count
from selfspec.drafters import LookupCorpus, MedusaDrafter, UnionDrafter
from selfspec.from_config.methods import medusa, ngram
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    required_head_folder,
)
from selfspec.heads.medusa import MedusaHeads
from selfspec.measure.grid import Variant
from selfspec.tree import Tree

NAME = "ngram+medusa"


@dataclass(frozen=True)
class UnionVariant(Variant):
    method: str = NAME
    tree_nodes: int | None = None  # the lookup's tree of this many nodes (None: a chain)

    def label(self) -> str:
        return self.method if self.tree_nodes is None else f"{self.method}/tree{self.tree_nodes}"


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[UnionVariant, ...]:
    counts = ngram.check_ngram_settings(cfg.ngram, cfg.model)
    if not cfg.ngram.get("corpus"):
        return (UnionVariant(),)
    if not for_sweep and len(counts) > 1:
        raise ValueError(f"ngram.tree_nodes: give one node count (or null) here, got {counts}; "
                         f"a list is for eval/sweep.py")
    return tuple(UnionVariant(tree_nodes=n) for n in counts)


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """The heads' folder, the merged size, and Medusa choices the heads can fill (their count
    read from the export's head_config.json, no weights)."""
    required_head_folder(cfg, medusa.HEADS, NAME, "medusa")
    merged_nodes(cfg.ngram)
    depth, num_heads = medusa_choices(cfg.ngram).max_depth, medusa.num_medusa_heads(cfg)
    if num_heads and depth > num_heads:
        raise ValueError(f"ngram.medusa_choices are {depth} deep but the heads of "
                         f"medusa_heads={cfg.medusa_heads} are {num_heads} (depth d uses head "
                         f"d-1); use choices at most {num_heads} deep")


def load(loaded: Loaded, chosen: tuple[UnionVariant, ...]) -> None:
    medusa.heads_and_target(loaded)
    if loaded.cfg.ngram.get("corpus"):
        ngram.lookup_corpus(loaded)


def drafter(loaded: Loaded, variant: UnionVariant, k: int) -> UnionDrafter:
    heads, _ = medusa.heads_and_target(loaded)
    corpus = ngram.lookup_corpus(loaded) if loaded.cfg.ngram.get("corpus") else None
    return ngram_medusa_drafter(loaded.cfg.ngram, k, heads, corpus, variant.tree_nodes)


ENTRIES = (MethodEntry(
    name=NAME, summary="Medusa's candidates and n-gram lookup merged into one tree",
    variants=variants, load=load, drafter=drafter, check=check, verified_on=medusa.verified_on,
    color="tab:olive", order=30),)


def ngram_medusa_drafter(cfg_ngram: DictConfig, k: int, heads: MedusaHeads,
                         corpus: LookupCorpus | None,
                         tree_nodes: int | None = None) -> UnionDrafter:
    """Medusa's candidates (ngram.medusa_choices) and n-gram lookup k deep (`ngram_drafter`)
    merged into one tree of at most ngram.merged_nodes nodes, Medusa's first."""
    candidates = MedusaDrafter(heads, medusa_choices(cfg_ngram))
    lookup = ngram.ngram_drafter(cfg_ngram, k, corpus, tree_nodes)
    return UnionDrafter([candidates, lookup], max_nodes=merged_nodes(cfg_ngram))


def medusa_choices(cfg_ngram: DictConfig) -> Tree:
    """ngram.medusa_choices as a tree (ngram+medusa's Medusa part), checked."""
    choices = cfg_ngram.get("medusa_choices")
    fix = "give Medusa choices, lists of head ranks such as [[0],[1],[0,0]]"
    if not OmegaConf.is_list(choices) or not choices:
        raise ValueError(f"ngram.medusa_choices: {fix}, got {choices!r}")
    try:
        return Tree.from_paths(OmegaConf.to_container(choices))
    except (ValueError, TypeError) as error:
        raise ValueError(f"ngram.medusa_choices: {fix}; {error}") from None


def merged_nodes(cfg_ngram: DictConfig) -> int:
    value = cfg_ngram.get("merged_nodes")
    if not is_count(value):
        raise ValueError(f"ngram.merged_nodes must be an integer >= 1 (the merged tree's most "
                         f"nodes), got {value!r}")
    return value
