"""Medusa drafters (drafters/medusa.py): static trees and top-k products, lossless and exact."""

import itertools
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    FAST_LAW_SAMPLES,
    assert_drafted_sampling_is_exact,
    fit_medusa_heads,
    random_medusa_heads,
    reduced_medusa_heads,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, Tree, generate
from selfspec.drafters import DraftContext, MedusaProductDrafter
from selfspec.drafters.base import TargetFeatures
from selfspec.drafters.medusa import MedusaDrafter, _best_product_paths
from selfspec.heads import MedusaConfig, MedusaHeads

TREE_DIR = Path(__file__).resolve().parents[2] / "conf" / "tree"
PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24


def tree_choices(name: str) -> list[list[int]]:
    return yaml.safe_load((TREE_DIR / f"{name}.yaml").read_text())["choices"]


# ---- what it proposes ------------------------------------------------------------------------


def test_each_node_gets_its_rank_from_the_head_of_its_depth():
    heads = random_medusa_heads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3), seed=1)
    paths = [[0], [1], [2], [0, 0], [0, 3], [2, 1], [0, 3, 5]]
    drafter = MedusaDrafter(heads, paths)
    hidden = torch.randn(4, 16)  # [A, H]: only the last row (the root's producer) matters
    features = TargetFeatures(torch.arange(4), hidden)
    draft = drafter.propose(DraftContext(torch.arange(5), features))
    order = torch.sort(heads(hidden[-1]), dim=-1, descending=True, stable=True).indices  # [K, V]
    expected = [int(order[len(c) - 1, c[-1]]) for c in drafter.tree.choices]
    assert draft.tokens.tolist() == expected
    assert draft.q is None  # chosen, not sampled: exact under the shared verifier
    assert draft.tree.choices == tuple(sorted(map(tuple, paths), key=lambda p: (len(p), p)))


def test_no_hidden_state_yet_means_an_empty_draft():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    draft = MedusaDrafter(heads, [[0], [0, 0]]).propose(DraftContext(torch.tensor([3]), None))
    assert draft.tree.num_nodes == 0 and draft.tokens.numel() == 0


def test_bad_drafter_arguments_are_clear_errors():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=2))
    with pytest.raises(ValueError, match="3 deep but there are only 2 Medusa heads"):
        MedusaDrafter(heads, Tree.chain(3))
    with pytest.raises(ValueError, match="candidate rank 30, but the vocabulary has only 24"):
        MedusaDrafter(heads, [[30]])
    target = Transformer.from_hf(tiny_llama(5, vocab=24, layers=1, hidden=32))
    with pytest.raises(ValueError, match="heads have hidden_size 16, the target 32"):
        generate(target, [3, 4], drafter=MedusaDrafter(heads, [[0]]), max_new_tokens=2)


@pytest.mark.parametrize(
    "name, num_nodes", [("chain4", 4), ("medusa_small", 15), ("medusa_63", 63)]
)
def test_tree_configs_are_valid_medusa_choices(name, num_nodes):
    spec = yaml.safe_load((TREE_DIR / f"{name}.yaml").read_text())
    tree = Tree.from_paths(spec["choices"])
    assert spec["name"] == name
    assert tree.num_nodes == len(spec["choices"]) == num_nodes  # no duplicates
    assert tree.max_depth <= 4
    assert tree.is_chain == (name == "chain4")


# ---- lossless greedy -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted_heads(target, plain_greedy):
    """Heads fit for 30 AdamW steps to the target's own greedy continuations of PROMPTS."""
    heads, metrics = fit_medusa_heads(target, plain_greedy)
    assert metrics["medusa/head3_top1"] > 0.5
    return heads


def greedy_with_medusa(target, heads, choices, plain_greedy) -> list[float]:
    """Assert Medusa greedy decoding equals plain greedy on every prompt; returns each tau."""
    taus = []
    for prompt, expected in plain_greedy.items():
        drafter = MedusaDrafter(heads, choices)
        result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected
        taus.append(result.stats.tau)
    return taus


@pytest.mark.parametrize("tree", ["chain4", "medusa_small", "medusa_63"])
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, tree):
    heads = random_medusa_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4), seed=2)
    greedy_with_medusa(target, heads, tree_choices(tree), plain_greedy)


@pytest.mark.parametrize("tree", ["chain4", "medusa_small"])
def test_greedy_is_lossless_and_accepted_with_fitted_heads(
    target, plain_greedy, fitted_heads, tree
):
    taus = greedy_with_medusa(target, fitted_heads, tree_choices(tree), plain_greedy)
    # measured: every prompt 3.1 or more, means 3.8 (chain4) and 4.4 (medusa_small)
    assert min(taus) > 2.5 and sum(taus) / len(taus) > 3.0, taus


