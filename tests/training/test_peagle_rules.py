"""P-EAGLE's kept mask copies (`kept_copies`): PARD's conditional drop, copy j kept with
probability keep once copy j - 1 is, and with a floor speculators' kept share max(keep**j,
floor) (peagle=published: 0.7 and 0.2)."""

import pytest
import torch

from selfspec.training.objectives import copy_keep_chances, kept_copies

ANCHORS = 200_000  # the share's standard error is below 1e-3


@pytest.mark.parametrize("keep, floor", [(0.7, 0.2), (0.5, 0.0), (0.3, 0.5)])
def test_copy_j_is_kept_with_probability_max_of_keep_to_the_j_and_the_floor(keep, floor):
    depth = kept_copies(ANCHORS, 8, keep, floor, torch.Generator().manual_seed(0))
    for j in range(1, 8):
        share = (depth >= j).double().mean().item()
        assert abs(share - max(keep**j, floor)) < 5e-3, (j, share)


def test_without_a_floor_the_draws_are_pards_as_before():
    """floor 0 keeps the conditional chance `keep` at every copy: the same draws give the
    same copies as the plain conditional drop."""
    assert copy_keep_chances(5, 0.5) == [0.5] * 4
    ours = kept_copies(1000, 5, 0.5, 0.0, torch.Generator().manual_seed(1))
    draws = torch.rand(1000, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours, (draws < 0.5).long().cumprod(dim=1).sum(dim=1))
