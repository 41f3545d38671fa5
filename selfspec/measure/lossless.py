"""The lossless check: greedy speculative output against plain greedy output, prompt by
prompt, with each difference's top-2 logit gap (a near-tie of a low-precision dtype is told
apart from a real failure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from selfspec.measure.divergence import closeness, common_prefix
from selfspec.measure.passes import Method
from selfspec.measure.peers import Decoder, OurDecoder
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from plain greedy: where, the tokens from there on, and
    how close plain decoding's choice was there: its top-2 logit gap and the near-tie
    tolerance of the model's dtype (see `near_tie_tolerance`)."""

    method: str
    draft_length: int
    prompt_id: str
    position: int  # index of the first differing new token
    expected: list[int]
    got: list[int]
    top2_gap: float | None = None  # None: the baseline cannot say
    tolerance: float = 0.0

    @property
    def near_tie(self) -> bool:
        """A numeric tie of a low-precision dtype rather than a failure of the method."""
        return self.top2_gap is not None and self.tolerance > 0 and self.top2_gap <= self.tolerance

    def describe(self) -> str:
        text = (f"{self.method} k={self.draft_length} on prompt {self.prompt_id}: first "
                f"difference at new token {self.position}: expected {self.expected[:8]}, "
                f"got {self.got[:8]}")
        if self.top2_gap is None:
            return text
        verdict = ("a numeric near-tie" if self.near_tie else "a real failure")
        return (f"{text}; plain decoding's top-2 logit gap there {self.top2_gap:.4g} "
                f"(near-tie tolerance {self.tolerance:.4g}): {verdict}")


def greedy_outputs(
    decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[list[int]]:
    greedy = SamplingParams()
    return [decoder(p, greedy, max_new_tokens, 0, stop_ids).tokens for p in prompts]


def greedy_agreement(
    reference: Transformer, other: Transformer, prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> float:
    """Mean share of each plain greedy continuation of `reference` that `other` reproduces
    before their first difference (1.0: identical outputs): how far an adapted target drifted."""
    ours, theirs = (greedy_outputs(OurDecoder(m), prompts, max_new_tokens)
                    for m in (reference, other))
    shares = [common_prefix(a, b) / max(len(a), 1) for a, b in zip(ours, theirs, strict=True)]
    return sum(shares) / max(len(shares), 1)


def lossless_mismatches(
    method: Method,
    prompts: Sequence[tuple[str, Sequence[int]]],
    reference: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[Mismatch]:
    """Every prompt (id, ids) whose greedy output under `method` differs from `reference`
    (the baseline's greedy outputs, see `greedy_outputs`)."""
    outputs = greedy_outputs(method.decoder, [ids for _, ids in prompts], max_new_tokens, stop_ids)
    found = []
    for (prompt_id, ids), want, got in zip(prompts, reference, outputs, strict=True):
        if list(want) != list(got):
            at = common_prefix(want, got)
            gap, tolerance = closeness(method.baseline, [*ids, *want[:at]])
            found.append(Mismatch(method.name, method.draft_length, prompt_id, at,
                                  list(want[at:]), list(got[at:]), gap, tolerance))
    return found
