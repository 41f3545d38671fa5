"""N-gram lookup with a corpus (REST-style retrieval): what the index holds, which source a
draft comes from, and that decoding through it stays exact."""

import pytest
import torch
from helpers import FAST_LAW_SAMPLES, P_VALUE_FLOOR, sampled_pvalue, tiny_llama

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import DraftContext, LookupCorpus, NgramDrafter
from selfspec.drafters.ngram import MATCHES

CORPUS = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [7, 2, 9]]


def test_a_continuation_follows_the_majority_token_by_token():
    corpus = LookupCorpus(CORPUS, max_ngram=2, length=4)
    assert corpus.get([1, 2]) == (3, 5)  # 3 every time, then 5 twice against 4 once
    # After 2: 3, 3, 3, 9 -> 3; then among those three, 5 beats 4.
    assert corpus.get([2]) == (3, 5)
    assert corpus.get([7, 2]) == (9,)  # sequences end: nothing crosses into the next one
    assert corpus.get([4]) == ()  # the last token of a sequence has no continuation
    assert corpus.get([6]) == ()


def test_the_longest_seen_ngram_wins():
    corpus = LookupCorpus(CORPUS, max_ngram=3, length=4)
    assert corpus.longest_match([7, 2]) == 2  # the 2-gram, not the 1-gram "2"
    assert corpus.longest_match([8, 2]) == 1  # unseen 2-gram: the 1-gram
    assert corpus.longest_match([8]) == 0


def test_counts_hold_every_continuation_prefix():
    corpus = LookupCorpus(CORPUS, max_ngram=2, length=2)
    assert corpus.counts([2]) == {(3,): 3, (3, 4): 1, (3, 5): 2, (9,): 1}
    assert corpus.get([1]) == (2, 3)  # length 2
    assert LookupCorpus(CORPUS, max_ngram=1, max_places=1).counts([2]) == {(9,): 1}  # the last


@pytest.mark.parametrize("kwargs", [dict(min_ngram=0), dict(max_ngram=1, min_ngram=2),
                                    dict(length=0), dict(max_places=0)])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="LookupCorpus: need"):
        LookupCorpus(CORPUS, **kwargs)


def draft_of(drafter, tokens):
    return drafter.propose(DraftContext(torch.tensor(tokens), None)).tokens.tolist()


def test_the_match_rule_picks_which_earlier_occurrence_is_continued():
    latest, earliest = (NgramDrafter(2, max_ngram=2, match=m) for m in MATCHES)
    context = [1, 2, 7, 8, 9, 1, 2, 5, 6, 1, 2]  # "1 2" at 0 and at 5
    assert draft_of(latest, context) == [5, 6]
    assert draft_of(earliest, context) == [7, 8]
    # The longest n-gram still comes first: "1 2" (first at 2) before the 1-gram "2" (first at 0).
    assert draft_of(earliest, [2, 5, 1, 2, 9, 1, 2]) == [9, 1]
    # In a loop the most recent occurrence's continuation is cut short by the context's end;
    # the first one's is not.
    loop = [3, 4, 4, 4, 4]
    assert draft_of(NgramDrafter(3, max_ngram=1), loop) == [4]
    assert draft_of(NgramDrafter(3, max_ngram=1, match="earliest"), loop) == [4, 4, 4]
    assert draft_of(NgramDrafter(3, max_ngram=3, match="earliest"), loop) == [4]  # one "4 4 4"
    with pytest.raises(ValueError, match="match must be one of"):
        NgramDrafter(2, match="first")


def test_the_context_is_asked_before_the_corpus_at_each_length():
    drafter = NgramDrafter(2, max_ngram=2, corpus=LookupCorpus(CORPUS, max_ngram=2))
    assert draft_of(drafter, [1, 2, 6, 8, 1, 2]) == [6, 8]  # "1 2" seen earlier here
    assert draft_of(drafter, [8, 1, 2]) == [3, 5]  # only the corpus holds "1 2"
    # The corpus's 2-gram beats the context's 1-gram: longer matches first, whoever has them.
    assert draft_of(drafter, [2, 6, 1, 2]) == [3, 5]
    assert draft_of(drafter, [6, 8]) == []
    assert draft_of(NgramDrafter(2, max_ngram=2), [8, 1, 2]) == []  # no corpus, no draft


