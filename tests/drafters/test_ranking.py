"""Ranking candidates (drafters/ranking.py): the top of each row, ties in token id order."""

import pytest
import torch

from selfspec.drafters.ranking import ranked


@pytest.mark.parametrize("levels", [3, 40, 10_000])  # many ties ... almost none
@pytest.mark.parametrize("count", [1, 4, 10, 24])
def test_ranking_takes_the_top_candidates_with_ties_in_token_id_order(levels, count):
    g = torch.Generator().manual_seed(levels + count)
    logits = torch.randint(levels, (4, 24), generator=g).float()  # [heads, V]
    full = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :count]
    assert torch.equal(ranked(logits, count), full)
