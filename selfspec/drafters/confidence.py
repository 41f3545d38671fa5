"""The confidence stop shared by linear drafters (Kangaroo; Hugging Face's
`assistant_confidence_threshold`): a chain draft ends after the first token whose top-1
probability under the drafter's own unwarped law falls below a threshold.

The token that falls below is still proposed (it is drafted already, and one more row costs
verification little); no further token is drafted after it. Whether to go on depends only on
what the drafter itself computed, so verification stays exact.
"""

from __future__ import annotations

import torch

from selfspec.checks import is_number


def check_confidence_threshold(who: str, threshold: float | None) -> float | None:
    """None (never stop early) or a number in (0, 1); anything else is a clear error."""
    if threshold is None:
        return None
    if not is_number(threshold) or not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"{who}: confidence_threshold must lie in (0, 1) (the top-1 "
                         f"probability under which drafting stops) or be None, got {threshold!r}")
    return float(threshold)


def below_confidence(logits: torch.Tensor, threshold: float | None) -> bool:
    """Whether the top-1 probability of softmax(logits [V]) is below the threshold (never,
    for None). One host sync: the draft's length is decided on the host."""
    if threshold is None:
        return False
    return float(torch.softmax(logits.float(), dim=-1).max()) < threshold
