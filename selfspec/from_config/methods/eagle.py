"""EAGLE heads (`EagleHead`, drafted by `EagleDrafter`): a one-layer head over the target's
features, trained by train/eagle.py. eagle.version 1: an EAGLE-1 head drafting a static tree;
2: the same head drafting EAGLE-2 dynamic trees; 3: an EAGLE-3 head (fused target layers, a
draft vocabulary, trained with the training-time test) drafting dynamic trees.

Rows: eagle, at each draft length k an EAGLE-2 dynamic tree k deep with eagle.total_tokens
nodes and eagle.top_k children per frontier node (whatever the head's version); a P-EAGLE head
(trained with eagle.parallel=K) drafts its k <= K tokens from one forward instead, a chain or
(eagle.tree_nodes) a best-first tree (`ParallelEagleDrafter`).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from selfspec.checks import is_count
from selfspec.drafters import EagleDrafter, ParallelEagleDrafter
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    head_folder,
    one_variant,
    required_head_folder,
    when_set,
)
from selfspec.heads.draft_vocab import DraftVocab, load_draft_vocab
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.model import Transformer

HEAD = "eagle_head"  # the setting naming the head's export folder


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEAD, "eagle", "eagle", "a trained head")
    check_eagle_tree(cfg, lengths)
    size = cfg.eagle.get("draft_vocab")
    if size is not None and not is_count(size):
        raise ValueError(f"eagle.draft_vocab must be null or a token count >= 1, got {size!r}")


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


def drafter(loaded: Loaded, variant: Variant, k: int) -> EagleDrafter | ParallelEagleDrafter:
    e, eagle = loaded.cfg.eagle, head(loaded)
    if eagle.config.parallel > 1:
        if k > eagle.config.parallel:
            raise ValueError(f"eagle: the P-EAGLE head at {loaded.cfg[HEAD]} drafts at most "
                             f"{eagle.config.parallel} tokens a forward; use num_draft_tokens "
                             f"<= {eagle.config.parallel}")
        return ParallelEagleDrafter(eagle, k, tree_nodes=e.get("tree_nodes"),
                                    sampled_children=e.sampled_children)
    return EagleDrafter(eagle, total_tokens=e.total_tokens, depth=k, top_k=e.top_k,
                        sampled_children=e.sampled_children, draft_vocab=draft_vocab(loaded))


def draft_vocab(loaded: Loaded) -> DraftVocab | None:
    """eagle.draft_vocab=K: the K most frequent tokens of the head's training data (the counts
    train/eagle.py keeps beside its export); null: the whole vocabulary."""
    size = loaded.cfg.eagle.get("draft_vocab")
    if size is None:
        return None
    folder = head_folder(loaded.cfg, HEAD)
    return loaded.once(f"eagle_vocab/{size}", lambda: load_draft_vocab(folder, size))


def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
    head(loaded)


ENTRIES = (MethodEntry(
    name="eagle",
    summary="an EAGLE-1/EAGLE-3 head over the target's features, drafting EAGLE-2 trees",
    variants=one_variant("eagle"), load=load, drafter=drafter, check=check,
    default_when=when_set(HEAD), head=EagleHead, color="tab:red", order=40),)


def load_eagle(folder: str | Path, target: Transformer) -> EagleHead:
    """The head of a train/eagle.py export (refused when trained for another target)."""
    return load_head(folder, EagleHead, EagleConfig, target=target)
