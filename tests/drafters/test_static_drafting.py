"""Drafting in static shapes (`cuda_graphs=True`: captured on CUDA, the same code eagerly on
a CPU): the same drafts as each drafter's host-side reference, the same greedy output as plain
decoding, and one host read per decode step."""

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from conftest import lm_head_copies
from helpers import (
    EAGLE3_LAYERS,
    FAST_LAW_SAMPLES,
    P_VALUE_FLOOR,
    SAMPLING_PROMPT,
    assert_drafted_sampling_is_exact,
    covering,
    eagle_head_config,
    exact_two_token_law,
    fit_eagle_head,
    fit_exits,
    fit_medusa_heads,
    fit_pvalue,
    host_reads_per_step,
    law_samples,
    random_eagle_head,
    random_exit,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, Tree, generate
from selfspec.drafters import (
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    MedusaProductDrafter,
    SmallModelDrafter,
)
from selfspec.heads import EagleConfig, draft_vocabulary
from selfspec.tree import DeviceTree, host_tree

PROMPTS = [[3], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(2, 19))]
NEW_TOKENS = 24
EAGLE = {
    "chain": {"tree": Tree.chain(4)},
    "static_tree": {"tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1],
                             [0, 0, 0, 0]]},
    "eagle2": {"total_tokens": 12, "depth": 4, "top_k": 3},
    "eagle2_narrow": {"total_tokens": 4, "depth": 4, "top_k": 1},
    "eagle2_published": {"total_tokens": 60, "depth": 6, "top_k": 10},
}


def host_side(cls):
    """The drafter class drafting as it does without static steps (its host-side growth),
    while the target still runs static steps: the reference for the static drafts."""
    class HostSide(cls):
        def begin(self, setup):
            super().begin(dataclasses.replace(setup, static_steps=False))
    return HostSide


def recorded(drafter, what=lambda draft: draft) -> list:
    """The list that `what` of every draft the drafter proposes from now on is appended to."""
    records, propose = [], drafter.propose

    def recording(context):
        draft = propose(context)
        records.append(what(draft))
        return draft
    drafter.propose = recording
    return records


def same_drafts_and_output(target, make, plain_greedy) -> list[float]:
    """Assert that static drafting (make(static=True)) proposes the host-side drafts step by
    step and that both give plain greedy's tokens; returns the static run's tau per prompt."""
    taus = []
    for prompt, expected in plain_greedy.items():
        runs = []
        for static in (True, False):
            drafter = make(static)
            drafts = recorded(drafter)
            prompt_ids = torch.tensor(prompt, device=target.embed_tokens.weight.device)
            result = generate(target, prompt_ids, drafter=drafter, max_new_tokens=NEW_TOKENS,
                              cuda_graphs=True)
            runs.append((result.tokens, drafts))
            taus.append(result.stats.tau)
        (static_tokens, static_drafts), (host_tokens, host_drafts) = runs
        assert static_tokens == expected == host_tokens, prompt
        assert ([(host_tree(d.tree).parents, d.tokens.tolist()) for d in static_drafts]
                == [(host_tree(d.tree).parents, d.tokens.tolist()) for d in host_drafts]), prompt
    return taus[::2]


@pytest.fixture(scope="module")
def fitted_eagle(target, plain_greedy):
    """EAGLE-1 and EAGLE-3 heads fit to the target's own greedy continuations: long accepted
    paths, so that every step commits several pairs."""
    v1, _ = fit_eagle_head(target, plain_greedy, version=1, steps=60)
    v3, _ = fit_eagle_head(target, plain_greedy, version=3, steps=60, draft_vocab_size=48,
                           target_layers=EAGLE3_LAYERS)
    return {1: v1, 3: v3}


@pytest.mark.parametrize("mode, version", covering(list(EAGLE), [1, 3]))
def test_static_eagle_drafts_the_host_side_trees(target, plain_greedy, fitted_eagle, version,
                                                 mode):
    taus = {}
    for name, head in (("fitted", fitted_eagle[version]), ("random", random_eagle_head(
            eagle_head_config(target, version), seed=version))):
        taus[name] = same_drafts_and_output(
            target, lambda static, head=head: (EagleDrafter if static else host_side(
                EagleDrafter))(head, **EAGLE[mode]), plain_greedy)
    assert min(taus["fitted"]) > 2.0, taus  # steps commit several pairs: the padded feed


