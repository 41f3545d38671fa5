"""The reduced draft vocabulary (selfspec.draft_vocab) and Medusa heads that score only it:
exact id maps, a fresh head equal to the LM head's rows, labels outside the vocabulary left out
of the loss, lossless greedy decoding when the target's tokens fall outside it, checkpoints."""

import pytest
import torch
from helpers import fit_medusa_heads

from selfspec import generate
from selfspec.draft_vocab import DraftVocab, draft_vocabulary
from selfspec.drafters.medusa import MedusaDrafter, MedusaProductDrafter
from selfspec.heads import MedusaConfig, MedusaHeads, describe_target, load_head, save_head

PROMPTS = [[3, 9, 14, 2, 27], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24
CHAIN4 = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def test_the_most_frequent_tokens_are_kept_in_id_order():
    tokens = torch.tensor([[7, 7, 7, 3, 3, 9, 1, 1, 1, 1]])
    vocab = draft_vocabulary(tokens, vocab_size=12, draft_vocab_size=3)
    assert vocab.target_ids.tolist() == [1, 3, 7]
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 3, 7]
    masked = draft_vocabulary(tokens, 12, 2, mask=torch.tensor([[1] * 6 + [0] * 4]))
    assert masked.target_ids.tolist() == [3, 7]  # the 1s are masked out, 9 ties lose to 3


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


def reduced_heads(target, kept: list[int], num_heads: int = 4) -> MedusaHeads:
    config = MedusaConfig(target.config.hidden_size, target.config.vocab_size,
                          num_heads=num_heads, draft_vocab_size=len(kept))
    vocab = draft_vocabulary(torch.tensor(kept), target.config.vocab_size, len(kept))
    return MedusaHeads(config).set_draft_vocab(vocab).init_from_lm_head(target.lm_head.weight)


def test_a_fresh_reduced_head_is_the_lm_head_on_its_tokens(target):
    kept = [1, 4, 9, 30, 63]
    heads = reduced_heads(target, kept)
    hidden = torch.randn(3, target.config.hidden_size)
    logits = heads(hidden)  # [3, K, 5]
    assert logits.shape == (3, 4, 5)
    for k in range(4):
        torch.testing.assert_close(logits[:, k], target.lm_head(hidden)[:, kept])


def test_labels_outside_the_draft_vocabulary_leave_the_loss(target):
    heads = reduced_heads(target, [2, 7, 8])
    tokens, mask = torch.tensor([[7, 3, 8, 2, 9]]), torch.tensor([[1, 1, 1, 0, 1]])
    labels, kept = heads.labels(tokens, mask)
    assert kept.tolist() == [[True, False, True, False, False]]
    assert labels[kept].tolist() == [1, 2]  # draft ids of 7 and 8


def test_greedy_is_lossless_when_the_target_leaves_the_draft_vocabulary(target, plain_greedy):
    produced = {t for tokens in plain_greedy.values() for t in tokens}
    kept = sorted(produced)[::2] + [60, 61]  # half of what the target writes is out of reach
    heads = reduced_heads(target, kept)
    drafters = [MedusaDrafter(heads, CHAIN4), MedusaProductDrafter(heads, top_k=3, max_nodes=10)]
    for prompt, expected in plain_greedy.items():
        for drafter in drafters:
            result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
            assert result.tokens == expected


def test_reduced_heads_fitted_to_the_target_are_accepted_and_propose_only_their_tokens(
        target, plain_greedy):
    full, _ = fit_medusa_heads(target, plain_greedy)
    produced = sorted({t for tokens in plain_greedy.values() for t in tokens})
    heads = reduced_heads(target, produced)
    heads.load_state_dict({**full.state_dict(), **_rows(full, heads)})
    proposed = []
    for prompt, expected in plain_greedy.items():
        drafter = _Recording(MedusaDrafter(heads, CHAIN4), proposed)
        result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected and result.stats.tau > 1.5
    assert set(proposed) <= set(produced)


def _rows(full: MedusaHeads, reduced: MedusaHeads) -> dict:
    """The reduced heads' projections: the fitted full heads' rows of their tokens."""
    ids = reduced.draft_vocab.target_ids
    return {f"heads.{k}.lm_head.weight": head.lm_head.weight[ids]
            for k, head in enumerate(full.heads)} | {"d2t": reduced.d2t, "t2d": reduced.t2d}


class _Recording:
    """A drafter that records the tokens it proposes."""

    def __init__(self, drafter, proposed: list) -> None:
        self.drafter, self.proposed = drafter, proposed
        self.target_layers = drafter.target_layers

    def begin(self, setup):
        self.drafter.begin(setup)

    def propose(self, context):
        draft = self.drafter.propose(context)
        self.proposed += draft.tokens.tolist()
        return draft

    def __getattr__(self, name):
        return getattr(self.drafter, name)


def test_a_reduced_checkpoint_round_trips_with_its_vocabulary(tmp_path, target):
    heads = reduced_heads(target, [3, 5, 40, 41])
    save_head(tmp_path / "m", heads, heads.config, describe_target(target))
    loaded = load_head(tmp_path / "m", MedusaHeads, MedusaConfig, target=target)
    assert loaded.config.draft_vocab_size == 4
    assert loaded.draft_vocab.target_ids.tolist() == [3, 5, 40, 41]
    hidden = torch.randn(2, target.config.hidden_size)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_a_vocabulary_of_the_wrong_size_is_refused(target):
    heads = reduced_heads(target, [1, 2, 3])
    with pytest.raises(ValueError, match="draft vocabulary of 3 of 64 tokens, got 2 of 64"):
        heads.set_draft_vocab(draft_vocabulary(torch.tensor([1, 2]), 64, 2))
    assert isinstance(heads.draft_vocab, DraftVocab)


def test_cached_features_give_the_same_loss_and_run_the_target_once_per_row(target):
    from selfspec.objectives import MedusaObjective

    heads = reduced_heads(target, list(range(0, 64, 2)))
    rows = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(rows)
    plain = MedusaObjective(target, heads)(rows, mask)
    cached = MedusaObjective(target, heads, cache_features=True)
    calls = []
    hook = target.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        for batch in ([0, 1], [1, 2], [2, 0, 1]):  # rows seen again in later batches
            out = cached(rows[batch], mask[batch])
    finally:
        hook.remove()
    assert sorted(calls) == [1, 2]  # rows 0 and 1, then row 2: each row's forward once
    torch.testing.assert_close(out.loss, MedusaObjective(target, heads)(rows[[2, 0, 1]], mask).loss)
    assert plain.loss.isfinite()
