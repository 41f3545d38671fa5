"""Statistical exactness: speculative emission follows the target's law, and the test has power.

A toy language over V tokens gives a target law p(. | context) and a different draft law
q(. | context). One speculative step drafts a chain or tree from q, verifies it against p, and
the first two emitted tokens (continued by sampling the target when only one is emitted) must
follow p(t1) p(t2 | t1) exactly: a chi-square test at a fixed seed. The same test is run
against deliberately broken verifiers to show that it detects a missing residual update.

The default run checks every draft shape at temperature 1 but siblings drawn without
replacement, each at the size at which the broken verifiers it guards against fail: a missing
residual update shows at p < 1e-20 in N_FAST steps; siblings verified as if drawn with
replacement show only near N_SAMPLES, so that case and its broken twin are in the slow run,
with top-k, top-p and every case at N_SAMPLES.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from helpers import P_VALUE_FLOOR, fit_pvalue, joint_two_token_law

import selfspec.verify as verify_module
from selfspec.sampling import SamplingParams, logits_to_probs
from selfspec.tree import Tree
from selfspec.verify import tree_draws, tree_outcome, verify_linear, verify_tree

V = 6
N_SAMPLES = 12_000
N_FAST = 4_000
slow = pytest.mark.slow
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=0.8, top_p=0.8),
}


class ToyWorld:
    """Deterministic target and draft laws over V tokens for every context."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._memo: dict = {}

    def _logits(self, ctx: tuple[int, ...], salt: int) -> torch.Tensor:
        code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(ctx))
        return torch.randn(V, generator=torch.Generator().manual_seed(2 * code + salt)) * 1.5

    def p(self, ctx: tuple[int, ...]) -> torch.Tensor:
        key = ("p", ctx)
        if key not in self._memo:
            self._memo[key] = logits_to_probs(self._logits(ctx, 0), self.params)
        return self._memo[key]

    def q(self, ctx: tuple[int, ...], warp: SamplingParams | None = None) -> torch.Tensor:
        warp = warp or self.params
        key = ("q", ctx, warp)
        if key not in self._memo:
            draft_logits = 0.6 * self._logits(ctx, 0) + self._logits(ctx, 1)
            self._memo[key] = logits_to_probs(draft_logits, warp)
        return self._memo[key]


def draw(probs: torch.Tensor, rng: random.Random) -> int:
    # The test draws drafts with Python's RNG: an independent, fast source of randomness.
    return rng.choices(range(V), weights=probs.tolist())[0]


def draft(world: ToyWorld, tree: Tree, mode: str, rng: random.Random):
    """Draft a tree from q: sampled with or without replacement, or deterministic top ranks."""
    # Without replacement needs full support for every sibling: keep the draft untruncated.
    warp = SamplingParams(world.params.temperature) if mode == "without" else None
    ctxs, tokens, q_rows = [], [], []
    drawn: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        ctx = ctxs[parent] if parent >= 0 else ()
        q_row = world.q(ctx, warp)
        if mode == "deterministic":
            x = int(torch.sort(q_row, descending=True, stable=True).indices[tree.choices[node][-1]])
        elif mode == "without":
            remaining = q_row.clone()
            remaining[drawn.setdefault(parent, [])] = 0.0
            x = draw(remaining, rng)
            drawn[parent].append(x)
        else:
            x = draw(q_row, rng)
        ctxs.append((*ctx, x))
        tokens.append(x)
        q_rows.append(q_row)
    p = torch.stack([world.p(())] + [world.p(c) for c in ctxs])
    q = None if mode == "deterministic" else torch.stack(q_rows)
    return torch.tensor(tokens, dtype=torch.long), q, p


def emission_pvalue(setting: str, tree: Tree, mode: str, seed: int = 0,
                    drawn_ahead: bool = False, without: bool | None = None,
                    samples: int = N_SAMPLES) -> float:
    """samples: speculative steps. drawn_ahead: verify by `tree_draws` and `tree_outcome`
    (the decode loop's path in static steps) rather than the public verifier. without: what
    the verifier is told of the siblings' draws (default: the truth)."""
    world = ToyWorld(SETTINGS[setting])
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    without = mode == "without" if without is None else without
    counts: Counter = Counter()
    for _ in range(samples):
        tokens, q, p = draft(world, tree, mode, rng)
        if drawn_ahead:
            draws = tree_draws(tree.children_table("cpu"), tokens, q, p, g, without)
            path, last = tree_outcome(draws.tolist())
            emitted = [*(tokens[i].item() for i in path), last]
        else:
            emitted = _verified(tree, tokens, q, p, g, without)
        if len(emitted) == 1:
            emitted.append(draw(world.p((emitted[0],)), rng))
        counts[tuple(emitted[:2])] += 1
    law = joint_two_token_law(world.p(()), lambda t1: world.p((t1,)))
    return fit_pvalue(counts, law, samples)


