"""A batch of prompts through `generate` (`selfspec.decode`): every row's output is what that
prompt gives decoded alone, under every drafter, at greedy token for token and when sampling
in law; each row's cache stays the recomputation of its committed tokens; bad batches are
clear errors; a planted cross-row bug is caught."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import (
    covering,
    eagle_head_config,
    exact_two_token_law,
    first_layers,
    fit_pvalue,
    random_eagle_head,
    random_exit,
    random_medusa_heads,
    tiny_llama,
    tiny_model,
)

import selfspec.decode
import selfspec.step
from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import (
    EagleDrafter,
    EarlyExitDrafter,
    LookupCorpus,
    MedusaDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
)
from selfspec.drafters.base import BatchDrafter, fork
from selfspec.drafters.layer_skip import LayerSkipDrafter
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.heads import MedusaConfig
from selfspec.measure.oracle import OracleDrafter
from selfspec.model.kv_cache import RowSlots

LAYERS = 4
# Mixed lengths, a one-token prompt, and repeats that lookup drafts from.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9, 4, 17, 5, 3, 9, 4], [11],
           [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [20, 21, 22, 23, 24]]
NEW_TOKENS = 20
STATIC_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0, layers=LAYERS)


@pytest.fixture(scope="module")
def target(hf_target) -> Transformer:
    return Transformer.from_hf(hf_target)


@pytest.fixture(scope="module")
def drafters(hf_target, target) -> dict:
    """Each drafter kind, made anew per call, at draft length k."""
    draft_model = Transformer.from_hf(first_layers(hf_target, 1))
    medusa = random_medusa_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3), seed=1)
    eagle = {v: random_eagle_head(eagle_head_config(target, v), seed=2) for v in (1, 3)}
    corpus = LookupCorpus([generate(target, p, max_new_tokens=NEW_TOKENS).tokens
                           for p in PROMPTS[:2]])
    return {
        "ngram": lambda k: NgramDrafter(num_draft_tokens=k, max_ngram=3),
        "ngram corpus": lambda k: NgramDrafter(num_draft_tokens=k, max_ngram=3, corpus=corpus),
        "draft model": lambda k: SmallModelDrafter(draft_model, k),
        "medusa static tree": lambda k: MedusaDrafter(
            medusa, [p for p in STATIC_TREE if len(p) <= min(k, 3)]),
        "eagle-1 static tree": lambda k: EagleDrafter(
            eagle[1], [p for p in STATIC_TREE if len(p) <= k]),
        "eagle-2 dynamic tree": lambda k: EagleDrafter(eagle[1], total_tokens=k + 2, depth=k,
                                                       top_k=2),
        "eagle-3 chain": lambda k: EagleDrafter(eagle[3], total_tokens=k, depth=k, top_k=1),
        "early exit": lambda k: EarlyExitDrafter(random_exit(target, 2, "adapter"), k, None),
        "layer skip": lambda k: LayerSkipDrafter((1,), k),
        "lookahead": lambda k: LookaheadDrafter(window=3, ngram=3, candidates=2),
        "union": lambda k: UnionDrafter([NgramDrafter(num_draft_tokens=k, max_ngram=3),
                                         SmallModelDrafter(draft_model, k)]),
        "oracle": lambda k: OracleDrafter(k),
    }


@pytest.fixture(scope="module")
def alone(target) -> dict:
    """Each prompt's plain greedy output, decoded alone."""
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


KINDS = ["ngram", "ngram corpus", "draft model", "medusa static tree", "eagle-1 static tree",
         "eagle-2 dynamic tree", "eagle-3 chain", "early exit", "layer skip", "lookahead",
         "union", "oracle"]


@pytest.mark.parametrize("kind, shape", covering(KINDS, [(2, 1), (3, 3), (5, 6)]))
def test_every_drafters_batched_greedy_output_is_each_prompts_own(target, drafters, alone,
                                                                  kind, shape):
    rows, k = shape
    prompts = PROMPTS[:rows]
    results = generate(target, prompts, drafter=drafters[kind](k), max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in results] == [alone[tuple(p)] for p in prompts]
    assert sum(r.stats.drafted for r in results) > 0 or kind == "lookahead"


