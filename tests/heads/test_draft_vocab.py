"""The reduced draft vocabulary (draft_vocab.py): id maps, frequent ids kept, saved counts."""

import pytest
import torch

from selfspec.heads import MedusaConfig
from selfspec.heads.draft_vocab import (
    draft_vocabulary,
    load_draft_vocab,
    save_token_counts,
    token_counts,
)


def test_the_most_frequent_tokens_are_kept_in_id_order():
    tokens = torch.tensor([[7, 7, 7, 3, 3, 9, 1, 1, 1, 1]])
    vocab = draft_vocabulary(tokens, vocab_size=12, draft_vocab_size=3)
    assert vocab.target_ids.tolist() == [1, 3, 7]
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 3, 7]
    masked = draft_vocabulary(tokens, 12, 2, mask=torch.tensor([[1] * 6 + [0] * 4]))
    assert masked.target_ids.tolist() == [3, 7]  # the 1s are masked out, 9 ties lose to 3


def test_the_draft_vocabulary_keeps_the_most_frequent_ids():
    tokens = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7], [3, 3, 1, 1, 1, 1, 1, 0, 0, 0]])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 2:7] = False  # the 1s do not count
    vocab = draft_vocabulary(tokens, vocab_size=12, draft_vocab_size=5, mask=mask)
    # counts: 7:4, 5:3, 0:3, 9:2, 3:2, then 2:1; ties by lower id first
    assert vocab.target_ids.tolist() == [0, 3, 5, 7, 9]
    assert (vocab.target_ids == torch.arange(5) + vocab.d2t).all()
    assert vocab.t2d.nonzero().flatten().tolist() == [0, 3, 5, 7, 9]
    wide = draft_vocabulary(tokens[:1], vocab_size=12, draft_vocab_size=7)
    assert wide.target_ids.tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill in, lowest first


def test_draft_ids_and_scores_map_back_exactly():
    vocab = draft_vocabulary(torch.tensor([2, 5, 5, 11, 11, 11]), 16, 3)
    ids, kept = vocab.draft_ids(torch.tensor([11, 4, 2, 5]))
    assert kept.tolist() == [True, False, True, True]
    assert vocab.target_ids[ids[kept]].tolist() == [11, 2, 5]
    full = vocab.scatter(torch.tensor([[0.5, 1.5, 2.5]]))  # [1, 16]
    assert full[0, [2, 5, 11]].tolist() == [0.5, 1.5, 2.5]
    assert torch.isinf(full).sum() == 13 and full.max() == 2.5


@pytest.mark.parametrize("size", [0, 65, True])
def test_impossible_draft_vocabulary_sizes_are_refused(size):
    expected = r"draft_vocab_size must be null or an integer in \[1, 64\]"
    with pytest.raises(ValueError, match=expected):
        MedusaConfig(hidden_size=8, vocab_size=64, draft_vocab_size=size)
    if not isinstance(size, bool):
        with pytest.raises(ValueError, match="must hold 1..64 tokens"):
            draft_vocabulary(torch.arange(10), 64, size)


def test_token_counts_choose_any_vocabulary_size_later(tmp_path):
    tokens = torch.tensor([[5, 5, 5, 7, 7, 9, 1], [5, 7, 3, 3, 3, 3, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]])
    save_token_counts(tmp_path, token_counts(tokens, 16, mask))
    assert load_draft_vocab(tmp_path, 2).target_ids.tolist() == [3, 5]  # 4x each, then 7 (3x)
    assert load_draft_vocab(tmp_path, 3).target_ids.tolist() == [3, 5, 7]
    assert load_draft_vocab(tmp_path, 4).target_ids.tolist() == [3, 5, 7, 9]
    with pytest.raises(FileNotFoundError, match="train/eagle.py and train/medusa.py write them"):
        load_draft_vocab(tmp_path / "elsewhere", 2)
