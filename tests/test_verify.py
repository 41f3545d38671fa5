"""Stub-probability tests of the verifier: accept/reject by construction, greedy, bad input."""

import pytest
import torch

from selfspec.sampling import SamplingParams, logits_to_probs
from selfspec.tree import Tree
from selfspec.verify import tree_draws, tree_outcome, verify_linear, verify_tree

V = 8


def one_hot(*tokens: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def uniform(rows: int) -> torch.Tensor:
    return torch.full((rows, V), 1.0 / V)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(5))
def test_always_accept_when_the_target_is_sure_of_every_draft(seed):
    draft = torch.tensor([3, 1, 4])
    p = one_hot(3, 1, 4, 6)
    for q in (None, uniform(3)):
        acc = verify_linear(draft, q, p, generator=gen(seed))
        assert acc.num_accepted == 3
        assert acc.tokens.tolist() == [3, 1, 4, 6]  # the bonus token comes from p's last row
        assert acc.path.tolist() == [0, 1, 2]


@pytest.mark.parametrize("seed", range(5))
def test_always_accept_when_draft_and_target_agree(seed):
    p = torch.softmax(torch.randn(4, V, generator=gen(99)), -1)
    draft = torch.tensor([0, 5, 2])
    acc = verify_linear(draft, p[:3], p, generator=gen(seed))  # ratio p/q = 1 everywhere
    assert acc.num_accepted == 3 and acc.tokens[:3].tolist() == [0, 5, 2]


@pytest.mark.parametrize("seed", range(5))
def test_never_accept_a_draft_the_target_rules_out(seed):
    draft = torch.tensor([2, 2])
    p = torch.softmax(torch.randn(3, V, generator=gen(7)), -1)
    p[0, 2] = 0.0
    p[0] /= p[0].sum()
    q = one_hot(2, 2) * 0.5 + 0.5 / V
    acc = verify_linear(draft, q, p, generator=gen(seed))
    assert acc.num_accepted == 0 and acc.path.numel() == 0
    residual = (p[0] - q[0]).clamp(min=0)
    assert residual[acc.tokens[0]] > 0  # the correction comes from norm(max(p - q, 0))


@pytest.mark.parametrize("j", range(4))
def test_accept_exactly_the_first_j(j):
    draft = torch.tensor([1, 2, 3])
    rows = [t if i < j else 7 for i, t in enumerate([1, 2, 3])] + [5]
    p = one_hot(*rows)
    acc = verify_linear(draft, None, p, generator=gen())
    assert acc.num_accepted == j
    assert acc.tokens.tolist() == [1, 2, 3][:j] + [rows[j]]


def greedy_reference(tree: Tree, tokens: list[int], logits: torch.Tensor) -> list[int]:
    """Walk down the tree keeping the child that equals the target's argmax."""
    node, out = -1, []
    while True:
        best = int(logits[node + 1].argmax())
        match = [c for c in tree.children_of(node) if tokens[c] == best]
        out.append(best)
        if not match:
            return out
        node = match[0]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_tree_verification_equals_the_argmax_walk(seed):
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
    logits = torch.randn(tree.num_nodes + 1, 4, generator=gen(seed))
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))
    # Candidates are the top ranks of a noisy copy of the target, as a drafter would give.
    draft_logits = logits + torch.randn(logits.shape, generator=gen(seed + 100))
    tokens = [
        int(torch.sort(draft_logits[parent + 1], descending=True, stable=True).indices[rank[-1]])
        for parent, rank in zip(tree.parents, tree.choices, strict=True)
    ]
    expected = greedy_reference(tree, tokens, logits)
    token_tensor = torch.tensor(tokens)
    deterministic = verify_tree(tree, token_tensor, None, p)  # greedy draws no random number
    assert deterministic.tokens.tolist() == expected
    # The sampled path with one-hot drafts (a drafter sampling at temperature 0) agrees exactly.
    q = torch.nn.functional.one_hot(token_tensor, 4).float()
    sampled = verify_tree(tree, token_tensor, q, p, generator=gen(seed))
    assert sampled.tokens.tolist() == expected
    assert torch.equal(sampled.path, deterministic.path)


@pytest.mark.parametrize("seed", range(30))
def test_zero_probability_target_tokens_are_never_emitted(seed):
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    params = SamplingParams(temperature=1.0, top_k=3)
    p = logits_to_probs(torch.randn(tree.num_nodes + 1, V, generator=gen(seed)), params)
    q = torch.softmax(torch.randn(tree.num_nodes, V, generator=gen(seed + 1)), -1)
    tokens = torch.multinomial(q, 1, generator=gen(seed + 2)).flatten()
    acc = verify_tree(tree, tokens, q, p, generator=gen(seed + 3))
    rows = [0] + [i + 1 for i in acc.path.tolist()]  # the p row each emitted token came from
    for row, token in zip(rows, acc.tokens.tolist(), strict=True):
        assert p[row, token] > 0


