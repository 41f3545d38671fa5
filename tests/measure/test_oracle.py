"""The oracle drafter (measure/oracle.py): a perfect draft, accepted in full: the ceiling."""

import pytest
import torch
from helpers import host_reads_per_step, tiny_llama

from selfspec import SamplingParams, Tree, decode, generate
from selfspec.drafters.base import DecodeSetup, DraftContext
from selfspec.measure.oracle import OracleDrafter, OracleTreeDrafter, eagle2_shape
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_oracle_is_accepted_in_full_and_lossless(target, k):
    prompt = [3, 17, 5, 9]
    plain = generate(target, prompt, max_new_tokens=20)
    oracle = generate(target, prompt, drafter=OracleDrafter(k), max_new_tokens=20)
    assert oracle.tokens == plain.tokens
    assert oracle.stats.accepted == oracle.stats.drafted  # every proposed token is kept
    # each step yields k + 1 tokens until the last, which may be cut by max_new_tokens
    assert oracle.stats.steps == -(-20 // (k + 1))


def test_a_prepared_oracle_replays_its_answers_without_generating_again(target, monkeypatch):
    """The answers are computed by prepare, ahead of any timing: the timed generation that
    replays them runs no second greedy generation inside begin."""
    prompt, oracle = [3, 17, 5, 9], OracleDrafter(1)
    oracle.prepare(target, [prompt], 20)
    plain = generate(target, prompt, max_new_tokens=20).tokens

    def no_second_generation(*args, **kwargs):
        raise AssertionError("the oracle generated again inside a timed generation")

    monkeypatch.setattr(decode, "generate", no_second_generation)
    for k in (1, 4):
        replay = generate(target, prompt, drafter=oracle.with_draft_tokens(k),
                           max_new_tokens=20)
        assert replay.tokens == plain and replay.stats.accepted == replay.stats.drafted


def test_the_oracle_refuses_sampling_and_bad_lengths(target):
    with pytest.raises(ValueError, match="replays greedy decoding"):
        generate(target, [3, 4], drafter=OracleDrafter(2), sampling=SamplingParams(1.0),
                 max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        OracleDrafter(0)


# ---- the oracle hidden in a tree ------------------------------------------------------------

MEDUSA_LIKE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("tree", [MEDUSA_LIKE, eagle2_shape(), eagle2_shape(12, 4, 3)])
@pytest.mark.parametrize("static", [False, True])
def test_the_oracle_tree_accepts_its_rank0_path_and_is_lossless(target, tree, static):
    prompt, new = [3, 17, 5, 9], 30
    oracle = OracleTreeDrafter(tree)
    depth = oracle.tree.max_depth
    plain = generate(target, prompt, max_new_tokens=new)
    result = generate(target, prompt, drafter=oracle, max_new_tokens=new, cuda_graphs=static)
    assert result.tokens == plain.tokens
    assert result.stats.steps == -(-new // (depth + 1))  # the whole rank-0 path every step
    assert result.stats.drafted == result.stats.steps * oracle.tree.num_nodes


def test_the_oracle_trees_other_nodes_are_random_and_drafting_reads_nothing(target):
    prompt, tree = [3, 17, 5, 9], eagle2_shape(12, 4, 3)
    plain = generate(target, prompt, max_new_tokens=20).tokens
    oracle = OracleTreeDrafter(tree)
    oracle.prepare(target, [prompt], 40)  # its answers: computed outside the counts
    assert host_reads_per_step(target, lambda: oracle.with_tree(tree), prompt) == 1
    oracle.begin(DecodeSetup(target, torch.tensor(prompt), SamplingParams(), None, 60))
    draft = oracle.propose(DraftContext(torch.tensor(prompt), None))
    tokens = draft.tokens.tolist()
    path = [i for i, c in enumerate(oracle.tree.choices) if not any(c)]
    assert [tokens[i] for i in path] == plain[:len(path)]
    assert len({tokens[i] for i in range(len(tokens)) if i not in path}) > 3


def test_eagle2_shape_is_eagle2s_growth_of_alike_scores():
    tree = eagle2_shape()
    assert (tree.num_nodes, tree.max_depth) == (60, 6)
    assert max(len(tree.children_of(i)) for i in range(-1, 60)) <= 10
    assert [c for c in tree.choices if not any(c)] == [(0,) * d for d in range(1, 7)]
    with pytest.raises(ValueError, match="no rank-0 child of the root"):
        OracleTreeDrafter(Tree.from_paths([[1]]))


# ---- answers of the forward mode and batch that replays them ---------------------------------


def favour_token(token: int, when) -> callable:
    """A forward wrapper that makes `token` the argmax of every row of the forwards `when`
    picks (a planted difference between two ways of running the same target)."""

    def wrap(forward):
        def forward_favouring(self, tokens, *args, **kwargs):
            out = forward(self, tokens, *args, **kwargs)
            if when(self, tokens) and out.logits is not None:
                out.logits[..., token] += 1e3
            return out
        return forward_favouring
    return wrap


def test_prepared_answers_are_those_of_the_forward_mode_that_replays_them(target, monkeypatch):
    """Static steps that round otherwise than the eager forward (here: planted, every token 0):
    an oracle prepared for static steps replays static steps' own answer in full."""
    from selfspec.step import StaticSteps

    monkeypatch.setattr(StaticSteps, "forward",
                        favour_token(0, lambda *_: True)(StaticSteps.forward))
    prompt, oracle = [3, 17, 5, 9], OracleDrafter(3)
    oracle.prepare(target, [prompt], 16, cuda_graphs=True)
    plain = generate(target, prompt, max_new_tokens=16, cuda_graphs=True).tokens
    assert plain == [0] * 16 != generate(target, prompt, max_new_tokens=16).tokens
    replay = generate(target, prompt, drafter=oracle, max_new_tokens=16, cuda_graphs=True)
    assert replay.tokens == plain and replay.stats.accepted == replay.stats.drafted


def test_a_batch_replays_the_answers_of_the_same_batch(target, monkeypatch):
    """A batch whose forwards round otherwise than one row's (planted: every token 1 when
    several rows run together): prepare_batch gives each row the batch's own answer."""
    monkeypatch.setattr(Transformer, "forward", favour_token(
        1, lambda _, tokens: tokens.shape[0] > 1)(Transformer.forward))
    prompts, oracle = [[3, 17, 5, 9], [8, 2, 4]], OracleDrafter(2)
    oracle.prepare_batch(target, prompts, 12)
    results = generate(target, prompts, drafter=oracle, max_new_tokens=12)
    assert [r.tokens for r in results] == [[1] * 12] * 2
    assert all(r.stats.accepted == r.stats.drafted for r in results)
    unprepared = generate(target, prompts, drafter=OracleDrafter(2), max_new_tokens=12)
    assert all(r.stats.accepted < r.stats.drafted for r in unprepared)  # alone's answers
