"""Suffix decoding (selfspec/drafters/suffix.py): what the suffix index counts and in which
order, how a match's length sizes the draft, chains and trees, the store learning online
across generations and a batch's rows, and decoding through it staying exact. Agreement
with arctic-inference's own SuffixDecodingCache: tests/peers/test_arctic_suffix.py."""

import pytest
from helpers import FAST_LAW_SAMPLES, P_VALUE_FLOOR, sampled_pvalue, tiny_llama

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters.suffix import (
    SuffixDrafter,
    SuffixIndex,
    SuffixSettings,
    SuffixStore,
    speculate,
)


def index_of(*sequences, depth: int = 8) -> SuffixIndex:
    index = SuffixIndex(depth)
    for s in sequences:
        index.start(s)
    return index


def test_a_chain_follows_the_most_frequent_child_and_scores_it():
    index = index_of([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 5])
    draft = speculate(index, [9, 1, 2], SuffixSettings(4, min_token_prob=0.0))
    # "1 2" occurs 3 times, always before 3; then 5 twice, 4 once: match 2 drafts 2 tokens.
    assert (draft.tokens, draft.match, draft.counts, draft.total) == ([3, 5], 2, [3, 2], 3)
    assert draft.probs == pytest.approx([1.0, 2 / 3]) and draft.score == pytest.approx(5 / 3)


def test_the_match_length_sizes_the_draft():
    index = index_of([5, 6, 7, 1, 2, 3, 4, 8, 9])
    context = [5, 6, 7, 1, 2]
    assert speculate(index, context, SuffixSettings(8)).tokens == [3, 4, 8, 9]  # match 4
    assert speculate(index, context, SuffixSettings(8, max_spec_factor=0.5)).tokens == [3, 4]
    assert speculate(index, context, SuffixSettings(2, max_spec_offset=3.0)).tokens == [3, 4]
    # The tree's depth bounds a match plus its continuation: at depth 5, match 4 leaves room
    # for one token, match 3 for two, and the higher score wins.
    draft = speculate(index_of([5, 6, 7, 1, 2, 3, 4], depth=5), context, SuffixSettings(8))
    assert (draft.tokens, draft.match) == ([3, 4], 3)


def test_improbable_tokens_are_not_drafted():
    index = index_of([1, 2, 1, 3, 1, 4, 1, 5, 1, 2])
    # After 1: 2 twice, 3, 4, 5 once each, and once at the end: 2 has 2 / 5 = 0.4.
    assert speculate(index, [7, 1], SuffixSettings(1, min_token_prob=0.4)).tokens == [2]
    assert speculate(index, [7, 1], SuffixSettings(1, min_token_prob=0.5)).tokens == []


def test_siblings_at_equal_counts_take_the_latest_to_reach_it_first():
    # After 1: 2 and 3 twice each; 3 reached two last. Seen once each: 4 before 5.
    index = index_of([1, 2, 1, 3, 1, 2, 1, 3, 1, 4, 1, 5, 1])
    ends = index.matches([9, 1])[0][1]
    assert index.children(ends, room=1).tokens == [3, 2, 4, 5]
    settings = SuffixSettings(5, max_spec_offset=4.0, min_token_prob=0.0, tree=True)
    draft = speculate(index_of([1, 2, 1, 3, 1, 2, 1, 3, 1, 4, 1, 5], depth=2), [9, 1], settings)
    assert draft.tokens == [3, 2, 4, 5] and draft.parents == [-1, -1, -1, -1]


def test_a_tree_takes_the_likeliest_tokens_best_first():
    index = index_of([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 5, 6], depth=3)  # 1 and two more
    settings = SuffixSettings(4, max_spec_offset=4.0, min_token_prob=0.2, tree=True)
    draft = speculate(index, [9, 1], settings)
    # After 1 (4 times): 2 (3), then 2 3 (2), 5 (1), 2 4 (1): at 0.25 each, first found first.
    assert draft.tokens == [2, 3, 5, 4] and draft.parents == [-1, 0, -1, 0]
    assert draft.probs == pytest.approx([0.75, 0.5, 0.25, 0.25])


@pytest.mark.parametrize("kwargs", [dict(num_draft_tokens=0), dict(max_spec_factor=-1.0),
                                    dict(min_token_prob=1.5)])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="SuffixSettings"):
        SuffixSettings(**kwargs)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(1)


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0))