@pytest.mark.parametrize("k, vocab, candidates", [(4, None, 1), (3, 40, 4), *(pytest.param(
    *case, marks=pytest.mark.slow) for case in ((6, None, 1), (3, 40, 1), (4, None, 3)))])
def test_a_draft_models_greedy_chain_stays_on_the_device(exit_target, k, vocab, candidates):
    """The draft model's greedy chain, each argmax fed on without a read, and its first
    token's candidates: the host-side drafts, step by step, and one host read a step."""
    model, plain, _ = exit_target  # a 4-layer target: its first 2 layers draft
    draft_vocab = None if vocab is None else draft_vocabulary(torch.arange(vocab), 64, vocab)
    make = lambda static=True: (SmallModelDrafter if static else host_side(  # noqa: E731
        SmallModelDrafter))(model.first_layers(2), k, draft_vocab=draft_vocab,
                            first_candidates=candidates)
    taus = same_drafts_and_output(model, make, plain)
    assert max(taus) > 1.2, taus  # chains accepted in part: the cache rolls back in part
    assert host_reads_per_step(model, make, PROMPTS[2]) == 1
    assert host_reads_per_step(model, lambda: make(False), PROMPTS[2]) >= k


# ---- sampled children ---------------------------------------------------------------------

SMALL_VOCAB = 8  # a target whose two-token law a thousand samples can test
SAMPLED = {
    "static_tree": {"tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
                    "sampled_children": True},
    "eagle2": {"total_tokens": 12, "depth": 4, "top_k": 3},
    "eagle2_budget": {"total_tokens": 5, "depth": 3, "top_k": 2},
    "eagle2_published": {"total_tokens": 60, "depth": 6, "top_k": 10},
}


def verified_nodes(draft) -> tuple:
    """A draft as the loop verifies it: (parents, tokens, q) of its valid nodes."""
    tree, rows = draft.tree, list(range(draft.tree.num_nodes))
    if isinstance(tree, DeviceTree):
        valid = [True] * len(rows) if tree.valid is None else tree.valid.tolist()
        tree, rows = tree.nodes_on_host(tree.parents.tolist(), valid)
    q = None if draft.q is None else draft.q[rows]
    return tree.parents, draft.tokens[rows].tolist(), q


LAWS = {"t1": SamplingParams(1.0), "t06": SamplingParams(0.6),
        "top_p": SamplingParams(0.8, top_p=0.9), "top_k": SamplingParams(1.0, top_k=5),
        "top_k2": SamplingParams(1.0, top_k=2)}  # fewer than most nodes' children


@pytest.mark.parametrize("law, mode, version", covering(list(LAWS), list(SAMPLED), [1, 3]))
def test_static_eagle_draws_the_host_side_trees(target, version, mode, law):
    """Sampled children: the same draws from the same generator, node for node, and so the
    same tokens out; the laws agree to float32 rounding (attention over every slot of a
    static cache against over the valid ones, a batch's softmax against a row's). Top-k and
    top-p cuts too: the static warping ranks without a read (`logits_to_probs(static=True)`).
    A cut law may supply fewer children than asked: the static draft keeps rows that are no
    nodes, and its verification draws for them too, so the outputs part after such a step
    (both exact); the drafts, and the generator's state after each, agree up to it."""
    head = random_eagle_head(eagle_head_config(target, version), seed=version)
    runs = []
    for cls in (EagleDrafter, host_side(EagleDrafter)):
        drafter, generator = cls(head, **SAMPLED[mode]), torch.Generator().manual_seed(version)
        drafts = recorded(drafter)
        states = recorded(drafter, lambda draft, g=generator: g.get_state())
        result = generate(target, PROMPTS[2], drafter=drafter, max_new_tokens=NEW_TOKENS,
                          cuda_graphs=True, sampling=LAWS[law], generator=generator)
        runs.append((result.tokens, drafts, states))
    (static_tokens, static_drafts, static_states), (host_tokens, host_drafts, host_states) = runs
    parted = next((i for i, d in enumerate(static_drafts) if _has_rows_not_nodes(d)), None)
    if parted is None:
        assert static_tokens == host_tokens
        assert len(static_drafts) == len(host_drafts) > 5
    if law == "top_k2" and mode != "eagle2_budget":  # its top_k is 2: no node goes missing
        assert parted == 0  # the first draft misses nodes, and is compared
    end = len(static_drafts) if parted is None else parted + 1
    for (parents, tokens, q), (host_parents, host_tokens_, host_q) in zip(
            map(verified_nodes, static_drafts[:end]), map(verified_nodes, host_drafts[:end]),
            strict=True):
        assert (parents, tokens) == (host_parents, host_tokens_)
        torch.testing.assert_close(q, host_q, rtol=1e-4, atol=1e-5)
    for state, host_state in zip(static_states[:end], host_states[:end], strict=True):
        assert torch.equal(state, host_state)  # the same uniforms drawn, missing nodes' too


