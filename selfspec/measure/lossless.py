"""The lossless check: greedy speculative output against plain greedy output, prompt by
prompt, with each difference's top-2 logit gap (a near-tie of a low-precision dtype is told
apart from a real failure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.measure.peers import Decoder, OurDecoder
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams

if TYPE_CHECKING:  # passes imports this module
    from selfspec.measure.passes import Method


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


# In bf16/fp16 one forward over N+1 tokens and one over a single token may round a greedy
# near-tie differently, so speculative greedy output may leave plain greedy output where plain
# decoding's two best logits lie within a few units in the last place of the dtype, at the
# logits' scale. fp32 gets no allowance: there the outputs must match token for token.
NEAR_TIE_ULPS = 4


def near_tie_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The top-2 logit gap under which a divergence in `dtype` counts as a numeric tie."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0.0
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * float(logits.abs().max())


def top2_gap(logits: torch.Tensor) -> float:
    best = logits.float().topk(2).values
    return float(best[0] - best[1])


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
    shares = [_common_prefix(a, b) / max(len(a), 1) for a, b in zip(ours, theirs, strict=True)]
    return sum(shares) / max(len(shares), 1)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first difference (the shorter length when one is a prefix of the other)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


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
            at = _common_prefix(want, got)
            gap, tolerance = _closeness(method.baseline, [*ids, *want[:at]])
            found.append(Mismatch(method.name, method.draft_length, prompt_id, at,
                                  list(want[at:]), list(got[at:]), gap, tolerance))
    return found


def first_difference(baseline: Decoder, prompts: Sequence[Sequence[int]],
                     expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]]
                     ) -> dict | None:
    """Where greedy outputs `got` first leave `expected` (the first prompt that differs):
    its index, the new token's, and plain decoding's top-2 logit gap there beside the dtype's
    near-tie tolerance, so a bf16 tie broken the other way reads apart from a real failure.
    None when every output agrees."""
    for index, (ids, want, have) in enumerate(zip(prompts, expected, got, strict=True)):
        if list(want) != list(have):
            at = _common_prefix(want, have)
            gap, tolerance = _closeness(baseline, [*ids, *want[:at]])
            return {"prompt": index, "position": at, "top2_gap": gap, "tolerance": tolerance,
                    "near_tie": gap is not None and tolerance > 0 and gap <= tolerance}
    return None


def describe_difference(difference: dict | None) -> str:
    """'' when none; else where, and whether it is a near-tie of the dtype."""
    if difference is None:
        return ""
    where = f"prompt {difference['prompt']}, new token {difference['position']}"
    if difference["top2_gap"] is None:
        return where
    verdict = "a near-tie" if difference["near_tie"] else "NOT a near-tie"
    return f"{where}: top-2 gap {difference['top2_gap']:.3g}, {verdict}"


def _closeness(baseline: Decoder, ids: list[int]) -> tuple[float | None, float]:
    """Plain decoding's top-2 logit gap after ids, and the near-tie tolerance of its dtype."""
    if not hasattr(baseline, "next_token_logits"):
        return None, 0.0
    logits, dtype = baseline.next_token_logits(ids)
    return top2_gap(logits), near_tie_tolerance(logits, dtype)