def _verified(tree, tokens, q, p, g, without) -> list[int]:
    if tree.is_chain:
        return verify_linear(tokens, q, p, generator=g).tokens.tolist()
    return verify_tree(tree, tokens, q, p, generator=g, without_replacement=without
                       ).tokens.tolist()


SHAPES = [("chain", "with"), ("chain", "deterministic"), ("tree", "with"), ("tree", "without"),
          ("tree", "deterministic")]


def fast_size(mode: str) -> int:
    """The default run's steps for a draft mode: siblings drawn without replacement need
    N_SAMPLES for their broken verifier to show, the others N_FAST."""
    return N_SAMPLES if mode == "without" else N_FAST


# Siblings drawn without replacement need N_SAMPLES (13 s on a 2-core AVX2 host, with their
# broken twin): slow; in the default run the drafters that draw so (EAGLE's sampled children,
# DFlash's trees) keep the target's law end to end.
CASES = [pytest.param("t1", shape, mode, fast_size(mode), id=f"t1-{shape}-{mode}",
                      marks=[slow] if mode == "without" else [])
         for shape, mode in SHAPES] + [
    pytest.param(setting, shape, mode, N_SAMPLES, id=f"{setting}-{shape}-{mode}-full",
                 marks=slow)
    for setting in SETTINGS for shape, mode in SHAPES
]


@pytest.mark.parametrize("setting, shape, mode, samples", CASES)
def test_emission_follows_the_target_law(setting, shape, mode, samples):
    tree = Tree.chain(3) if shape == "chain" else TREE
    assert emission_pvalue(setting, tree, mode, samples=samples) > P_VALUE_FLOOR


DRAWN_CASES = [pytest.param("t1", "chain", "with", N_FAST, id="t1-chain-with")] + [
    pytest.param(setting, shape, mode, N_SAMPLES, id=f"{setting}-{shape}-{mode}-full",
                 marks=slow)
    for setting in SETTINGS for shape, mode in SHAPES  # the cuts: one tree
    if mode != "deterministic" and (setting == "t1" or mode == "without")
]


@pytest.mark.parametrize("setting, shape, mode, samples", DRAWN_CASES)
def test_emission_drawn_ahead_follows_the_target_law(setting, shape, mode, samples):
    """`tree_draws`: every node's tests of its children made at once, walked after."""
    tree = Tree.chain(3) if shape == "chain" else TREE
    assert emission_pvalue(setting, tree, mode, drawn_ahead=True,
                           samples=samples) > P_VALUE_FLOOR


@pytest.mark.parametrize("shape, mode", [("chain", "with"), ("tree", "with")])
def test_the_exactness_test_catches_draws_without_the_residual(monkeypatch, shape, mode):
    monkeypatch.setattr(verify_module, "_residuals", lambda residual, proposal: residual)
    tree = Tree.chain(3) if shape == "chain" else TREE
    assert emission_pvalue("t1", tree, mode, drawn_ahead=True,
                           samples=N_FAST) < P_VALUE_FLOOR / 10


@slow
def test_the_exactness_test_catches_draws_that_forget_the_removed_siblings():
    assert emission_pvalue("t1", TREE, "without", drawn_ahead=True,
                           without=False) < P_VALUE_FLOOR / 10


def _no_residual_update(residual, proposal, x):
    return residual


def _proposal_ignoring_removed_siblings(q, node, removed, without_replacement):
    return None if q is None else q[node]


@pytest.mark.parametrize(
    "broken, shape, mode",
    [
        (("_residual", _no_residual_update), "chain", "with"),
        (("_residual", _no_residual_update), "tree", "with"),
        (("_residual", _no_residual_update), "tree", "deterministic"),
        pytest.param(("_proposal", _proposal_ignoring_removed_siblings), "tree", "without",
                     marks=slow),
    ],
)
def test_the_exactness_test_catches_a_broken_verifier(monkeypatch, broken, shape, mode):
    monkeypatch.setattr(verify_module, *broken)
    tree = Tree.chain(3) if shape == "chain" else TREE
    # The very check that passes the real verifier, at the default run's size, fails each
    # broken one, with margin.
    assert emission_pvalue("t1", tree, mode, samples=fast_size(mode)) < P_VALUE_FLOOR / 10
