"""P-EAGLE's training rules, selfspec's and speculators' (peagle=published takes theirs):
the kept mask copies (`kept_copies`: PARD's conditional drop, copy j kept with probability
keep once copy j - 1 is, and with a floor speculators' share max(keep**j, floor)), and the
loss (`parallel_eagle3_loss`: one mean a copy, or pooled, one mean over every kept row)."""

import pytest
import torch

from selfspec.divergences import forward_kl
from selfspec.from_config.methods.eagle import copy_keep_chances, kept_copies
from selfspec.heads.eagle_losses import parallel_eagle3_loss

ANCHORS = 50_000  # the share's standard error is below 2.3e-3


@pytest.mark.parametrize("keep, floor", [(0.7, 0.2), (0.5, 0.0), (0.3, 0.5)])
def test_copy_j_is_kept_with_probability_max_of_keep_to_the_j_and_the_floor(keep, floor):
    depth = kept_copies(ANCHORS, 8, keep, floor, torch.Generator().manual_seed(0))
    for j in range(1, 8):
        share = (depth >= j).double().mean().item()
        assert abs(share - max(keep**j, floor)) < 1e-2, (j, share)


def test_without_a_floor_the_draws_are_pards_as_before():
    """floor 0 keeps the conditional chance `keep` at every copy: the same draws give the
    same copies as the plain conditional drop."""
    assert copy_keep_chances(5, 0.5) == [0.5] * 4
    ours = kept_copies(1000, 5, 0.5, 0.0, torch.Generator().manual_seed(1))
    draws = torch.rand(1000, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours, (draws < 0.5).long().cumprod(dim=1).sum(dim=1))


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_pooled_loss_is_one_mean_over_every_kept_row_of_every_copy(decay):
    """Copy 0 at positions 0..7 (6 rows score a token inside the row), copy 1 at 2, 4, 5:
    pooled, 9 rows in one mean (copy 1's weighing decay); per copy, two means summed."""
    length, vocab = 8, 6
    torch.manual_seed(0)
    target_logits = torch.randn(1, length, vocab)
    copies = torch.tensor([0] * length + [1] * 3)
    positions = torch.cat([torch.arange(length), torch.tensor([2, 4, 5])])
    logits = torch.randn(1, len(copies), vocab)
    counted = positions + 2 < length
    kl = forward_kl(logits[0, counted], torch.log_softmax(
        target_logits[0, positions[counted] + 1], dim=-1))  # [9]
    weights = decay ** copies[counted].float()
    every = torch.ones(vocab, dtype=torch.bool)
    pooled = parallel_eagle3_loss(logits, copies, positions, target_logits, every, 2,
                                  decay=decay, pooled=True).loss
    per_copy = parallel_eagle3_loss(logits, copies, positions, target_logits, every, 2,
                                    decay=decay).loss
    assert torch.allclose(pooled, (weights * kl).sum() / 9)
    assert torch.allclose(per_copy, kl[:6].mean() + decay * kl[6:].mean())
    assert not torch.allclose(pooled, per_copy)