def stopping_early(alone: dict) -> tuple[int, list[list[int]]]:
    """A stop token that ends some rows early, not all at the same step, and each prompt's
    output cut there."""
    eos = alone[tuple(PROMPTS[0])][6]
    expected = []
    for prompt in PROMPTS:
        tokens = alone[tuple(prompt)]
        expected.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
    assert len({len(e) for e in expected}) > 1
    return eos, expected


def test_rows_stop_at_their_own_eos_and_the_others_go_on(target, drafters, alone):
    eos, expected = stopping_early(alone)
    for kind in ("ngram", "draft model", "eagle-2 dynamic tree", "early exit"):
        results = generate(target, PROMPTS, drafter=drafters[kind](3),
                           max_new_tokens=NEW_TOKENS, eos_token_id=eos)
        assert [r.tokens for r in results] == expected, kind
        assert [r.stats.new_tokens for r in results] == [len(e) for e in expected]


@pytest.mark.parametrize("kind", ["ngram", "medusa static tree", "eagle-2 dynamic tree",
                                  "early exit", "lookahead"])
def test_a_batch_in_static_steps_gives_each_prompts_own_output(target, drafters, alone, kind):
    """cuda_graphs=True: the batch's verification forwards run as static steps per bucket of
    (rows, T) over one persistent cache (replayed CUDA graphs on CUDA; here the same step,
    eagerly), as rows stop and the others move up; early-exit drafts stay eager."""
    eos, expected = stopping_early(alone)
    selfspec.step._STEPS.pop(target, None)
    results = generate(target, PROMPTS, drafter=drafters[kind](3), max_new_tokens=NEW_TOKENS,
                       eos_token_id=eos, cuda_graphs=True)
    assert [r.tokens for r in results] == expected
    steps = selfspec.step._STEPS[target][len(PROMPTS)]
    rows_run = {key[1] for key in steps._buckets if key[0] == "rows"}
    if kind == "early exit":
        assert rows_run == set()
    else:  # all rows, then fewer as rows stopped
        assert len(PROMPTS) in rows_run and len(rows_run) > 1


def test_a_batch_of_one_is_one_prompt(target, drafters, alone):
    [result] = generate(target, [PROMPTS[1]], drafter=drafters["ngram"](3),
                        max_new_tokens=NEW_TOKENS)
    single = generate(target, PROMPTS[1], drafter=drafters["ngram"](3), max_new_tokens=NEW_TOKENS)
    assert result.tokens == single.tokens == alone[tuple(PROMPTS[1])]
    assert result.stats.steps == single.stats.steps


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), pytest.param(
    SamplingParams(temperature=1.0, top_p=0.8), marks=pytest.mark.slow)])
def test_each_rows_two_token_law_is_the_targets_whatever_the_other_rows(target, drafters,
                                                                       params):
    """The prompt's first two tokens, drawn in batches where each of its copies sits beside
    another prompt, follow the target's exact two-token law (chi-square, p > 0.001), for a
    draft model's sampled drafts: each copy is a sample, whatever its row and company."""
    prompt, beside, pairs = PROMPTS[0], PROMPTS[3], 20
    law = exact_two_token_law(target, prompt, params)
    generator = torch.Generator().manual_seed(0)
    drafter = drafters["draft model"](2)
    counts: Counter = Counter()
    for _ in range(60):
        results = generate(target, [prompt, beside] * pairs, drafter=drafter, sampling=params,
                           max_new_tokens=2, generator=generator)
        counts.update(tuple(r.tokens) for r in results[::2])
    assert fit_pvalue(counts, law, sum(counts.values())) > 1e-3