def _has_rows_not_nodes(draft) -> bool:
    valid = getattr(draft.tree, "valid", None)
    return valid is not None and not bool(valid.all())


CHOSEN = {"total_tokens": 6, "depth": 3, "top_k": 2, "sampled_children": False}


def law_target() -> Transformer:
    """A target whose two-token law a thousand samples can test (two layers: a one-layer
    draft of it is close, not equal)."""
    return Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=2, hidden=16, std=0.5))


@pytest.mark.parametrize("drafter", ["draft_model", *(pytest.param(
    d, marks=pytest.mark.slow) for d in ("draft_model_candidates", "early_exit"))])
def test_sampled_chains_verified_by_draws_made_ahead_keep_the_target_law(drafter):
    """A sampled chain (q given) in static steps, or a chain whose first token has sibling
    candidates: every draw of its rejection sampling made on the device ahead
    (`verify.tree_draws`)."""
    target = law_target()
    make = {"draft_model": lambda: SmallModelDrafter(target.first_layers(1), 3),
            "draft_model_candidates": lambda: SmallModelDrafter(target.first_layers(1), 2,
                                                                first_candidates=3),
            "early_exit": lambda: EarlyExitDrafter(random_exit(target, 1, "norm"), 3)}
    samples = FAST_LAW_SAMPLES if drafter == "draft_model" else 1000  # the default run's case
    assert_drafted_sampling_is_exact(target, make[drafter](), SamplingParams(1.0), samples,
                                     cuda_graphs=True)


@pytest.mark.parametrize("drafter, law", covering(
    ["draft_model", "draft_model_candidates", "adapter_exit", "norm_exit"],
    ["t1", "top_p", "top_k"]))
def test_a_sampled_chain_draws_on_the_device_as_on_the_host(exit_target, drafter, law):
    """At T > 0 too, the device chain draws what the host chain draws (`sample_rows` both;
    a draft model's first candidates by Gumbel-top-k both), and a step reads the host
    once."""
    model, _, fitted = exit_target
    cls, args, kwargs = {
        "draft_model": (SmallModelDrafter, (model.first_layers(2), 4), {}),
        "draft_model_candidates": (SmallModelDrafter, (model.first_layers(2), 3),
                                   {"first_candidates": 3}),
        "adapter_exit": (EarlyExitDrafter, (fitted[2], 4), {}),
        "norm_exit": (EarlyExitDrafter, (random_exit(model, 3, "norm"), 3), {})}[drafter]
    make = lambda static=True: (cls if static else host_side(cls))(*args, **kwargs)  # noqa: E731
    runs = []
    for static in (True, False):
        drafter = make(static)
        drafts = recorded(drafter)
        result = generate(model, PROMPTS[2], drafter=drafter, max_new_tokens=NEW_TOKENS,
                          cuda_graphs=True, sampling=LAWS[law],
                          generator=torch.Generator().manual_seed(2))
        runs.append((result.tokens, drafts))
    (static_tokens, static_drafts), (host_tokens, host_drafts) = runs
    assert not any(map(_has_rows_not_nodes, static_drafts))  # so the two verify alike
    assert static_tokens == host_tokens
    for draft, host in zip(static_drafts, host_drafts, strict=True):
        assert draft.tokens.tolist() == host.tokens.tolist()
        assert verified_nodes(draft)[0] == verified_nodes(host)[0]
        torch.testing.assert_close(draft.q, host.q, rtol=1e-5, atol=1e-6)
    assert host_reads_per_step(model, make, PROMPTS[2], LAWS[law]) == 1


@pytest.mark.parametrize("params", [SamplingParams(1.0), pytest.param(
    SamplingParams(0.8, top_p=0.9), marks=pytest.mark.slow)], ids=["t1", "top_p"])
def test_chosen_candidates_verified_by_draws_keep_the_target_law(params, request):
    """Static steps verify chosen candidates by one draw per row (`decode._verify_step`):
    the two-token law of speculative decoding is the target's."""
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    head = random_eagle_head(EagleConfig.for_target(target.config, 1), seed=4, std=0.1)
    assert_drafted_sampling_is_exact(target, EagleDrafter(head, **CHOSEN), params,
                                     law_samples(request),
                                     cuda_graphs=True)


