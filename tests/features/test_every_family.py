"""Every drafter on every family of target: a small random Llama, Qwen3 (q/k norms, head_dim
apart from hidden / heads) and Gemma 3 (four norms a layer, scaled embeddings, a window of
WINDOW tokens on its even layers, shorter than every sequence decoded here), and at greedy
Gemma 2, OLMo 2, Granite and Phi-3 too; and the mixtures of experts Qwen3-MoE (a dense layer
among sparse ones), Mixtral (a window on every layer) and gpt-oss (attention sinks, windows
alternating with full layers, clamped experts), whose static steps route through the static
dispatch; and DeepSeek-V3 (latent attention, grouped sigmoid routing, shared experts) and
Llama 4 (chunked attention, NoPE layers, input-weighted experts) at greedy. Greedy decoding
through each drafter equals plain greedy decoding, one prompt and a batch, eagerly and in
static steps; sampling at T = 1 keeps the target's law; the quantized target decodes as the
plain one (a MoE target has no quantized copy: refused).

One lossless case per family runs by default; the sweeps over every drafter are `slow`."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    FAMILIES,
    FAMILY_PROMPTS,
    MOE_FAMILIES,
    MORE_FAMILIES,
    SAMPLING_PROMPT,
    assert_drafted_sampling_is_exact,
    family_model,
    fit_eagle_head,
    fit_medusa_heads,
    host_reads_per_step,
    lookup_of_its_answer,
    random_eagle_head,
    random_exit,
    random_medusa_heads,
    seeded_lookahead,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import (
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
)
from selfspec.drafters.layer_skip import LayerSkipDrafter
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.heads import EagleConfig, MedusaConfig
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.model.cpu_linear import INVARIANT_BLOCK_ROWS, use_invariant_products
from selfspec.model.quantized import quantized_copy

PROMPTS = FAMILY_PROMPTS
NEW_TOKENS = 16
MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def drafter_of(name: str, target: Transformer):
    """A fresh drafter of kind `name` for the target (random heads: the loop must be exact
    whatever they draft)."""
    c, v = target.config, target.config.vocab_size
    half = draft_vocabulary(torch.arange(0, v, 2), v, v // 2)
    makers = {
        "small_model": lambda: SmallModelDrafter(target.first_layers(1), 3),
        "small_model_tree": lambda: SmallModelDrafter(target.first_layers(1), 3,
                                                      first_candidates=2),
        "small_model_vocab": lambda: SmallModelDrafter(target.first_layers(1), 3,
                                                       draft_vocab=half),
        "ngram": lambda: NgramDrafter(3),
        "medusa": lambda: MedusaDrafter(random_medusa_heads(
            MedusaConfig(c.hidden_size, v, num_heads=3), seed=3), MEDUSA_TREE),
        "eagle1_tree": lambda: EagleDrafter(random_eagle_head(
            EagleConfig.for_target(c, 1), seed=4, std=0.1), [[0], [1], [0, 0], [0, 0, 0]]),
        "eagle2": lambda: EagleDrafter(random_eagle_head(
            EagleConfig.for_target(c, 1), seed=4, std=0.1), total_tokens=6, depth=3, top_k=2,
            sampled_children=False),
        "eagle3": lambda: EagleDrafter(random_eagle_head(
            EagleConfig.for_target(c, 3, draft_vocab_size=v // 2, target_layers=(1, 2, 4)),
            seed=5, std=0.1), total_tokens=6, depth=3, top_k=2),
        "early_exit": lambda: EarlyExitDrafter(random_exit(target, 2, "norm"), 3),
        "early_exit_adapter": lambda: EarlyExitDrafter(random_exit(target, 2, "adapter"), 3),
        "layer_skip": lambda: LayerSkipDrafter((1, 2), 3),
        "lookahead": lambda: LookaheadDrafter(window=3, ngram=3, candidates=2),
        "quantized": lambda: SmallModelDrafter(quantized_copy(target, 8), 3),
        "union": lambda: UnionDrafter([NgramDrafter(3), SmallModelDrafter(
            target.first_layers(1), 3, first_candidates=2)]),
    }
    return makers[name]()


DRAFTERS = ("small_model", "small_model_tree", "small_model_vocab", "ngram", "medusa",
            "eagle1_tree", "eagle2", "eagle3", "early_exit", "early_exit_adapter", "layer_skip",
            "lookahead", "quantized", "union")
BATCHED = ("small_model", "ngram", "medusa", "eagle2", "eagle3", "layer_skip", "union")


def plain(target: Transformer) -> dict:
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


def assert_lossless(target: Transformer, make, batch: bool = False,
                    cuda_graphs: bool | None = None) -> None:
    """Greedy decoding through make() equals plain greedy decoding and drafts: each prompt
    alone (in static steps with cuda_graphs=True) or (batch) all together."""
    expected = plain(target)
    if batch:
        results = generate(target, PROMPTS, drafter=make(), max_new_tokens=NEW_TOKENS)
        assert [r.tokens for r in results] == list(expected.values())
        assert sum(r.stats.drafted for r in results) > 0
        return
    for prompt, tokens in expected.items():
        result = generate(target, list(prompt), drafter=make(), max_new_tokens=NEW_TOKENS,
                          cuda_graphs=cuda_graphs)
        assert result.tokens == tokens
        assert result.stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_losslessly_through_a_union_tree(family):
    """The default run's case per family: a tree of a lookup and a draft model with sibling
    candidates, each prompt alone and in static steps, and the two as a batch."""
    target = family_model(family)
    if family != "llama":
        assert target.config.model_type in ("qwen3", "gemma3_text")
    if family == "gemma3":
        assert target.config.sliding_layers and target.config.sliding_window < len(PROMPTS[1])
    assert_lossless(target, lambda: drafter_of("union", target))
    assert_lossless(target, lambda: drafter_of("union", target), cuda_graphs=True)
    assert_lossless(target, lambda: drafter_of("union", target), batch=True)


MOE_DRAFTERS = tuple(name for name in DRAFTERS if name != "quantized")  # refused on a MoE


def drafter_family_pairs(families: tuple[str, ...]) -> list[tuple[str, str]]:
    """(family, drafter) for every drafter on the families, and those a MoE target takes
    on the MoE families."""
    return ([(family, name) for family in families for name in DRAFTERS]
            + [(family, name) for family in MOE_FAMILIES for name in MOE_DRAFTERS])


def test_a_moe_family_decodes_losslessly_through_a_union_tree():
    """The default run's MoE case: gpt-oss (sinks, a window on alternate layers, experts with
    biases), each prompt alone, in static steps, and as a batch."""
    target = family_model("gpt_oss")
    assert target.config.moe_layers and target.config.attention_sinks
    assert_lossless(target, lambda: drafter_of("union", target))
    assert_lossless(target, lambda: drafter_of("union", target), cuda_graphs=True)
    assert_lossless(target, lambda: drafter_of("union", target), batch=True)


# Mixtures of experts with attention of their own: DeepSeek-V3's latent attention (MLA, a
# latent cache), Llama 4's chunked and RoPE-less layers (a tree past a chunk's end); their
# routing and shared experts every drafter's forwards pass through
NEWER_MOE_FAMILIES = ("deepseek_v3", "llama4")


@pytest.mark.parametrize("family", [pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                    "llama4"])  # DeepSeek's NextN drafts it by default
def test_a_newer_moe_family_decodes_losslessly_through_a_union_tree(family):
    """The default run's case: each prompt alone, eagerly (static steps and batches: the
    sweep below)."""
    target = family_model(family)
    assert target.config.moe_layers
    assert_lossless(target, lambda: drafter_of("union", target))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "name"), [(family, name) for family in NEWER_MOE_FAMILIES
                                              for name in MOE_DRAFTERS])
def test_every_drafter_is_lossless_on_the_newer_moe_families(family, name):
    """Each prompt alone, eagerly and in static steps, and for the drafters a batch drafts,
    both prompts as a batch (each row's latent written at its own slots)."""
    target = family_model(family)
    assert_lossless(target, lambda: drafter_of(name, target))
    assert_lossless(target, lambda: drafter_of(name, target), cuda_graphs=True)
    if name in BATCHED:
        assert_lossless(target, lambda: drafter_of(name, target), batch=True)


@pytest.mark.parametrize("name", ["plain", "eagle2", "early_exit"])
def test_a_moe_familys_static_step_reads_the_host_once(name):
    """Qwen3-MoE in static steps: its experts dispatched in fixed shapes, the verification
    and the early exit's captured draft (the target's first layers) read the device back
    once a step."""
    target = family_model("qwen3_moe")
    make = (lambda: None) if name == "plain" else (lambda: drafter_of(name, target))
    assert host_reads_per_step(target, make, PROMPTS[0]) == 1


@pytest.mark.parametrize("name", ["plain", "eagle2", "early_exit"])
def test_a_sliding_familys_static_step_reads_the_host_once(name):
    """Gemma 3 in static steps: the window's mask is built on the device, so a greedy step
    (its static draft included) still reads the device back once."""
    target = family_model("gemma3")
    make = (lambda: None) if name == "plain" else (lambda: drafter_of(name, target))
    assert host_reads_per_step(target, make, PROMPTS[0]) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("family", "name"), drafter_family_pairs(FAMILIES + MORE_FAMILIES))
