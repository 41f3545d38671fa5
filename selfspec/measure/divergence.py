"""Where two greedy outputs part, and how close plain decoding's choice was there: its top-2
logit gap against the near-tie tolerance of the model's dtype, so that a tie of a
low-precision dtype broken the other way reads apart from a real failure."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.measure.peers import Decoder

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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first difference (the shorter length when one is a prefix of the other)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def first_difference(baseline: Decoder, prompts: Sequence[Sequence[int]],
                     expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]]
                     ) -> dict | None:
    """Where greedy outputs `got` first leave `expected` (the first prompt that differs):
    its index, the new token's, and plain decoding's top-2 logit gap there beside the dtype's
    near-tie tolerance, so a bf16 tie broken the other way reads apart from a real failure.
    None when every output agrees."""
    for index, (ids, want, have) in enumerate(zip(prompts, expected, got, strict=True)):
        if list(want) != list(have):
            at = common_prefix(want, have)
            gap, tolerance = closeness(baseline, [*ids, *want[:at]])
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


def closeness(baseline: Decoder, ids: list[int]) -> tuple[float | None, float]:
    """Plain decoding's top-2 logit gap after ids, and the near-tie tolerance of its dtype."""
    if not hasattr(baseline, "next_token_logits"):
        return None, 0.0
    logits, dtype = baseline.next_token_logits(ids)
    return top2_gap(logits), near_tie_tolerance(logits, dtype)