@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)],
                         ids=["t1", "top_p"])
def test_plain_static_steps_keep_the_target_law(params):
    """Plain decoding in static steps draws from the target's two-token law."""
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    g, counts, samples = torch.Generator().manual_seed(1), Counter(), 1000
    for _ in range(samples):
        counts[tuple(generate(target, SAMPLING_PROMPT, sampling=params, max_new_tokens=2,
                              generator=g, cuda_graphs=True).tokens)] += 1
    law = exact_two_token_law(target, SAMPLING_PROMPT, params)
    assert fit_pvalue(counts, law, samples) > P_VALUE_FLOOR


def test_a_new_generator_keeps_the_captured_draft(target):
    """Sweeps seed a generator per prompt: the draft's steps (graphs on CUDA) stay, and each
    generation's draws are its own generator's stream (the same seed, the same tokens)."""
    head = random_eagle_head(eagle_head_config(target, 1), seed=1)
    drafter, kept, outputs = EagleDrafter(head, **SAMPLED["eagle2"]), set(), []
    for seed in (0, 1, 0):
        outputs.append(generate(target, PROMPTS[2], drafter=drafter, max_new_tokens=12,
                                cuda_graphs=True, sampling=SamplingParams(1.0),
                                generator=torch.Generator().manual_seed(seed)).tokens)
        kept.add(id(drafter._static))
    assert len(kept) == 1
    assert outputs[0] == outputs[2] != outputs[1]


@pytest.mark.parametrize("kwargs", [SAMPLED["eagle2_budget"], pytest.param(
    SAMPLED["static_tree"], marks=pytest.mark.slow)], ids=["eagle2", "static_tree"])
def test_static_sampled_children_keep_the_target_law(kwargs):
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    head = random_eagle_head(EagleConfig.for_target(target.config, 1), seed=4, std=0.1)
    samples = FAST_LAW_SAMPLES if kwargs == SAMPLED["eagle2_budget"] else 1000
    assert_drafted_sampling_is_exact(target, EagleDrafter(head, **kwargs), SamplingParams(1.0),
                                     samples, cuda_graphs=True)


@pytest.mark.slow
def test_nodes_a_law_cannot_supply_are_not_verified():
    """A head so sure that its laws are one-hot in float32: each parent supplies one child,
    the rest are rows of the forward but no nodes. Verifying them (q = 0) would accept them
    always; the law test would fail."""
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    head = random_eagle_head(EagleConfig.for_target(target.config, 1), seed=4, std=0.1)
    with torch.no_grad():
        head.layers[0].mlp.down_proj.weight.mul_(1e4)  # logits far apart: softmax underflows
    drafter = EagleDrafter(head, total_tokens=5, depth=3, top_k=2)
    drafts = recorded(drafter)
    assert_drafted_sampling_is_exact(target, drafter, SamplingParams(1.0), 1000,
                                     cuda_graphs=True)
    dead = [d for d in drafts if d.tree.num_nodes and not d.tree.valid.all()]
    assert len(dead) > len(drafts) / 2


def test_a_wrong_static_draft_is_caught(target, plain_greedy, fitted_eagle, monkeypatch):
    """A planted bug: the static growth ranks a parent's children off by one."""
    import selfspec.drafters.eagle_static as static

    ranked = static.ranked_on_device
    monkeypatch.setattr(static, "ranked_on_device", lambda logits, count: ranked(
        logits, count + 1)[:, 1:])
    with pytest.raises(AssertionError):
        same_drafts_and_output(target, lambda static: (EagleDrafter if static else host_side(
            EagleDrafter))(fitted_eagle[1], **EAGLE["eagle2"]), plain_greedy)


MEDUSA = {
    "medusa_chain": (MedusaDrafter, {"tree": Tree.chain(4)}),
    "medusa_tree": (MedusaDrafter, {"tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0],
                                             [0, 0, 0, 0]]}),
    "medusa_products": (MedusaProductDrafter, {"top_k": 3, "max_nodes": 12}),
    "medusa_products_full": (MedusaProductDrafter, {"top_k": 2, "max_nodes": 64}),
}


def medusa(heads, mode: str, static: bool = True):
    cls, kwargs = MEDUSA[mode]
    return (cls if static else host_side(cls))(heads, **kwargs)


@pytest.fixture(scope="module")
def fitted_medusa(target, plain_greedy):
    heads, _ = fit_medusa_heads(target, plain_greedy)
    return heads