def test_every_drafter_is_lossless_on_every_family(family, name):
    """Each prompt alone, eagerly and in static steps (the drafters' static drafts
    included), and, for the drafters a batch drafts, both prompts as a batch."""
    target = family_model(family)
    assert_lossless(target, lambda: drafter_of(name, target))
    assert_lossless(target, lambda: drafter_of(name, target), cuda_graphs=True)
    if name in BATCHED:
        assert_lossless(target, lambda: drafter_of(name, target), batch=True)


def exact_bf16(family: str) -> Transformer:
    """The family's target in bf16 in the exact mode (`batch_invariant=true`)."""
    target = copy.deepcopy(family_model(family)).to(torch.bfloat16)
    use_invariant_products(target, INVARIANT_BLOCK_ROWS)
    return target


# quick: a tree of drafters, and EAGLE-3's fp32 head on a bf16 target; slow: every drafter on
# a windowed family and a MoE
EXACT_BF16_PAIRS = [("llama", "union"), ("llama", "eagle3")] + [
    pytest.param(family, name, marks=pytest.mark.slow)
    for family, names in (("gemma3", DRAFTERS), ("qwen3_moe", MOE_DRAFTERS)) for name in names]


@pytest.mark.parametrize(("family", "name"), EXACT_BF16_PAIRS)
def test_every_drafter_is_lossless_in_bf16_in_the_exact_mode(family, name):
    """A bf16 target (its heads and draft model kept in fp32) in the exact mode: each prompt
    alone, eagerly and in static steps, and as a batch for the drafters a batch drafts."""
    target = exact_bf16(family)
    assert_lossless(target, lambda: drafter_of(name, target))
    assert_lossless(target, lambda: drafter_of(name, target), cuda_graphs=True)
    if name in BATCHED:
        assert_lossless(target, lambda: drafter_of(name, target), batch=True)


