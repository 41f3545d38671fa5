"""Merged drafts (UnionDrafter): what the merged tree holds, and that decoding through it stays
exact, greedy and sampled."""

import pytest
import torch
from helpers import FAST_LAW_SAMPLES, P_VALUE_FLOOR, TopRankTreeDrafter, sampled_pvalue, tiny_llama

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import Draft, DraftContext, LookupCorpus, NgramDrafter, UnionDrafter
from selfspec.tree import Tree

SMALL_VOCAB = 8


class Fixed:
    """A drafter that always proposes the same token paths."""

    def __init__(self, paths, layers=(), sampled=False):
        self.paths, self.target_layers, self.sampled = paths, layers, sampled
        self.max_nodes, self.begun = len(paths), 0

    def begin(self, setup):
        self.begun += 1

    def propose(self, context):
        draft = Draft.from_paths(self.paths) if self.paths else Draft.empty()
        if self.sampled:
            return Draft(draft.tree, draft.tokens, torch.full((len(self.paths), 9), 1 / 9))
        return draft


CONTEXT = DraftContext(torch.tensor([1, 2, 3]), None)


def test_the_merged_tree_holds_every_distinct_path_first_drafter_first():
    first = Fixed([(5,), (5, 6), (5, 6, 7)])
    second = Fixed([(5,), (8,), (5, 9), (5, 6), (5, 6, 4)], layers=(2,))
    union = UnionDrafter([first, Fixed([], layers=(4, 2)), second])
    assert union.max_nodes == 8 and union.target_layers == (2, 4)
    draft = union.propose(CONTEXT)
    assert draft.token_paths() == [(5,), (5, 6), (5, 6, 7), (8,), (5, 9), (5, 6, 4)]
    assert draft.tree.parents == (-1, 0, 1, -1, 0, 1) and draft.q is None
    # A cap keeps the first nodes in that order (a prefix-closed tree).
    assert UnionDrafter([first, second], max_nodes=4).propose(CONTEXT).token_paths() == [
        (5,), (5, 6), (5, 6, 7), (8,)]
    assert UnionDrafter([first, second], max_nodes=99).max_nodes == 8
    # One part with nothing to propose: the other's draft as it is.
    assert UnionDrafter([Fixed([]), second]).propose(CONTEXT).tree is second.propose(
        CONTEXT).tree
    assert UnionDrafter([Fixed([]), Fixed([])]).propose(CONTEXT).tree.num_nodes == 0


def test_begin_reaches_every_part():
    parts = [Fixed([(1,)]), Fixed([(2,)])]
    UnionDrafter(parts).begin(None)
    assert [p.begun for p in parts] == [1, 1]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: UnionDrafter([Fixed([(1,)])]), "at least two drafters"),
        (lambda: UnionDrafter([Fixed([(1,)]), Fixed([(2,)])], max_nodes=0), "max_nodes must be"),
        (lambda: UnionDrafter([Fixed([(1,)]), Fixed([(2,)], sampled=True)]).propose(CONTEXT),
         "Fixed sampled its draft"),
    ],
)
def test_impossible_merges_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_draft_paths_round_trip():
    draft = Draft(Tree.from_parents([-1, 0, -1, 1, 0]), torch.tensor([4, 5, 6, 7, 8]))
    paths = draft.token_paths()
    assert paths == [(4,), (4, 5), (6,), (4, 5, 7), (4, 8)]
    again = Draft.from_paths(paths)
    assert again.tree.parents == draft.tree.parents and torch.equal(again.tokens, draft.tokens)


@pytest.fixture(scope="module")
def pair():
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    draft = Transformer.from_hf(tiny_llama(4, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    return target, draft


def test_greedy_through_a_union_is_lossless_and_both_parts_are_accepted(pair):
    """A union of a draft model's top ranks and corpus lookup: the answers equal plain greedy
    decoding, and tokens that only one part proposed are accepted."""
    target, draft = pair
    prompts = ([2, 3, 4, 2, 3], [7, 1, 6], [5, 5, 6, 0])
    corpus = LookupCorpus([generate(target, [p, (p + 3) % 8], max_new_tokens=16).tokens
                           for p in range(8)])
    ranks, lookup = TopRankTreeDrafter(draft, [[0], [1], [0, 0]]), NgramDrafter(3, corpus=corpus)
    union = UnionDrafter([ranks, lookup], max_nodes=5)
    accepted = {"ranks": 0, "lookup": 0, "union": 0}
    for prompt in prompts:
        expected = generate(target, prompt, max_new_tokens=16).tokens
        for name, drafter in (("ranks", ranks), ("lookup", lookup), ("union", union)):
            result = generate(target, prompt, drafter=drafter, max_new_tokens=16)
            assert result.tokens == expected
            assert len(result.stats.nodes_histogram) - 1 <= drafter.max_nodes
            accepted[name] += result.stats.accepted
    assert accepted["union"] > max(accepted["ranks"], accepted["lookup"]) > 0


@pytest.mark.parametrize("params, samples", [(SamplingParams(1.0), FAST_LAW_SAMPLES), pytest.param(
    SamplingParams(0.8, top_p=0.8), 1500, marks=pytest.mark.slow)])
def test_sampling_through_a_union_follows_the_target_law(pair, params, samples):
    target, draft = pair
    prompt = [2, 3, 4, 2, 3, 4, 2, 3]
    greedy = generate(target, prompt, max_new_tokens=4).tokens
    corpus = LookupCorpus([prompt + greedy, greedy + greedy])
    union = UnionDrafter([TopRankTreeDrafter(draft, [[0], [1]]),
                          NgramDrafter(3, corpus=corpus, max_nodes=4)])
    assert sampled_pvalue(target, union, params, samples) > P_VALUE_FLOOR
