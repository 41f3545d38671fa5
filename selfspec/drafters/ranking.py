"""Ranking a head's candidates: the top tokens of each row, ties in token-id order (shared by
the Medusa and EAGLE drafters)."""

from __future__ import annotations

import torch


def ranked(logits: torch.Tensor, count: int) -> torch.Tensor:
    """[depth, count] the `count` most likely token ids per row, most likely first. Equal
    logits rank by token id, the same rule as logits_to_probs' cut-offs.

    A top-k instead of a sort of the whole vocabulary (which cost a millisecond per step);
    only a tie across the cut, where top-k may pick any of the tied ids, ranks the full row.
    """
    vocab = logits.shape[-1]
    if count >= vocab:
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices
    values, ids = torch.topk(logits, count + 1, dim=-1)  # [depth, count + 1], sorted
    if (values[:, count - 1] == values[:, count]).any():
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :count]
    by_id = ids.argsort(dim=-1)  # then a stable sort by value keeps ties in id order
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order)[:, :count]