SMALL_VOCAB = 8  # the exact two-token law is 64 cells; drafts get accepted often


def sampling_drafter_of(name: str, target: Transformer):
    """drafter_of, but with its first draft in play after the law test's prompt where it
    would not be: lookup with the target's answer in its corpus, Lookahead with a seeded
    pool; a union of chosen drafts (a sampled draft is not merged)."""
    if name == "ngram":
        return lookup_of_its_answer(target, num_draft_tokens=3, max_nodes=6)
    if name == "lookahead":
        return seeded_lookahead(target, window=3, ngram=3, candidates=3)
    if target.config.moe_layers and name in FITTED_ON_A_MOE:
        return fitted_drafter_of(name, target)
    if name == "union":
        return UnionDrafter([lookup_of_its_answer(target, num_draft_tokens=3),
                             drafter_of("medusa", target)])
    return drafter_of(name, target)


# Random heads and a draft vocabulary of even ids draft out of play at T = 1 on the tiny MoE
# targets (both law tokens from one step in 1-46 of 600 runs, where the test asks for 60): the
# law would test the verifier alone. There they are fit to the target's sampled answers first.
FITTED_ON_A_MOE = ("medusa", "eagle2", "eagle3", "union", "small_model_vocab")
WIDE_MEDUSA_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]