@pytest.mark.parametrize("tree", ["chain4", "medusa_small"])
def test_greedy_is_lossless_with_shared_lm_head_heads(target, plain_greedy, tree):
    config = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4, shared_lm_head=True)
    greedy_with_medusa(target, random_medusa_heads(config, seed=3), tree_choices(tree),
                       plain_greedy)


# ---- exact sampling --------------------------------------------------------------------------

SMALL_VOCAB = 8
N_SAMPLES = 1000  # ~5 s per sampling mode on one core
SAMPLING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.mark.parametrize("params, samples", [(SamplingParams(1.0), FAST_LAW_SAMPLES), pytest.param(
    SamplingParams(0.8, top_p=0.9), N_SAMPLES, marks=pytest.mark.slow)])
def test_sampling_through_medusa_follows_the_target_law(params, samples):
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    config = MedusaConfig(hidden_size=16, vocab_size=SMALL_VOCAB, num_heads=2)
    heads = random_medusa_heads(config, 4)
    drafter = MedusaDrafter(heads, SAMPLING_TREE)
    assert_drafted_sampling_is_exact(target, drafter, params, samples)


# ---- top-k products: what they propose -------------------------------------------------------


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


@pytest.mark.parametrize(
    "top_k, max_nodes, depth",
    [(3, 10, None), (4, 16, 3), (2, 1, 2), (5, 7, 1), (3, 39, 3), (3, 100, 3), (1, 5, 4)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_tree_is_the_best_paths_of_the_top_k_products(top_k, max_nodes, depth, seed):
    config = MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4)
    heads = random_medusa_heads(config, seed, std=0.5)
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
    heads = random_medusa_heads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4), seed=3)
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


def test_no_hidden_state_yet_means_an_empty_product_draft():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    draft = MedusaProductDrafter(heads, 2, 4).propose(DraftContext(torch.tensor([3]), None))
    assert draft.tree.num_nodes == 0 and draft.tokens.numel() == 0


def test_bad_product_arguments_are_clear_errors():
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


# ---- top-k products: lossless greedy, exact sampling -----------------------------------------


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
def test_products_greedy_is_lossless_with_random_heads(target, plain_greedy, top_k, max_nodes):
    heads = random_medusa_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4), seed=2)
    greedy_taus(target, heads, top_k, max_nodes, plain_greedy)


@pytest.mark.parametrize("top_k, max_nodes", SETTINGS)
def test_products_greedy_is_lossless_and_accepted_with_fitted_heads(
    target, plain_greedy, fitted_heads, top_k, max_nodes
):
    taus = greedy_taus(target, fitted_heads, top_k, max_nodes, plain_greedy)
    assert sum(taus) / len(taus) > 2.0, taus  # several nodes deep: the dynamic tree was used


def test_sampling_through_top_k_products_follows_the_target_law():
    vocab, n_samples, params = 8, FAST_LAW_SAMPLES, SamplingParams(1.0)
    target = Transformer.from_hf(tiny_llama(3, vocab=vocab, layers=1, hidden=16, std=0.5))
    heads = random_medusa_heads(MedusaConfig(hidden_size=16, vocab_size=vocab, num_heads=2), 4)
    drafter = MedusaProductDrafter(heads, top_k=3, max_nodes=6)
    assert_drafted_sampling_is_exact(target, drafter, params, n_samples)


# ---- a reduced draft vocabulary --------------------------------------------------------------

VOCAB_PROMPTS = [[3, 9, 14, 2, 27], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
CHAIN4 = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def vocab_greedy(target) -> dict:
    """Plain greedy continuations of VOCAB_PROMPTS, NEW_TOKENS long each."""
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens
            for p in VOCAB_PROMPTS}


def test_greedy_is_lossless_when_the_target_leaves_the_draft_vocabulary(target, vocab_greedy):
    produced = {t for tokens in vocab_greedy.values() for t in tokens}
    kept = sorted(produced)[::2] + [60, 61]  # half of what the target writes is out of reach
    heads = reduced_medusa_heads(target, kept)
    drafters = [MedusaDrafter(heads, CHAIN4), MedusaProductDrafter(heads, top_k=3, max_nodes=10)]
    for prompt, expected in vocab_greedy.items():
        for drafter in drafters:
            result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
            assert result.tokens == expected


def test_reduced_heads_fitted_to_the_target_are_accepted_and_propose_only_their_tokens(
        target, vocab_greedy):
    full, _ = fit_medusa_heads(target, vocab_greedy)
    produced = sorted({t for tokens in vocab_greedy.values() for t in tokens})
    heads = reduced_medusa_heads(target, produced)
    heads.load_state_dict({**full.state_dict(), **_rows(full, heads)})
    proposed = []
    for prompt, expected in vocab_greedy.items():
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
