"""Lookahead decoding (selfspec/drafters/lookahead.py): its window's layout, the n-gram pool,
greedy output equal to plain decoding, the target's two-token law when sampling, and the
window's rows leaving the verified logits as they are (a planted leak is caught)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_drafted_sampling_is_exact, law_samples, seeded_lookahead, tiny_llama

from selfspec import SamplingParams, Transformer, generate
from selfspec import decode as decode_module
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.lookahead import LookaheadDrafter, NgramPool, window_layout

PROMPTS = [[3, 9, 4, 17, 5, 3, 9, 4], [8, 8, 8, 2, 40, 41, 42, 8, 8, 2, 40]]


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(3, vocab=64, layers=2)).eval()


def test_a_window_row_sees_the_root_level_zero_to_its_left_and_its_column():
    offsets, mask = window_layout(window=3, ngram=4)
    # rows: (0,1) (0,2) | (1,0) (1,1) (1,2) | (2,0) (2,1) (2,2); column 0 of the mask: the root
    assert offsets.tolist() == [1, 2, 1, 2, 3, 2, 3, 4]
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 5]  # (1,2): level 0 0..2, itself
    assert mask[7].nonzero().flatten().tolist() == [0, 1, 2, 5, 8]  # (2,2): + (1,2), itself
    assert (mask[:, 1:].sum(1) <= offsets + 1).all()  # a causal trajectory


def test_the_pool_keeps_the_newest_distinct_continuations_per_first_token():
    pool = NgramPool(size=2)
    for gram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (9, 9, 9)]:
        pool.add(gram)
    assert pool.continuations(1) == [(6, 7), (2, 3)]
    assert pool.continuations(9) == [(9, 9)] and pool.continuations(5) == []


@pytest.mark.parametrize("window, ngram, candidates", [
    (1, 3, 1), (3, 3, 2), *(pytest.param(*c, marks=pytest.mark.slow) for c in ((4, 4, 4),
                                                                               (6, 5, 8)))])
def test_greedy_output_equals_plain_decoding(target, window, ngram, candidates):
    tiny = Transformer.from_pretrained("selfspec/assets/tiny/target").eval()
    for model in (target, tiny):
        for depth in range(1, ngram):
            drafted = 0
            for prompt in PROMPTS:
                drafter = LookaheadDrafter(window, ngram, candidates, depth=depth)
                result = generate(model, prompt, drafter=drafter, max_new_tokens=40)
                assert result.tokens == generate(model, prompt, max_new_tokens=40).tokens
                drafted += result.stats.drafted
            assert drafted > 0 or model is target  # the tiny target repeats: drafts land


@pytest.mark.parametrize("params", [SamplingParams(1.0), pytest.param(
    SamplingParams(1.0, top_p=0.8), marks=pytest.mark.slow)])
def test_sampled_output_follows_the_targets_law(target, params, request):
    drafter = seeded_lookahead(target, window=3, ngram=3, candidates=3)
    assert_drafted_sampling_is_exact(target, drafter, params, law_samples(request))


def test_the_window_rows_leave_the_verified_logits_as_a_forward_without_them(target):
    drafter = LookaheadDrafter(window=4, ngram=4, candidates=4)
    prompt = torch.tensor(PROMPTS[1])
    drafter.begin(DecodeSetup(target, prompt, SamplingParams(), None, 64))
    drafter._pool.add((prompt[-1].item(), 40, 41, 42))
    drafter._pool.add((prompt[-1].item(), 5, 6, 7))
    draft = drafter.propose(DraftContext(prompt, None))
    assert draft.tree.num_nodes == 6 and draft.extra.rows == 3 + 4 * 2
    with_window, without = (_verified_logits(target, prompt, d)
                            for d in (draft, Draft(draft.tree, draft.tokens)))
    torch.testing.assert_close(with_window, without, atol=1e-5, rtol=0)


def _verified_logits(target, prompt: torch.Tensor, draft: Draft) -> torch.Tensor:
    """The logits of the root and the draft's nodes in the loop's verification forward."""
    cache = target.new_cache(max_slots=64)
    target(prompt[None, :-1], torch.arange(len(prompt) - 1), cache)
    tokens, offsets, mask = decode_module._forward_rows(int(prompt[-1]), draft, "cpu")
    out = target(tokens, cache.length + offsets, cache, mask=mask)
    return out.logits[0, :draft.tree.num_nodes + 1]


def test_a_window_row_leaking_into_the_draft_is_caught(target, monkeypatch):
    """The planted bug: nodes attend to the window's rows. The logits check above fails."""
    real = decode_module._forward_rows

    def leaking(root, draft, device):
        tokens, offsets, mask = real(root, draft, device)
        nodes = draft.tree.num_nodes + 1
        mask = mask.clone()
        mask[1:nodes, nodes:] = True  # every node sees every window row
        return tokens, offsets, mask

    monkeypatch.setattr(decode_module, "_forward_rows", leaking)
    with pytest.raises(AssertionError):
        test_the_window_rows_leave_the_verified_logits_as_a_forward_without_them(target)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ngram must be an integer >= 3"):
        LookaheadDrafter(window=2, ngram=2)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        LookaheadDrafter(window=0)


def test_replay_refuses_a_window_it_cannot_run(target):
    from selfspec.measure.replay import record_greedy, replay

    record = record_greedy(target, PROMPTS[0], 8)
    with pytest.raises(ValueError, match="drafted with extra rows, which only the decode loop"):
        replay(target, LookaheadDrafter(window=2, ngram=3, candidates=1), record)


def test_the_window_rides_in_static_steps_too(target):
    """cuda_graphs=True runs the verification forwards as static steps (eagerly on a CPU): the
    window's rows pad into a bucket beside the nodes, and the output stays plain greedy's."""
    for prompt in PROMPTS:
        drafter = LookaheadDrafter(window=3, ngram=4, candidates=3)
        result = generate(target, prompt, drafter=drafter, max_new_tokens=24, cuda_graphs=True)
        assert result.tokens == generate(target, prompt, max_new_tokens=24).tokens