def test_sampled_verification_without_generator_is_a_clear_error():
    p = torch.softmax(torch.randn(2, V, generator=gen()), -1)
    with pytest.raises(ValueError, match="generator"):
        verify_linear(torch.tensor([1]), None, p)


def _bad_linear_inputs():
    p = torch.softmax(torch.randn(3, V, generator=gen()), -1)
    q = torch.softmax(torch.randn(2, V, generator=gen(1)), -1)
    d = torch.tensor([1, 2])
    nan_p = p.clone()
    nan_p[1, 3] = float("nan")
    neg_q = q.clone()
    neg_q[0, 0] = -0.1
    return [
        ((d, q[:1], p), "q has 1 rows"),
        ((d, q, p[:2]), "p has 2 rows"),
        ((d, torch.softmax(torch.randn(2, V + 1), -1), p), "vocab size"),
        ((d, q, nan_p), "p holds NaN"),
        ((d, neg_q, p), "q holds negative"),
        ((d, q, p * 2), "rows of p must sum to 1"),
        ((d, q, torch.randn(3, V)), "p"),
        ((d.float(), q, p), "draft_tokens"),
        ((torch.tensor([1, V]), q, p), "draft_tokens holds ids outside"),
        ((d, one_hot(0, 0), p), "probability 0 under its q row"),
    ]


@pytest.mark.parametrize("args, message", _bad_linear_inputs())
def test_bad_linear_input_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message):
        verify_linear(*args, generator=gen())


def test_bad_tree_input_names_the_argument():
    tree = Tree.from_paths([[0], [1]])
    p = torch.softmax(torch.randn(3, V, generator=gen()), -1)
    q = torch.softmax(torch.randn(2, V, generator=gen(1)), -1)
    with pytest.raises(ValueError, match="tokens has 3 entries, the tree 2 nodes"):
        verify_tree(tree, torch.tensor([1, 2, 3]), q, p, generator=gen())
    with pytest.raises(ValueError, match="p has 2 rows, expected 3"):
        verify_tree(tree, torch.tensor([1, 2]), q, p[:2], generator=gen())
    with pytest.raises(ValueError, match="siblings under node -1 repeat"):
        verify_tree(tree, torch.tensor([1, 1]), q, p, generator=gen(), without_replacement=True)
    with pytest.raises(ValueError, match="selfspec.Tree"):
        verify_tree([-1, -1], torch.tensor([1, 2]), q, p, generator=gen())


def test_a_walk_over_draws_keeps_the_accepted_nodes_then_the_stop_tokens_draw():
    # Rows: root, nodes 0..3 of a tree where 0, 1 are the root's children and 2, 3 node 0's.
    accepted, emitted = [0, 3, -1, -1, -1], [7, 8, 9, 10, 11]
    assert tree_outcome(accepted + emitted) == ([0, 3], 11)  # node 3 a leaf: its bonus
    assert tree_outcome([0, -1, -1, -1, -1] + emitted) == ([0], 8)  # node 0's correction
    assert tree_outcome([-1, 3, -1, -1, -1] + emitted) == ([], 7)
    chain = Tree.chain(3).children_table("cpu")
    assert chain.tolist() == [[0], [1], [2], [-1]]


def test_draws_accept_what_the_target_would_draw_and_never_what_it_cannot():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.2, 0.8], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.6, 0.4, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        draws = tree_draws(Tree.chain(2).children_table("cpu"), torch.tensor([1, 0]), q, p,
                           g).tolist()
        assert draws[0] == 0  # q = p at token 1: node 0 always accepted
        assert draws[1] == -1  # p(0) = 0 after node 0: node 1 never accepted
        assert draws[4] == 2  # node 0's correction: norm(max(p - q, 0)) = (0, 0, 1)
        assert draws[5] in (0, 1, 2)


def test_siblings_drawn_without_replacement_are_tested_against_what_was_left():
    """After the root's first child (0, which p rules out) is rejected, the residual is
    (0, 0.6, 0.4) and the second child (1) was drawn from q without 0: (0, 0.8, 0.2). So 1
    is accepted with probability 0.6 / 0.8 = 0.75; tested against q itself it would be
    certain (0.6 / 0.4 >= 1)."""
    p = torch.tensor([[0.0, 0.7, 0.3], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.4, 0.1], [0.5, 0.4, 0.1]])  # both children drawn from one law
    children = Tree.from_parents([-1, -1]).children_table("cpu")
    g, trials = torch.Generator().manual_seed(0), 400
    kept = sum(tree_outcome(tree_draws(children, torch.tensor([0, 1]), q, p, g,
                                       without_replacement=True).tolist())[0] == [1]
               for _ in range(trials))
    assert 0.65 < kept / trials < 0.85  # 0.75 within 4.5 standard deviations