PROMPTS = [[5, 9, 6, 5, 9], [11, 9, 7], [20, 21, 5, 9]]


class LeakyDrafter(SuffixDrafter):
    """The planted bug: the store learns each draft before it is verified."""

    def propose(self, context):
        draft = super().propose(context)
        self.store.extend(self._answer, draft.tokens.tolist())
        return draft


def assert_learnt_what_was_committed(sequences, answers) -> None:
    """Each generation's sequence in the store is its answer (no prompt), the last step's
    tokens included (the loop's `finish`)."""
    assert sequences == answers


def test_greedy_is_lossless_and_the_store_learns_across_prompts(target):
    store, k = SuffixStore(16), 4
    plain = [generate(target, p, max_new_tokens=24).tokens for p in PROMPTS]
    drafter = SuffixDrafter(store, SuffixSettings(k))
    results = [generate(target, p, drafter=drafter, max_new_tokens=24) for p in PROMPTS * 2]
    assert [r.tokens for r in results] == plain * 2
    assert_learnt_what_was_committed(store.sequences, plain * 2)
    # The second round finds each answer in the store: more drafted tokens are accepted.
    first, second = (sum(r.stats.accepted for r in half) for half in (results[:3], results[3:]))
    assert second > first


def test_a_store_that_learns_unverified_drafts_is_caught(target):
    store, k = SuffixStore(16), 4
    plain = [generate(target, p, max_new_tokens=24).tokens for p in PROMPTS]
    drafter = LeakyDrafter(store, SuffixSettings(k))
    assert [generate(target, p, drafter=drafter, max_new_tokens=24).tokens
            for p in PROMPTS * 2] == plain * 2  # exact all the same: the output cannot tell
    with pytest.raises(AssertionError):
        assert_learnt_what_was_committed(store.sequences, plain * 2)


def test_a_batch_rows_share_the_store_and_stay_lossless(target):
    store, k = SuffixStore(16), 3
    plain = [generate(target, p, max_new_tokens=16).tokens for p in PROMPTS]
    for answer in plain:  # seen before: the rows draft from them
        store.start(answer)
    drafter = SuffixDrafter(store, SuffixSettings(k, tree=True, min_token_prob=0.0))
    results = generate(target, PROMPTS, drafter=drafter, max_new_tokens=16)
    assert [r.tokens for r in results] == plain
    assert_learnt_what_was_committed(store.sequences[len(plain):], plain)  # each its own
    assert sum(r.stats.accepted for r in results) > 0


def test_sampling_through_suffix_drafts_follows_the_target_law():
    target = Transformer.from_hf(tiny_llama(3, vocab=8, layers=1, hidden=16, std=0.5))
    prompt = [2, 3, 4, 2, 3, 4, 2, 3]
    greedy = generate(target, prompt, max_new_tokens=4).tokens
    store = SuffixStore(5)  # matches of up to 4 tokens: fewer drafts to score a step
    store.start(prompt + greedy)  # the store knows what follows the prompt's greedy answer
    drafter = SuffixDrafter(store, SuffixSettings(3, max_spec_offset=2.0, tree=True,
                                                  min_token_prob=0.0))
    assert sampled_pvalue(target, drafter, SamplingParams(1.0), FAST_LAW_SAMPLES) > P_VALUE_FLOOR


def test_few_and_many_occurrences_are_grouped_alike(monkeypatch):
    """Children of few occurrences are grouped in plain Python, of many with numpy: the same
    tokens, counts, order and occurrences."""
    import random

    import selfspec.drafters.suffix as suffix

    rng = random.Random(0)
    index = index_of(*[[rng.randrange(5) for _ in range(60)] for _ in range(4)], depth=6)
    ends = [e for _, e in index.matches([3, 1, 4, 1])]

    def grouped():
        return [(c.tokens, c.counts, [c.places(i).tolist() for i in range(len(c.tokens))])
                for c in (index.children(e, room=2) for e in ends)]

    monkeypatch.setattr(suffix, "SMALL", 10**9)  # every grouping in Python
    in_python = grouped()
    monkeypatch.setattr(suffix, "SMALL", -1)  # every grouping with numpy
    assert grouped() == in_python and len(ends[0]) > 40 and len(ends) > 2