class CacheProbe:
    """Wraps a drafter; at every proposal checks that its row's target cache holds exactly the
    K/V of a fresh forward over the row's committed tokens (all but the root)."""

    def __init__(self, inner, target):
        self.inner, self.target, self.checked = inner, target, 0
        self.max_nodes, self.target_layers = inner.max_nodes, inner.target_layers

    def begin(self, setup):
        self.cache = setup.target_cache
        self.inner.begin(setup)

    def propose(self, context):
        committed = context.tokens[:-1]
        if len(committed) == 0:  # a one-token prompt's first step: nothing cached yet
            assert self.cache.length == 0
            return self.inner.propose(context)
        fresh = self.target.new_cache(max_slots=len(committed))
        self.target(committed[None], torch.arange(len(committed)), fresh)
        n = self.cache.length
        assert n == len(committed)
        torch.testing.assert_close(self.cache.k[:, :, :, :n], fresh.k, atol=1e-5, rtol=0)
        torch.testing.assert_close(self.cache.v[:, :, :, :n], fresh.v, atol=1e-5, rtol=0)
        self.checked += 1
        return self.inner.propose(context)


@pytest.mark.parametrize("kind", ["ngram", "medusa static tree", "eagle-2 dynamic tree",
                                  "early exit"])
def test_each_rows_cache_is_the_recomputation_of_its_committed_tokens(target, drafters,
                                                                      alone, kind):
    """Checked at every step of every row, also after rows that stopped early left the
    batch and the others moved up in the cache."""
    eos, expected = stopping_early(alone)
    probe = CacheProbe(drafters[kind](3), target)
    results = generate(target, PROMPTS, drafter=probe, max_new_tokens=NEW_TOKENS,
                       eos_token_id=eos)
    assert [r.tokens for r in results] == expected
    assert probe.checked > 0  # the probe of row 0; its forks checked the other rows


class RowsTogether:
    """A `BatchDrafter` made of another drafter: a fork of it per row of the batch, each
    drafting its row; records the rows it is asked to draft."""

    def __init__(self, inner):
        self.inner, self.max_nodes, self.target_layers = inner, inner.max_nodes, inner.target_layers
        self.asked: list[tuple[int, ...]] = []

    def begin(self, setup):
        raise AssertionError("a batch drafter is begun with begin_rows in a batch")

    def propose(self, context):
        raise AssertionError("a batch drafter drafts with propose_rows in a batch")

    def begin_rows(self, setups):
        self.rows = [fork(self.inner) for _ in setups]
        for drafter, setup in zip(self.rows, setups, strict=True):
            drafter.begin(setup)

    def propose_rows(self, rows, contexts):
        self.asked.append(tuple(rows))
        return [self.rows[b].propose(c) for b, c in zip(rows, contexts, strict=True)]


def test_a_batch_drafter_is_given_every_unfinished_row_by_its_index(target, drafters, alone):
    """Each row's early exit drafts in that row's cache: a row given another's index would
    draft from the wrong context."""
    eos, expected = stopping_early(alone)
    drafter = RowsTogether(drafters["early exit"](3))
    assert isinstance(drafter, BatchDrafter)
    results = generate(target, PROMPTS, drafter=drafter, max_new_tokens=NEW_TOKENS,
                       eos_token_id=eos)
    assert [r.tokens for r in results] == expected
    assert drafter.asked[0] == tuple(range(len(PROMPTS)))
    finished = [b for b, e in enumerate(expected) if len(e) < NEW_TOKENS]
    assert finished and not set(finished) & set(drafter.asked[-1])


