"""Ranking candidates (`selfspec.ranking`): the top of each row, ties in token id order."""

import pytest
import torch

from selfspec.devices import HostReads
from selfspec.ranking import ranked, ranked_on_device


@pytest.mark.parametrize("levels", [3, 40, 10_000])  # many ties ... almost none
@pytest.mark.parametrize("count", [1, 4, 10, 24])
def test_ranking_takes_the_top_candidates_with_ties_in_token_id_order(levels, count):
    g = torch.Generator().manual_seed(levels + count)
    logits = torch.randint(levels, (4, 24), generator=g).float()  # [heads, V]
    full = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :count]
    assert torch.equal(ranked(logits, count), full)


@pytest.mark.parametrize("levels", [2, 3, 40, 10_000])  # many ties ... almost none
@pytest.mark.parametrize("count", [1, 4, 10, 24])
def test_ranking_on_the_device_equals_ranking_with_host_reads(levels, count):
    g = torch.Generator().manual_seed(levels * count)
    logits = torch.randint(levels, (6, 24), generator=g).float()  # [rows, V]
    logits[0, ::3] = -float("inf")  # an EAGLE-3 row: no score outside the draft vocabulary
    with HostReads() as reads:
        got = ranked_on_device(logits, count)
    assert reads.count == 0
    assert torch.equal(got, ranked(logits, count))
