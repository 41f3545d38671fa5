"""selfspec/heads/base.py: what the heads share."""

import torch

from selfspec.heads.base import vocab_scores


def test_vocab_scores_equal_the_lm_heads_own_and_take_no_rows():
    """One 2-D product over any leading shape, strided input and none at all included."""
    lm_head = torch.nn.Linear(8, 5, bias=False)
    hidden = torch.randn(2, 3, 4, 8)[:, :, 1:]  # strided, as a block's slots cut from root
    torch.testing.assert_close(vocab_scores(lm_head, hidden), lm_head(hidden).float())
    assert vocab_scores(lm_head, torch.randn(0, 8)).shape == (0, 5)
