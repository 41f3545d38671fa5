"""Ranking tokens: the top of each row of logits, ties in token-id order, the one rule of the
heads' candidates (Medusa, EAGLE, a draft model's first tokens) and of the top-k and top-p
cuts of `sampling.logits_to_probs`."""

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


def ranked_on_device(logits: torch.Tensor, count: int) -> torch.Tensor:
    """`ranked` without reading anything back to the host (a static, captured step): the same
    [rows, count] ids, ties in token id order across the cut too, from two top-k's instead of
    a test for a tie and a sort."""
    vocab = logits.shape[-1]
    if count >= vocab:  # the whole row: a stable sort reads nothing back either
        return torch.sort(logits, dim=-1, descending=True, stable=True).indices
    values, ids = torch.topk(logits, count, dim=-1)  # [rows, count], sorted by value
    by_id = ids.argsort(dim=-1)  # then a stable sort by value keeps ties in id order
    ids, values = ids.gather(-1, by_id), values.gather(-1, by_id)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    ids, values = ids.gather(-1, order), values.gather(-1, order)
    # At the cut, the tied ids topk chose may be any of them: take the lowest instead.
    cut = values[:, -1:]  # [rows, 1]
    above = (values > cut).sum(dim=-1, keepdim=True)  # [rows, 1] ranks before the cut's value
    lowest = torch.arange(vocab, 0, -1, device=logits.device)  # larger for a lower id
    tied = torch.topk(torch.where(logits == cut, lowest, 0), count, dim=-1).values
    tied_ids = vocab - tied  # [rows, count] the tied ids, lowest first
    rank = torch.arange(count, device=logits.device)
    at_cut = tied_ids.gather(-1, (rank - above).clamp(min=0))
    return torch.where(rank < above, ids, at_cut)
