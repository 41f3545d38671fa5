"""selfspec's side of the EAGLE-3 and P-EAGLE comparisons with the peers' own classes
(tests/peers/test_speculators.py, test_specforge.py): the logits a head gives for rows the
peers' training forwards lay out, on the same random fused streams."""

from __future__ import annotations

import torch

from selfspec import Transformer
from selfspec.heads import EagleHead


def eagle3_logits(head: EagleHead, target: Transformer, ids: torch.Tensor,
                  fused: torch.Tensor) -> torch.Tensor:
    """[T, draft V]: row t reads (token t, fused streams t), one pass (no fed-back draft).
    ids [T]; fused [T, 3h], the three streams side by side."""
    streams = fused[None].chunk(3, dim=-1)
    with torch.no_grad():
        out = head(target.embed_tokens(ids[None]), head.target_feature(None, streams),
                   torch.arange(len(ids)))
        return head.logits(out)[0]


def peagle_rows(length: int, anchors: list[int], parallel: int) -> dict[str, torch.Tensor]:
    """P-EAGLE rows in the peers' sampled order: every position at depth 0, then each anchor
    at depth 1, at depth 2, ... K - 1 (the row of anchor a at depth d stands at position
    a + d)."""
    rows = [*range(length)] + anchors * (parallel - 1)
    depths = [0] * length + [d for d in range(1, parallel) for _ in anchors]
    return {"peagle_anchor": torch.tensor(rows), "peagle_depth": torch.tensor(depths)}


def peagle_logits(head: EagleHead, target: Transformer, ids: torch.Tensor, fused: torch.Tensor,
                  anchors: list[int]) -> torch.Tensor:
    """[rows, draft V] in peagle_rows' order, as selfspec drafts: depth 0 is the head over the
    real pairs; anchor a's depth d the d-th of the head's K - 1 mask pairs riding after the
    real pairs 0..a, causally, at positions a + 1..a + K - 1 (ParallelEagleDrafter's
    forward)."""
    k, mask = head.config.parallel, head.config.mask_token_id
    feature = head.target_feature(None, fused[None].chunk(3, dim=-1))  # [1, T, h]
    embeds = target.embed_tokens(ids[None])  # [1, T, h]
    mask_embed, mask_feature = head.mask_pairs(target.embed_tokens.weight[mask], k - 1)
    rows = [eagle3_logits(head, target, ids, fused)]
    with torch.no_grad():
        for depth in range(1, k):
            for a in anchors:
                out = head(torch.cat([embeds[:, :a + 1], mask_embed[None]], dim=1),
                           torch.cat([feature[:, :a + 1], mask_feature[None]], dim=1),
                           torch.arange(a + k))
                rows.append(head.logits(out)[0, a + depth][None])
    return torch.cat(rows)