def fitted_drafter_of(name: str, target: Transformer):
    """drafter_of's drafter, its heads fit (AdamW) to 64 of the target's sampled answers
    after SAMPLING_PROMPT, or its draft vocabulary their most frequent tokens."""
    g = torch.Generator().manual_seed(1)
    answers = [generate(target, SAMPLING_PROMPT, sampling=SamplingParams(1.0), max_new_tokens=4,
                        generator=g).tokens for _ in range(64)]
    continuations = {tuple(SAMPLING_PROMPT + answer[:1]): answer[1:] for answer in answers}
    v = target.config.vocab_size
    if name == "small_model_vocab":
        frequent = draft_vocabulary(torch.tensor(sum(answers, [])), v, v // 2)
        return SmallModelDrafter(target.first_layers(2), 3, draft_vocab=frequent)
    if name == "eagle2":
        head, _ = fit_eagle_head(target, continuations, 1)
        return EagleDrafter(head, total_tokens=6, depth=3, top_k=2, sampled_children=False)
    if name == "eagle3":
        head, _ = fit_eagle_head(target, continuations, 3, draft_vocab_size=v // 2,
                                 target_layers=(1, 2, 4))
        return EagleDrafter(head, total_tokens=6, depth=3, top_k=2)
    medusa = MedusaDrafter(fit_medusa_heads(target, continuations, num_heads=3, steps=100)[0],
                           WIDE_MEDUSA_TREE)
    if name == "union":
        return UnionDrafter([lookup_of_its_answer(target, num_draft_tokens=3), medusa])
    return medusa


@pytest.mark.slow
@pytest.mark.parametrize(("family", "name"), drafter_family_pairs(FAMILIES))
def test_every_drafter_keeps_the_law_of_every_family_at_t1(family, name):
    target = family_model(family, vocab=SMALL_VOCAB, hidden=16, std=0.5)
    assert_drafted_sampling_is_exact(target, sampling_drafter_of(name, target),
                                     SamplingParams(1.0), samples=600)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEWER_MOE_FAMILIES)
@pytest.mark.parametrize("name", ["ngram", "small_model_tree", "union"])
def test_a_chain_and_trees_keep_the_law_of_the_newer_moe_families_at_t1(family, name):
    """A lookup's chain of the target's own answer, a draft model's tree of sibling
    candidates and a union with fitted Medusa heads: the two-token law at T = 1 is the
    target's (DeepSeek-V3's latent cache and Llama 4's chunks under rejections)."""
    target = family_model(family, vocab=SMALL_VOCAB, hidden=16, std=0.5)
    assert_drafted_sampling_is_exact(target, sampling_drafter_of(name, target),
                                     SamplingParams(1.0), samples=600)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_quantized_copy_of_every_family_is_a_target_too(family):
    """The int8 copy verifies (drafters built for the full-precision target it copies)."""
    target = quantized_copy(family_model(family), 8)
    for name in ("small_model", "eagle2", "early_exit"):
        assert_lossless(target, lambda name=name: drafter_of(name, family_model(family)))