@pytest.mark.parametrize("mode", list(MEDUSA))
def test_static_medusa_drafts_the_host_side_trees(target, plain_greedy, fitted_medusa, mode):
    taus = {}
    for name, heads in (("fitted", fitted_medusa), ("untrained", lm_head_copies(target, 4))):
        taus[name] = same_drafts_and_output(
            target, lambda static, heads=heads: medusa(heads, mode, static), plain_greedy)
    assert min(taus["fitted"]) > 1.5, taus


@pytest.fixture(scope="module")
def exit_target():
    """A 4-layer toy target, its plain greedy answers, and adapter exits at E = 1..3 fit to
    them."""
    model = Transformer.from_hf(tiny_llama(0, layers=4))
    plain = {tuple(p): generate(model, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}
    return model, plain, fit_exits(model, plain)[0]


@pytest.mark.parametrize("kind, exit_layer, k", [  # k = 1: most steps feed the adapter a row
    ("adapter", 1, 4), ("adapter", 3, 6), ("adapter", 3, 1), ("norm", 2, 4),
    ("random_adapter", 2, 3)])
def test_static_early_exit_drafts_the_host_side_chains(exit_target, kind, exit_layer, k):
    model, plain, fitted = exit_target
    head = (fitted[exit_layer] if kind == "adapter"
            else random_exit(model, exit_layer, kind.removeprefix("random_")))
    taus = same_drafts_and_output(model, lambda static: (
        EarlyExitDrafter if static else host_side(EarlyExitDrafter))(head, k), plain)
    if kind == "adapter":
        assert sum(taus) / len(taus) > 1.4, taus  # several rows accepted


def test_a_confidence_stop_drafts_on_the_host(exit_target):
    model, plain, fitted = exit_target
    drafter = EarlyExitDrafter(fitted[2], 6, confidence_threshold=0.6)
    result = generate(model, list(PROMPTS[2]), drafter=drafter, max_new_tokens=NEW_TOKENS,
                      cuda_graphs=True)
    assert result.tokens == plain[tuple(PROMPTS[2])] and drafter._static is None


# ---- one host read per step -------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, *EAGLE, *MEDUSA])
def test_a_static_step_reads_the_host_once(target, fitted_medusa, mode):
    head = random_eagle_head(eagle_head_config(target, 3), seed=3)
    make = {None: lambda: None} | {
        name: lambda kwargs=kwargs: EagleDrafter(head, **kwargs) for name, kwargs in EAGLE.items()
    } | {name: lambda name=name: medusa(fitted_medusa, name) for name in MEDUSA}
    assert host_reads_per_step(target, make[mode], PROMPTS[2]) == 1


@pytest.mark.parametrize("kind", ["norm", "adapter"])
def test_a_static_early_exit_step_reads_the_host_once(exit_target, kind):
    model, _, fitted = exit_target
    head = fitted[2] if kind == "adapter" else random_exit(model, 2, "norm")
    assert host_reads_per_step(model, lambda: EarlyExitDrafter(head, 4), PROMPTS[2]) == 1


def test_a_captured_step_copies_nothing_from_the_host(target, fitted_medusa, exit_target,
                                                      monkeypatch):
    """What CUDA may not capture: a tensor made from host data (torch.tensor, as_tensor) is a
    copy from the host on a GPU. Every drafter's static steps run here with such calls
    refused."""
    import selfspec.step as step

    replayed = step.CapturedSteps._replayed  # what CUDA captures

    def refusing(self, name, body):
        def guarded():
            with monkeypatch.context() as inside:
                for maker in ("tensor", "as_tensor"):
                    inside.setattr(torch, maker, _refused(maker))
                return body()
        return replayed(self, name, guarded)
    monkeypatch.setattr(step.CapturedSteps, "_replayed", refusing)
    head = random_eagle_head(eagle_head_config(target, 3), seed=3)
    makers = [lambda: EagleDrafter(head, **EAGLE["static_tree"]),
              lambda: EagleDrafter(head, **EAGLE["eagle2_published"]),
              lambda: medusa(fitted_medusa, "medusa_tree"),
              lambda: medusa(fitted_medusa, "medusa_products")]
    for make in makers:
        for temperature in (0.0, 1.0):
            generate(target, PROMPTS[2], drafter=make(), max_new_tokens=8, cuda_graphs=True,
                     sampling=SamplingParams(temperature),
                     generator=torch.Generator().manual_seed(0))
    model, _, fitted = exit_target
    generate(model, PROMPTS[2], drafter=EarlyExitDrafter(fitted[3], 1), max_new_tokens=8,
             cuda_graphs=True)


def _refused(maker: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"torch.{maker} inside a captured step")
    return refuse


@pytest.mark.parametrize("mode, law", covering(
    [None, "eagle2_chosen", "medusa_tree", "medusa_products", *SAMPLED], ["t1", "top_p", "top_k"]))
def test_a_sampled_step_reads_the_host_once(target, fitted_medusa, mode, law):
    """At T > 0 chosen candidates are verified by one draw per row and sampled trees by
    every node's tests at once (`verify.tree_draws`), all made on the device, under top-k
    and top-p cuts too."""
    head = random_eagle_head(eagle_head_config(target, 1), seed=1)
    make = {None: lambda: None,
            "eagle2_chosen": lambda: EagleDrafter(head, **CHOSEN),
            "medusa_tree": lambda: medusa(fitted_medusa, "medusa_tree"),
            "medusa_products": lambda: medusa(fitted_medusa, "medusa_products")} | {
        name: lambda kwargs=kwargs: EagleDrafter(head, **kwargs) for name, kwargs in SAMPLED.items()
    }
    assert host_reads_per_step(target, make[mode], PROMPTS[2], LAWS[law]) == 1


def test_host_side_drafting_reads_the_host_more(target):
    """The count sees a drafter's reads: EAGLE-2's host-side growth reads at every level."""
    head = random_eagle_head(eagle_head_config(target, 1), seed=1)
    assert host_reads_per_step(target, lambda: host_side(EagleDrafter)(
        head, **EAGLE["eagle2"]), PROMPTS[2]) > 3


# ---- CUDA: the drafts captured ---------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["chain", "eagle2", "eagle2_published", "medusa_tree",
                                  "medusa_products", "exit"])
