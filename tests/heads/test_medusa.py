"""Medusa heads (heads/medusa.py): own storage, LM-head starts, a shared LM head, draft vocabs."""

import pytest
import torch
from helpers import random_medusa_heads, reduced_medusa_heads

from selfspec.heads import MedusaConfig, MedusaHeads
from selfspec.heads.draft_vocab import DraftVocab, draft_vocabulary
from selfspec.model import Linear


def test_every_head_and_block_has_its_own_storage():
    config = MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3, num_layers=2)
    heads = MedusaHeads(config).init_from_lm_head(torch.randn(24, 16))
    params = [p for _, p in heads.named_parameters(remove_duplicate=False)]
    assert len(params) == 3 * (2 * 2 + 1)  # per head: 2 blocks of (weight, bias) + projection
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params)
    # Training one head (one block) leaves every other head untouched.
    heads(torch.randn(5, 16))[:, 1].sum().backward()
    for k, head in enumerate(heads.heads):
        assert all(bool(p.grad.abs().sum() > 0) == (k == 1) for p in head.parameters())


def test_a_fresh_head_is_the_lm_head():
    config = MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3, num_layers=2)
    weight = torch.randn(24, 16)
    heads = MedusaHeads(config).init_from_lm_head(weight)
    hidden = torch.randn(2, 5, 16)  # [B, T, H]
    logits = heads(hidden)
    assert logits.shape == (2, 5, 3, 24)  # [B, T, K, V]
    lm_head = Linear(16, 24, bias=False)  # the target's LM head, as selfspec computes it
    lm_head.weight.data = weight
    for k in range(3):
        assert torch.equal(logits[:, :, k], lm_head(hidden))
    assert heads(torch.randn(16)).shape == (3, 24)  # a single state: [K, V]


@pytest.mark.parametrize("shared", [False, True])
def test_the_first_heads_alone_score_as_all_heads_do(shared):
    """A draft k deep runs only heads 0..k-1: the same logits as running every head."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4,
                                     shared_lm_head=shared))
    for param in heads.parameters():
        param.data.normal_()  # heads that differ from each other
    lm_head = Linear(16, 24, bias=False)
    hidden = torch.randn(16)
    every = heads(hidden, lm_head)
    assert heads(hidden, lm_head, count=2).shape == (2, 24)
    torch.testing.assert_close(heads(hidden, lm_head, count=2), every[:2])


def test_bad_head_arguments_are_clear_errors():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    with pytest.raises(ValueError, match=r"shape \[24, 8\], expected .* \[24, 16\]"):
        heads.init_from_lm_head(torch.randn(24, 8))
    with pytest.raises(ValueError, match="hidden states have size 8, the heads expect 16"):
        heads(torch.randn(3, 8))
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        MedusaConfig(hidden_size=16, vocab_size=24, num_heads=0)


# ---- heads sharing the target's LM head ------------------------------------------------------


def test_shared_lm_head_heads_score_like_own_heads_holding_a_copy_of_it(target):
    config = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2)
    own = random_medusa_heads(config, 7)
    own.init_from_lm_head(target.lm_head.weight.detach())
    shared = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2,
                                      shared_lm_head=True))
    state = {k: v for k, v in own.state_dict().items() if "lm_head" not in k}
    assert set(state) == set(shared.state_dict())  # no projection weights of their own
    shared.load_state_dict(state)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(shared(hidden, target.lm_head), own(hidden), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="share the target's LM head: pass lm_head"):
        shared(hidden)


def test_a_shared_lm_head_with_a_draft_vocabulary_is_refused():
    with pytest.raises(ValueError, match="shared LM head is the target's.*draft_vocab_size"):
        MedusaConfig(hidden_size=8, vocab_size=16, draft_vocab_size=4, shared_lm_head=True)


# ---- heads that score a reduced draft vocabulary ---------------------------------------------


def test_a_fresh_reduced_head_is_the_lm_head_on_its_tokens(target):
    kept = [1, 4, 9, 30, 63]
    heads = reduced_medusa_heads(target, kept)
    hidden = torch.randn(3, target.config.hidden_size)
    logits = heads(hidden)  # [3, K, 5]
    assert logits.shape == (3, 4, 5)
    for k in range(4):
        torch.testing.assert_close(logits[:, k], target.lm_head(hidden)[:, kept])


def test_labels_outside_the_draft_vocabulary_leave_the_loss(target):
    heads = reduced_medusa_heads(target, [2, 7, 8])
    tokens, mask = torch.tensor([[7, 3, 8, 2, 9]]), torch.tensor([[1, 1, 1, 0, 1]])
    labels, kept = heads.labels(tokens, mask)
    assert kept.tolist() == [[True, False, True, False, False]]
    assert labels[kept].tolist() == [1, 2]  # draft ids of 7 and 8


def test_a_vocabulary_of_the_wrong_size_is_refused(target):
    heads = reduced_medusa_heads(target, [1, 2, 3])
    with pytest.raises(ValueError, match="draft vocabulary of 3 of 64 ids, got 2 of 64"):
        heads.set_draft_vocab(draft_vocabulary(torch.tensor([1, 2]), 64, 2))
    assert isinstance(heads.draft_vocab, DraftVocab)


# ---- narrowing trained heads to their most frequent tokens, to ship them smaller ------------


@pytest.mark.parametrize("start", [None, [1, 4, 9, 30, 40, 63]])
def test_narrowed_heads_keep_their_logits_on_the_most_frequent_tokens(start):
    config = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2,
                          draft_vocab_size=None if start is None else len(start))
    heads = random_medusa_heads(config, 3)
    if start is not None:
        heads.set_draft_vocab(draft_vocabulary(torch.tensor(start), 64, len(start)))
    counts = torch.zeros(64, dtype=torch.long)
    counts[[9, 40, 63, 2]] = torch.tensor([5, 9, 7, 50])  # 2 is outside `start`: never kept
    smaller = heads.narrowed(counts, 3)
    kept = [2, 40, 63] if start is None else [9, 40, 63]
    assert smaller.draft_vocab.target_ids.tolist() == kept
    assert smaller.config.draft_vocab_size == 3
    hidden = torch.randn(5, 32)
    full = heads.draft_vocab.scatter(heads(hidden)) if start is not None else heads(hidden)
    torch.testing.assert_close(smaller(hidden), full[..., kept])
    same = heads.narrowed(counts, len(start or range(64)))
    torch.testing.assert_close(same(hidden), heads(hidden))  # narrowed to itself: unchanged


def test_narrowing_refuses_a_size_it_cannot_hold_and_shared_heads():
    heads = random_medusa_heads(MedusaConfig(hidden_size=8, vocab_size=16, draft_vocab_size=4), 0)
    with pytest.raises(ValueError, match="narrowed to 1..4 tokens"):
        heads.narrowed(torch.ones(16, dtype=torch.long), 5)
    shared = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, shared_lm_head=True))
    with pytest.raises(ValueError, match="share the target's LM head"):
        shared.narrowed(torch.ones(16, dtype=torch.long), 4)