def test_a_tree_draft_adds_the_corpus_continuations_by_frequency():
    corpus = LookupCorpus(CORPUS + [[6, 2, 3, 4]], max_ngram=2)
    drafter = NgramDrafter(2, max_ngram=2, corpus=corpus, max_nodes=4)
    draft = drafter.propose(DraftContext(torch.tensor([8, 1, 2]), None))
    # After "1 2": 3 (3 times), then "3 5" (twice), "3 4" (once): three nodes only.
    assert [list(p) for p in draft.tree.paths] == [[0, 1], [0, 2]]
    assert draft.tokens.tolist() == [3, 5, 4] and draft.q is None
    # The context's chain first (a 2-gram match beats the corpus's 1-gram), then the corpus's.
    draft = drafter.propose(DraftContext(torch.tensor([9, 2, 6, 9, 2]), None))
    assert draft.tokens.tolist() == [6, 3, 9, 4] and draft.tree.parents == (-1, -1, 0, 1)
    one_deep = NgramDrafter(1, corpus=corpus, max_nodes=3)
    assert draft_of(one_deep, [8, 2]) == [3, 9]  # siblings: every first token seen after "2"
    with pytest.raises(ValueError, match="a tree .* needs a corpus"):
        NgramDrafter(2, max_nodes=4)


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0))


@pytest.mark.parametrize("match", ["latest", pytest.param("earliest", marks=pytest.mark.slow)])
def test_greedy_through_a_corpus_is_lossless_and_uses_it(target, match):
    """The corpus holds the target's own greedy answers to other prompts, as the
    self-distillation cache does; the answers here must equal plain greedy decoding, under
    either match rule (the context alone too)."""
    others = [[3 + i, 9, 4 + 2 * i] for i in range(8)]
    corpus = LookupCorpus([generate(target, p, max_new_tokens=24).tokens for p in others])
    accepted = 0
    for prompt in ([5, 9, 6], [11, 9, 7], [20, 21]):
        expected = generate(target, prompt, max_new_tokens=24).tokens
        for k, nodes in ((1, 1), (3, 3), (1, 3), (3, 6)):
            drafter = NgramDrafter(k, corpus=corpus, max_nodes=nodes, match=match)
            result = generate(target, prompt, drafter=drafter, max_new_tokens=24)
            assert result.tokens == expected
            accepted += result.stats.accepted
    alone = [generate(target, p, drafter=NgramDrafter(3, match=match), max_new_tokens=24)
             for p in ([5, 9, 6], [11, 9, 7], [20, 21])]
    assert [r.tokens for r in alone] == [generate(target, p, max_new_tokens=24).tokens
                                         for p in ([5, 9, 6], [11, 9, 7], [20, 21])]
    assert accepted > sum(r.stats.accepted for r in alone)  # the corpus's drafts were used


def test_greedy_through_the_earliest_match_is_lossless(target):
    """The context alone, vLLM's rule, on a prompt that repeats itself (the complete run checks
    the rule with a corpus and under sampling too)."""
    prompt = [5, 9, 6, 5, 9, 6, 5, 9]
    result = generate(target, prompt, drafter=NgramDrafter(3, match="earliest"),
                      max_new_tokens=16)
    assert result.tokens == generate(target, prompt, max_new_tokens=16).tokens
    assert result.stats.accepted > 0


@pytest.mark.parametrize("match", ["latest", pytest.param("earliest", marks=pytest.mark.slow)])
def test_sampling_through_a_corpus_follows_the_target_law(match):
    target = Transformer.from_hf(tiny_llama(3, vocab=8, layers=1, hidden=16, std=0.5))
    prompt = [2, 3, 4, 2, 3, 4, 2, 3]
    greedy = generate(target, prompt, max_new_tokens=4).tokens
    # Only the corpus knows what follows the prompt's greedy answer; the context knows the rest.
    corpus = LookupCorpus([prompt + greedy, greedy + greedy])
    for nodes in (3, 6):
        drafter = NgramDrafter(3, corpus=corpus, max_nodes=nodes, match=match)
        assert sampled_pvalue(target, drafter, SamplingParams(1.0),
                              FAST_LAW_SAMPLES) > P_VALUE_FLOOR