def test_captured_drafts_are_the_host_side_drafts_on_cuda(target, fitted_eagle, fitted_medusa,
                                                          exit_target, mode):
    model = exit_target[0] if mode == "exit" else target
    cuda = copy.deepcopy(model).to("cuda")
    if mode == "exit":
        head = copy.deepcopy(exit_target[2][2]).to("cuda")
        make = lambda static: (EarlyExitDrafter if static else host_side(EarlyExitDrafter))(  # noqa: E731
            head, 4)
    elif mode in MEDUSA:
        heads = copy.deepcopy(fitted_medusa).to("cuda")
        make = lambda static: medusa(heads, mode, static)  # noqa: E731
    else:
        head = copy.deepcopy(fitted_eagle[1]).to("cuda")
        make = lambda static: (EagleDrafter if static else host_side(EagleDrafter))(  # noqa: E731
            head, **EAGLE[mode])
    plain = {tuple(p): generate(cuda, torch.tensor(p, device="cuda"), max_new_tokens=NEW_TOKENS,
                                cuda_graphs=True).tokens for p in PROMPTS}
    taus = same_drafts_and_output(cuda, make, plain)
    assert max(taus) > 1.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafter, law", [("eagle_static_tree", "t1"), ("eagle2", "t1"),
                                          ("draft_model_candidates", "top_p"),
                                          ("early_exit", "top_k")])
def test_captured_sampled_drafts_keep_the_target_law_on_cuda(drafter, law):
    """Sampled drafts captured on CUDA. There their draws are not the host-side drafts'
    (CUDA's Philox generator gives one draw of R x V uniforms other numbers than R draws of
    V), so the check is the target's law, and one host read a step."""
    assert_captured_sampling_is_exact("cuda", drafter, law)


def assert_captured_sampling_is_exact(device: str, drafter: str, law: str) -> None:
    target = law_target().to(device)
    head = random_eagle_head(EagleConfig.for_target(target.config, 1), seed=4, std=0.1)
    head = head.to(device)
    make = {"eagle_static_tree": lambda: EagleDrafter(head, **SAMPLED["static_tree"]),
            "eagle2": lambda: EagleDrafter(head, **SAMPLED["eagle2_budget"]),
            "draft_model_candidates": lambda: SmallModelDrafter(target.first_layers(1), 2,
                                                                first_candidates=3),
            "early_exit": lambda: EarlyExitDrafter(random_exit(target, 1, "norm").to(device),
                                                   3)}[drafter]
    assert_drafted_sampling_is_exact(target, make(), LAWS[law], 1000, cuda_graphs=True)
    assert host_reads_per_step(target, make, SAMPLING_PROMPT, LAWS[law]) == 1
