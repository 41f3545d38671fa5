"""Medusa "top-k products" candidates: the dynamic tree against brute force, lossless greedy,
exact sampling, argument errors."""

import itertools

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    fit_medusa_heads,
    tiny_llama,
)
from test_medusa import NEW_TOKENS, PROMPTS, random_heads  # noqa: F401 (PROMPTS: plain_greedy)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import MedusaProductDrafter
from selfspec.drafters.base import DraftContext, TargetFeatures
from selfspec.drafters.medusa import _best_product_paths
from selfspec.heads import MedusaConfig, MedusaHeads


def propose(drafter: MedusaProductDrafter, hidden: torch.Tensor):
    """The draft after a forward whose last committed state is hidden[-1]; hidden [A, H]."""
    features = TargetFeatures(torch.arange(len(hidden)), hidden)
    return drafter.propose(DraftContext(torch.arange(len(hidden) + 1), features))


def best_rank_paths(log_probs: torch.Tensor, max_nodes: int) -> list[tuple[int, ...]]:
    """Every rank path of the product of per-head top-k lists, best max_nodes first (ties by
    depth, then rank path); log_probs [depth, k]: head d's log-probability of rank r."""
    depth, top_k = log_probs.shape
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(top_k), repeat=d):
            score = torch.zeros((), dtype=torch.float32)  # summed head by head, as float32
            for level, rank in enumerate(ranks):
                score = score + log_probs[level, rank]
            scored.append((-float(score), d, ranks))
    return [ranks for *_, ranks in sorted(scored)[:max_nodes]]


def brute_force(heads: MedusaHeads, hidden: torch.Tensor, top_k: int, max_nodes: int, depth: int):
    """The best max_nodes paths of the heads' top-k products at `hidden` [H], as
    (rank path, token path)."""
    with torch.no_grad():
        logits = heads(hidden)[:depth]  # [depth, V]
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # [depth, V]
    log_probs = torch.log_softmax(logits, dim=-1).gather(1, order[:, :top_k])  # [depth, k]
    paths = best_rank_paths(log_probs, max_nodes)
    return [(p, tuple(int(order[level, r]) for level, r in enumerate(p))) for p in paths]


def token_paths(draft) -> list[tuple[int, ...]]:
    tokens = draft.tokens.tolist()
    return [tuple(tokens[i] for i in draft.tree.path_to(n)) for n in range(draft.tree.num_nodes)]


def tied_heads(vocab: int, num_heads: int, seed: int) -> MedusaHeads:
    """Heads whose logits take only the values 0, 1, 2: many exact ties between candidates
    and between paths."""
    heads = MedusaHeads(MedusaConfig(hidden_size=1, vocab_size=vocab, num_heads=num_heads,
                                     num_layers=0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads.heads:
            head.lm_head.weight.copy_(torch.randint(0, 3, (vocab, 1), generator=g).float())
    return heads.eval()


# ---- what it proposes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_k, max_nodes, depth",
    [(3, 10, None), (4, 16, 3), (2, 1, 2), (5, 7, 1), (3, 39, 3), (3, 100, 3), (1, 5, 4)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_tree_is_the_best_paths_of_the_top_k_products(top_k, max_nodes, depth, seed):
    heads = random_heads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4), seed, std=0.5)
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))  # [A, H]
    drafter = MedusaProductDrafter(heads, top_k, max_nodes, depth)
    draft = propose(drafter, hidden)
    expected = brute_force(heads, hidden[-1], top_k, max_nodes, depth or 4)
    assert draft.q is None  # chosen, not sampled: exact under the shared verifier
    assert token_paths(draft) == [tokens for _, tokens in expected]  # same nodes, same order
    # Siblings come in rank order, so the tree's own choices are the heads' ranks.
    assert list(draft.tree.choices) == [ranks for ranks, _ in expected]
    assert draft.tree.num_nodes == len(expected) <= drafter.max_nodes
    assert all(-1 <= p < i for i, p in enumerate(draft.tree.parents))  # topological


@pytest.mark.parametrize("top_k, depth", [(2, 4), (3, 3), (4, 2)])
def test_enough_nodes_give_the_full_product_tree(top_k, depth):
    heads = random_heads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4), seed=3)
    full = sum(top_k**d for d in range(1, depth + 1))
    drafter = MedusaProductDrafter(heads, top_k, max_nodes=full + 5, depth=depth)
    assert drafter.max_nodes == full  # sizes the target's cache: no more than can be proposed
    draft = propose(drafter, torch.randn(2, 16))
    assert draft.tree.num_nodes == full
    every_path = {p for d in range(1, depth + 1) for p in itertools.product(range(top_k), repeat=d)}
    assert set(draft.tree.choices) == every_path
    assert len(set(token_paths(draft))) == full


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("top_k, max_nodes", [(4, 9), (6, 20), (3, 13)])
def test_ties_keep_the_tree_prefix_closed(seed, top_k, max_nodes):
    heads = tied_heads(vocab=8, num_heads=3, seed=seed)
    hidden = torch.ones(1, 1)  # [A, H]
    draft = propose(MedusaProductDrafter(heads, top_k, max_nodes), hidden)
    expected = brute_force(heads, hidden[-1], top_k, max_nodes, 3)
    assert list(draft.tree.choices) == [ranks for ranks, _ in expected]
    assert token_paths(draft) == [tokens for _, tokens in expected]
    paths = set(draft.tree.choices)
    assert all(c[:-1] in paths for c in draft.tree.choices if len(c) > 1)  # prefix-closed


