"""The decode loop's own verification entry points equal the public verifier: the greedy
argmax walk (`verify_greedy`), the unchecked sampled path (`verify_trusted`) and the draws
made ahead of static steps (`tree_draws`)."""

import pytest
import torch

import selfspec.decode as decode
from selfspec.decode import generate
from selfspec.drafters import NgramDrafter
from selfspec.sampling import SamplingParams, logits_to_probs
from selfspec.tree import Tree
from selfspec.verify import (
    tree_draws,
    tree_outcome,
    verify_greedy,
    verify_tree,
    verify_trusted,
)

V = 5  # a small vocabulary: siblings repeat tokens and rows tie


def random_tree(g: torch.Generator, n: int) -> Tree:
    return Tree.from_parents([int(torch.randint(-1, i, (), generator=g)) for i in range(n)])


@pytest.mark.parametrize("seed", range(40))
def test_greedy_walk_equals_tree_verification_of_one_hot_rows(seed):
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(g, int(torch.randint(0, 9, (), generator=g)))
    logits = torch.randint(0, 3, (tree.num_nodes + 1, V), generator=g).float()  # many ties
    tokens = torch.randint(0, V, (tree.num_nodes,), generator=g)
    p = logits_to_probs(logits, SamplingParams())
    want = verify_tree(tree, tokens, None, p)
    got = verify_greedy(tree, tokens.tolist(), logits.argmax(dim=-1).tolist())
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.path.tolist() == want.path.tolist()
    assert got.num_accepted == want.num_accepted


@pytest.mark.parametrize("seed", range(20))
def test_trusted_verification_equals_the_checked_one(seed):
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(g, 6)
    p = torch.softmax(torch.randn(7, V, generator=g), dim=-1)
    q = torch.softmax(torch.randn(6, V, generator=g), dim=-1)
    tokens = torch.multinomial(q, 1, generator=g).flatten()
    want = verify_tree(tree, tokens, q, p, generator=torch.Generator().manual_seed(seed))
    got = verify_trusted(tree, tokens, q, p, torch.Generator().manual_seed(seed))
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.path.tolist() == want.path.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_draws_made_ahead_walk_as_trusted_verification_where_outcomes_are_certain(seed):
    """One-hot drafts against one-hot target rows: every test is certain, so `tree_draws`
    and its walk must keep the very nodes and token `verify_trusted` keeps, over random
    trees whose siblings repeat tokens."""
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(g, int(torch.randint(0, 9, (), generator=g)))
    tokens = torch.randint(0, V, (tree.num_nodes,), generator=g)
    q = torch.nn.functional.one_hot(tokens, V).float()
    p = torch.nn.functional.one_hot(torch.randint(0, V, (tree.num_nodes + 1,), generator=g),
                                    V).float()
    want = verify_trusted(tree, tokens, q, p, None)
    draws = tree_draws(tree.children_table("cpu"), tokens, q, p, g)
    path, last = tree_outcome(draws.tolist())
    assert path == want.path.tolist()
    assert [*tokens[path].tolist(), last] == want.tokens.tolist()


def test_recurring_tree_shapes_share_one_tree_and_its_device_tensors():
    tree = Tree.from_parents([-1, 0, 0, 1])
    assert Tree.from_parents((-1, 0, 0, 1)) is tree
    positions, mask = tree.verification_inputs("cpu")
    assert tree.verification_inputs(torch.device("cpu"))[1] is mask
    assert torch.equal(positions, tree.positions_with_root)
    assert torch.equal(mask, tree.mask_with_root)


def test_greedy_steps_build_no_probability_rows(target, monkeypatch):
    """Greedy decoding reads the argmax only; sampling still goes through logits_to_probs."""
    calls = []
    real = decode.logits_to_probs
    monkeypatch.setattr(decode, "logits_to_probs",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    out = generate(target, prompt, drafter=NgramDrafter(3), max_new_tokens=12)
    assert len(out.tokens) == 12 and not calls
    generate(target, prompt, drafter=NgramDrafter(3), max_new_tokens=4,
             sampling=SamplingParams(temperature=1.0),
             generator=torch.Generator().manual_seed(0))
    assert calls
