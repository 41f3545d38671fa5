"""Drafting with the target's own MTP modules (drafters/mtp.py): greedy lossless in chains,
static and dynamic trees, eager and static steps and batches, in each checkpoint layout; the
laws sampled drafts report, the two-token law at T = 1 (and a misstated law caught); its pairs
as the module reads them; clear refusals."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FAST_LAW_SAMPLES,
    P_VALUE_FLOOR,
    adam_fit,
    assert_drafted_sampling_is_exact,
    committed_context,
    continuation_rows,
    law_samples,
    sampled_pvalue,
)
from mtp_reference import QWEN3_NEXT, mtp_target

from selfspec import SamplingParams, Tree, generate
from selfspec.drafters.mtp import MtpDrafter
from selfspec.heads.base import LossOutput
from selfspec.sampling import logits_to_probs

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [40, 41, 42, 3, 9], [3]]
NEW_TOKENS = 20
SHAPES = {
    "chain": {"tree": Tree.chain(4)},
    "static_tree": {"tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
    "dynamic": {"total_tokens": 8, "depth": 4, "top_k": 2},
}


def fitted_target(layout: str):
    """A target whose first MTP module is fit (AdamW, full batch) to the target's own greedy
    continuations of PROMPTS, one and two steps deep (the second reading its own outputs).
    layout "qwen3_next": a Qwen3-Next hybrid with its `mtp` module."""
    arch = QWEN3_NEXT if layout == "qwen3_next" else {}
    target = mtp_target("mtp" if arch else layout, seed=5, **arch)
    plain = {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}
    tokens, mask = continuation_rows(plain)
    with torch.no_grad():
        hidden = target(tokens, torch.arange(tokens.shape[1])).last_hidden  # [B, T, h]

    def loss() -> LossOutput:
        total, feature = 0.0, hidden
        for step in (1, 2):  # step s reads token t+s and predicts token t+s+1
            rows = tokens.shape[1] - step
            out = target.mtp_forward(0, target.embed_tokens(tokens[:, step:]),
                                     feature[:, :rows], torch.arange(rows))
            logits = target.mtp_logits(0, out[:, :-1])  # [B, rows - 1, V]
            labels = tokens[:, step + 1:].masked_fill(~mask[:, step + 1:], -100)
            total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            feature = out
        return LossOutput(total, {})

    target.requires_grad_(False)
    target.mtp.requires_grad_(True)
    adam_fit(loss, target.mtp.parameters(), steps=40)
    return target.requires_grad_(False).eval(), plain


@pytest.fixture(scope="module")
def fitted():
    """The fitted target of each layout, made when first asked for."""
    return functools.cache(fitted_target)


# The default run: every shape eagerly and the dynamic tree in static steps on NextN (the
# drafter is the same over every layout's module: the forward tests cover the layouts); the
# rest slow.
GREEDY_CASES = [
    *[pytest.param("nextn", shape, False, id=f"nextn-eager-{shape}") for shape in SHAPES],
    pytest.param("nextn", "dynamic", True, id="nextn-static-dynamic"),
    *[pytest.param("mtp", shape, static, id=f"mtp-{'static' if static else 'eager'}-{shape}",
                   marks=pytest.mark.slow) for shape in SHAPES for static in (False, True)],
    *[pytest.param("nextn", shape, True, id=f"nextn-static-{shape}", marks=pytest.mark.slow)
      for shape in ("chain", "static_tree")],
    *[pytest.param("mimo", shape, False, id=f"mimo-eager-{shape}", marks=pytest.mark.slow)
      for shape in SHAPES],
    # a hybrid target (its fit takes ~5 s): each rejection leaves no trace in its Gated
    # DeltaNet states (eager only)
    *[pytest.param("qwen3_next", shape, False, id=f"qwen3_next-{shape}",
                   marks=pytest.mark.slow) for shape in SHAPES],
]


@pytest.mark.parametrize("layout, shape, static", GREEDY_CASES)
def test_greedy_is_lossless_and_the_drafts_are_accepted(fitted, layout, shape, static):
    target, plain = fitted(layout)
    taus = []
    for prompt, expected in plain.items():
        result = generate(target, list(prompt), drafter=MtpDrafter(target, **SHAPES[shape]),
                          max_new_tokens=NEW_TOKENS, cuda_graphs=static)
        assert result.tokens == expected, (prompt, shape)
        taus.append(result.stats.tau)
    assert sum(taus) / len(taus) > 3.0, taus  # measured: means 3.6 to 4.6


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_a_batch_decodes_each_row_as_alone(fitted, shape):
    """A batch of the three prompts (one of a single token): each row drafts with its own fork
    of the drafter and gives plain greedy's tokens, the drafts accepted as alone."""
    target, plain = fitted("nextn")
    results = generate(target, [list(p) for p in plain], drafter=MtpDrafter(
        target, **SHAPES[shape]), max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in results] == list(plain.values())
    assert min(r.stats.tau for r in results) > 2.0


def test_a_hybrid_targets_own_module_drafts_losslessly():
    """Qwen3-Next with its `mtp` module, untrained: most drafts are rejected, and the Gated
    DeltaNet states verification restores after each must leave plain greedy unchanged."""
    target = mtp_target("mtp", seed=3, **QWEN3_NEXT)  # accepts one draft token per prompt
    for prompt in PROMPTS[:2]:
        result = generate(target, prompt, drafter=MtpDrafter(target, **SHAPES["dynamic"]),
                          max_new_tokens=12)
        assert result.tokens == generate(target, prompt, max_new_tokens=12).tokens
        assert result.stats.drafted > result.stats.accepted > 0