def test_bad_batches_are_one_clear_line(target):
    with pytest.raises(ValueError, match=r"the prompt \(prompt 1\) is empty"):
        generate(target, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompts lie on different devices \(cpu, meta\)"):
        generate(target, [torch.tensor([1, 2]), torch.tensor([3], device="meta")],
                 max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt ids \(prompt 0\) must lie in \[0, 64\)"):
        generate(target, [[99], [3]], max_new_tokens=4)


def test_a_planted_bug_rows_written_at_another_rows_slots_is_caught(monkeypatch, target, alone):
    class SameSlots(RowSlots):  # every row's new K/V at row 0's length
        def __init__(self, cache, lengths, t):
            super().__init__(cache, [lengths[0]] * len(lengths), t)

    monkeypatch.setattr(selfspec.decode, "RowSlots", SameSlots)
    results = generate(target, PROMPTS[:3], max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in results] != [alone[tuple(p)] for p in PROMPTS[:3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_batch_on_cuda_replays_its_graphs_and_gives_each_prompts_own_output(hf_target):
    target = Transformer.from_hf(hf_target, device="cuda")
    alone_cuda = [generate(target, p, max_new_tokens=NEW_TOKENS, cuda_graphs=False).tokens
                  for p in PROMPTS]
    for drafter in (None, NgramDrafter(num_draft_tokens=3, max_ngram=3)):
        results = generate(target, PROMPTS, drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert [r.tokens for r in results] == alone_cuda
    steps = selfspec.step._STEPS[target][len(PROMPTS)]
    assert any(bucket.graph is not None for bucket in steps._buckets.values())


def test_a_draft_model_drafts_every_row_in_one_forward_per_token(hf_target, target, alone):
    """propose_rows: a step of a batch costs the draft model k forwards over all the rows (the
    first catches each row up), not k per row; the drafts are each row's own."""
    draft_model = Transformer.from_hf(first_layers(hf_target, 1))
    calls = []
    hook = draft_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        results = generate(target, PROMPTS, drafter=SmallModelDrafter(draft_model, 3),
                           max_new_tokens=NEW_TOKENS)
    finally:
        hook.remove()
    assert [r.tokens for r in results] == [alone[tuple(p)] for p in PROMPTS]
    assert len(calls) == 3 * results[0].stats.loop_steps < 3 * sum(r.stats.steps
                                                                   for r in results)


def test_a_batch_fills_its_prompts_in_one_forward_with_the_states_each_gets_alone(target):
    """The batch's prefill: one forward over every row's context (the prompt but its last
    token) padded to the longest; each row's features and cached K/V as its own prefill's."""
    shapes = []
    hook = target.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    try:
        generate(target, PROMPTS, max_new_tokens=1)
    finally:
        hook.remove()
    assert shapes[0] == (len(PROMPTS), max(map(len, PROMPTS)) - 1)  # then the first step
    contexts = [torch.tensor(p[:-1]) for p in PROMPTS]
    layers = (1, 3)
    batch = target.new_cache(batch_size=len(PROMPTS), max_slots=32)
    together = selfspec.decode._prefill_together(target, contexts, batch, layers)
    assert together[2] is None  # the one-token prompt has no context
    for b, (context, found) in enumerate(zip(contexts, together, strict=True)):
        if not len(context):
            continue
        alone = target.new_cache(batch_size=1, max_slots=32)
        own = selfspec.decode._prefill(target, context, alone, layers)
        n = len(context)
        assert alone.length == n and torch.equal(found.tokens, context)
        torch.testing.assert_close(found.last_hidden, own.last_hidden, rtol=0, atol=1e-5)
        for got, want in zip(found.hidden, own.hidden, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(batch.k[:, b, :, :n], alone.k[:, 0, :, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(batch.v[:, b, :, :n], alone.v[:, 0, :, :n], rtol=0, atol=1e-5)


def test_a_prefill_leaves_the_lm_head_out_and_keeps_the_normed_states(target):
    """A prefill's logits are never read: its forward skips the LM head, and its last
    hidden states are the final norm's output that the LM head would read."""
    context = torch.tensor(PROMPTS[0][:-1])
    calls = []
    hook = target.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        features = selfspec.decode._prefill(target, context,
                                            target.new_cache(batch_size=1, max_slots=32), ())
    finally:
        hook.remove()
    assert not calls
    full = target(context[None], torch.arange(len(context)))
    assert torch.equal(features.last_hidden, full.last_hidden[0])


def test_a_batch_of_a_windowed_target_fills_its_prompts_one_row_at_a_time():
    """Padding would pass a sliding window's mask and a recurrent layer's state: such
    targets keep a forward a row."""
    windowed = Transformer.from_hf(tiny_model("gemma3", 0))
    assert not selfspec.decode._prefills_together(windowed, windowed.new_cache(2, 16))
    plain = Transformer.from_hf(tiny_llama(0))
    assert selfspec.decode._prefills_together(plain, plain.new_cache(2, 16))
