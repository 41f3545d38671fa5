"""Lookahead decoding (`LookaheadDrafter`): Jacobi iterations over a window of W future
positions ride along in the verification forward, fill a pool of n-grams, and up to G of them
that start with the last token are verified as a tree. No training, no second model.

Rows: lookahead/W{W}N{N}G{G} for each lookahead.window x ngram x candidates; at draft length k
the n-grams are cut to k tokens (lengths beyond N - 1 fold into N - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from selfspec.checks import is_count
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.measure.grid import Variant

SETTINGS = ("window", "ngram", "candidates")


@dataclass(frozen=True)
class LookaheadVariant(Variant):
    method: str = "lookahead"
    window: int = 4  # W: the Jacobi window's columns
    ngram: int = 4  # N: the n-gram size (N - 1 levels of guesses)
    candidates: int = 4  # G: the most n-grams verified a step

    def label(self) -> str:
        return f"{self.method}/W{self.window}N{self.ngram}G{self.candidates}"


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[LookaheadVariant, ...]:
    axes = {key: as_list(cfg.lookahead.get(key)) for key in SETTINGS}
    for key, values in axes.items():
        low = 3 if key == "ngram" else 1
        if not values or not all(is_count(v) and v >= low for v in values):
            raise ValueError(f"lookahead.{key}: give integers >= {low}, got {values}")
    return tuple(LookaheadVariant(window=w, ngram=n, candidates=g) for w in axes["window"]
                 for n in axes["ngram"] for g in axes["candidates"])


def fold_lengths(cfg: DictConfig, variant: LookaheadVariant, lengths: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """An n-gram of N tokens drafts N - 1 after the root: longer lengths would repeat it."""
    return tuple(sorted({min(k, variant.ngram - 1) for k in lengths}))


def drafter(loaded: Loaded, variant: LookaheadVariant, k: int) -> LookaheadDrafter:
    return LookaheadDrafter(variant.window, variant.ngram, variant.candidates, depth=k)


ENTRIES = (MethodEntry(
    name="lookahead",
    summary="Lookahead decoding: Jacobi iterations fill an n-gram pool, verified as a tree",
    variants=variants, drafter=drafter, lengths=fold_lengths, color="tab:cyan", order=15),)