def test_its_cache_holds_the_pairs_the_module_reads():
    """After a generation, the drafter's cache holds module 0's keys over (h_t, token t+1) for
    every committed position, as one fresh pass of the module over the history computes."""
    target = mtp_target("nextn", seed=6)
    drafter = MtpDrafter(target, Tree.chain(3))
    out = generate(target, PROMPTS[0], drafter=drafter, max_new_tokens=9)
    committed = drafter._cache.length
    history = torch.tensor([(PROMPTS[0] + out.tokens)[: committed + 1]])
    fresh = target.new_cache(max_slots=committed)
    fresh = type(drafter._cache)(1, 1, target.config.num_kv_heads, committed,
                                 target.config.head_dim)
    with torch.no_grad():
        hidden = target(history, torch.arange(committed + 1)).last_hidden
        target.mtp_forward(0, target.embed_tokens(history[:, 1:]), hidden[:, :-1],
                           torch.arange(committed), fresh)
    assert committed > len(PROMPTS[0])
    torch.testing.assert_close(drafter._cache.k[..., :committed, :], fresh.k, atol=1e-5,
                               rtol=1e-4)


# ---- the target's law ------------------------------------------------------------------------

T1 = SamplingParams(1.0)
SAMPLED = {"total_tokens": 3, "depth": 3, "top_k": 2, "sampled_children": True}


def law_target(layout: str):
    """A target of 8 tokens whose laws are peaky (std 0.5) and an MTP module whose laws are
    too, so that a misstated draft law is seen."""
    return mtp_target(layout, seed=3, vocab=8, hidden=16, layers=1, std=0.5)


@pytest.mark.parametrize("layout, shape, params, samples", [
    # slow (~2 s alone): the sampled path is EAGLE's, whose default-run law test runs; the
    # default run checks that the module's laws are what the draft reports (below)
    pytest.param("nextn", SAMPLED, T1, FAST_LAW_SAMPLES, id="nextn-sampled-t1",
                 marks=pytest.mark.slow),
    pytest.param("mtp", SAMPLED, T1, None, id="mtp-sampled-t1", marks=pytest.mark.slow),
    pytest.param("nextn", {"tree": Tree.chain(2), "sampled_children": False}, T1, None,
                 id="nextn-chosen-chain-t1", marks=pytest.mark.slow),
    pytest.param("mtp", SAMPLED, SamplingParams(0.8, top_p=0.9), None, id="mtp-sampled-top_p",
                 marks=pytest.mark.slow),
])
def test_sampling_through_mtp_follows_the_target_law(request, layout, shape, params, samples):
    target = law_target(layout)
    assert_drafted_sampling_is_exact(target, MtpDrafter(target, **shape), params,
                                     samples or law_samples(request))


def test_sampled_drafts_report_the_modules_laws():
    """Children drawn from the module's warped law, and the draft's q says so: row d is that
    law after the root and the draft's first d tokens, recomputed from scratch (no cache), as
    the verifier's exactness needs."""
    target, params = mtp_target("nextn", seed=7), SamplingParams(0.8, top_p=0.9)
    drafter = MtpDrafter(target, Tree.chain(2))
    generate(target, PROMPTS[1], drafter=drafter, max_new_tokens=1, sampling=params,
             generator=torch.Generator().manual_seed(0))  # begin: the sampling mode
    drafter._cache.reset()
    drafter._committed = 0
    draft = drafter.propose(committed_context(target, drafter.head, PROMPTS[1]))
    assert draft.without_replacement and draft.q.shape == (2, 64)
    history, n = torch.tensor(PROMPTS[1]), len(PROMPTS[1]) - 1
    with torch.inference_mode():
        hidden = target(history[None, :-1], torch.arange(n)).last_hidden  # [1, n, h]
        embeds = target.embed_tokens(torch.cat([history[1:], draft.tokens[:1]]))[None]
        root = target.mtp_forward(0, embeds[:, :n], hidden, torch.arange(n))[:, -1:]
        out = target.mtp_forward(0, embeds, torch.cat([hidden, root], 1), torch.arange(n + 1))
        laws = logits_to_probs(target.mtp_logits(0, out[0, -2:]), params)  # [2, V]
    torch.testing.assert_close(draft.q, laws, atol=1e-6, rtol=1e-5)
    assert (laws[torch.arange(2), draft.tokens] > 0).all() and (laws == 0).any()  # top-p cut


class MisstatedLaw(MtpDrafter):
    """Planted bug: children drawn from the module's law but reported as drawn from a flatter
    one (its square root, renormalised)."""

    def propose(self, context):
        draft = super().propose(context)
        if draft.q is None:
            return draft
        flat = draft.q.sqrt()
        return dataclasses.replace(draft, q=flat / flat.sum(-1, keepdim=True))


@pytest.mark.slow  # ~2.5 s
def test_a_misstated_draft_law_is_caught():
    target = law_target("nextn")
    assert sampled_pvalue(target, MisstatedLaw(target, **SAMPLED), T1, 500) < P_VALUE_FLOOR


# ---- refusals --------------------------------------------------------------------------------


def test_a_target_without_modules_or_another_target_is_refused():
    plain = mtp_target(None, seed=1, modules=0)
    with pytest.raises(ValueError, match="the target has no MTP modules"):
        MtpDrafter(plain, Tree.chain(2))
    target = mtp_target("nextn", seed=1)
    with pytest.raises(ValueError, match="build it from the target that verifies"):
        generate(mtp_target("nextn", seed=2), [3, 4], drafter=MtpDrafter(target, Tree.chain(2)),
                 max_new_tokens=2)
    with pytest.raises(ValueError, match=r"total_tokens \(2\) < depth \(3\)"):
        MtpDrafter(target, total_tokens=2, depth=3, top_k=2)