@pytest.mark.parametrize("max_nodes", [5, 12, 20, 39])
def test_exact_ties_follow_depth_then_rank_path(max_nodes):
    """Integer log-probs make many paths tie exactly, including paths whose parents do not:
    (0, 2, 1) and (1, 0, 2) both score -3 while their parents score -2 and -1."""
    log_probs = -torch.tensor([[0.0, 1.0, 2.0]] * 3)  # [depth, k]
    parents, level, rank = _best_product_paths(log_probs, max_nodes)
    paths: list[tuple[int, ...]] = []
    for p, r in zip(parents.tolist(), rank.tolist(), strict=True):
        paths.append((*(paths[p] if p >= 0 else ()), r))
    assert paths == best_rank_paths(log_probs, max_nodes)
    assert level.tolist() == [len(p) - 1 for p in paths]


def test_no_hidden_state_yet_means_an_empty_draft():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    draft = MedusaProductDrafter(heads, 2, 4).propose(DraftContext(torch.tensor([3]), None))
    assert draft.tree.num_nodes == 0 and draft.tokens.numel() == 0


def test_bad_arguments_are_clear_errors():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=2))
    cases = [
        ({"top_k": 0, "max_nodes": 4}, r"top_k must be an integer >= 1, got 0; pass top_k >= 1"),
        ({"top_k": 25, "max_nodes": 4}, r"top_k=25 .* vocabulary has only 24 .* top_k <= 24"),
        ({"top_k": 2, "max_nodes": 0}, r"max_nodes must be an integer >= 1, got 0; pass max_n"),
        ({"top_k": 2, "max_nodes": 4, "depth": 0}, r"depth must be an integer >= 1, got 0"),
        ({"top_k": 2, "max_nodes": 4, "depth": 3}, r"depth=3 .* only 2 Medusa heads.*depth <= 2"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=f"MedusaProductDrafter: {message}"):
            MedusaProductDrafter(heads, **kwargs)
    target = Transformer.from_hf(tiny_llama(5, vocab=24, layers=1, hidden=32))
    drafter = MedusaProductDrafter(heads, 2, 4)
    with pytest.raises(ValueError, match="MedusaProductDrafter: the heads have hidden_size 16"):
        generate(target, [3, 4], drafter=drafter, max_new_tokens=2)


# ---- lossless greedy, exact sampling --------------------------------------------------------


@pytest.fixture(scope="module")
def fitted_heads(target, plain_greedy):
    """Heads fit for 30 AdamW steps to the target's own greedy continuations of PROMPTS."""
    return fit_medusa_heads(target, plain_greedy)[0]


def greedy_taus(target, heads, top_k, max_nodes, plain_greedy) -> list[float]:
    """Assert greedy decoding through the drafter equals plain greedy; returns each tau."""
    taus = []
    for prompt, expected in plain_greedy.items():
        drafter = MedusaProductDrafter(heads, top_k, max_nodes)
        result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected
        taus.append(result.stats.tau)
    return taus


SETTINGS = [(4, 16), (2, 30)]  # (2, 30): the full product tree of 4 heads


@pytest.mark.parametrize("top_k, max_nodes", SETTINGS)
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, top_k, max_nodes):
    heads = random_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4), seed=2)
    greedy_taus(target, heads, top_k, max_nodes, plain_greedy)


@pytest.mark.parametrize("top_k, max_nodes", SETTINGS)
def test_greedy_is_lossless_and_accepted_with_fitted_heads(
    target, plain_greedy, fitted_heads, top_k, max_nodes
):
    taus = greedy_taus(target, fitted_heads, top_k, max_nodes, plain_greedy)
    assert sum(taus) / len(taus) > 2.0, taus  # several nodes deep: the dynamic tree was used


def test_sampling_through_top_k_products_follows_the_target_law():
    vocab, n_samples, params = 8, 1000, SamplingParams(1.0)
    target = Transformer.from_hf(tiny_llama(3, vocab=vocab, layers=1, hidden=16, std=0.5))
    heads = random_heads(MedusaConfig(hidden_size=16, vocab_size=vocab, num_heads=2), 4)
    drafter = MedusaProductDrafter(heads, top_k=3, max_nodes=6)
    assert_drafted_sampling_is_exact(target, drafter, params, n_samples)
