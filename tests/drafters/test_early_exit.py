"""The early-exit drafter (drafters/early_exit.py): lossless, exact, caches, verifying from E."""

from collections import defaultdict

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    covering,
    fit_exits,
    law_samples,
    random_exit,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, Tree, generate
from selfspec.decode import _resume_after_early_layers
from selfspec.drafters import DecodeSetup, DraftContext, EarlyExitDrafter
from selfspec.model.kv_cache import KVCache

LAYERS = 4
PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 6, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> Transformer:
    """A 4-layer toy target, so that E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


@pytest.fixture(scope="module")
def fitted_exits(target, plain_greedy):
    return fit_exits(target, plain_greedy)


# ---- lossless greedy -------------------------------------------------------------------------


@pytest.mark.parametrize("length, kind, exit_layer", covering(
    [(1, None), (3, None), (5, None), (5, 0.6)], ["norm", "adapter"], [1, 2, 3]))
def test_greedy_is_lossless_with_random_exits(target, plain_greedy, length, kind, exit_layer):
    k, threshold = length
    drafter = EarlyExitDrafter(random_exit(target, exit_layer, kind), k, threshold)
    for prompt in PROMPTS:
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert out.tokens == plain_greedy[tuple(prompt)]


@pytest.mark.parametrize("exit_layer, length, static", covering(
    [1, 2, 3], [(4, None), (6, 0.6)], [False, True]))
def test_greedy_is_lossless_and_accepted_with_trained_exits(
    target, plain_greedy, fitted_exits, exit_layer, length, static
):
    """static: the target's other forwards run as static steps (CUDA graphs on CUDA) in the
    cache the exit's drafts write into."""
    k, threshold = length
    drafter = EarlyExitDrafter(fitted_exits[0][exit_layer], k, threshold)
    accepted, drafted = 0, 0
    for prompt in PROMPTS:
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS,
                       cuda_graphs=static)
        assert out.tokens == plain_greedy[tuple(prompt)]
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert 0 < accepted < drafted  # both outcomes happened


def test_the_confidence_stop_shortens_drafts(target, fitted_exits):
    head = fitted_exits[0][2]
    sizes = {}
    for threshold in (None, 0.6, 0.999):
        out = generate(target, PROMPTS[2], drafter=EarlyExitDrafter(head, 6, threshold),
                       max_new_tokens=NEW_TOKENS)
        sizes[threshold] = out.stats.drafted / out.stats.steps
    assert sizes[None] == 6 and sizes[0.999] == 1  # stops after the first unsure token
    assert 1 <= sizes[0.6] <= 6


def test_the_target_cache_equals_a_fresh_forward_after_rejections(target, fitted_exits):
    drafter = EarlyExitDrafter(fitted_exits[0][2], 5)
    prompt = PROMPTS[3]
    out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert 0 < out.stats.accepted < out.stats.drafted
    cache, history = drafter._cache, prompt + out.tokens
    fresh = target.new_cache(max_slots=cache.length)
    with torch.no_grad():
        target(torch.tensor([history[: cache.length]]), torch.arange(cache.length), fresh)
    slots = slice(0, cache.length)
    torch.testing.assert_close(cache.k[:, :, :, slots], fresh.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :, slots], fresh.v, atol=1e-5, rtol=1e-4)
    # The adapter's own cache holds the committed context too (then the last draft's rows).
    own, committed = drafter._own_cache, drafter._committed
    assert own.length == committed + drafter._drafted and 0 < committed <= cache.length
    again = KVCache(1, 1, own.k.shape[2], committed, own.k.shape[4])
    with torch.no_grad():
        hidden = target(torch.tensor([history[:committed]]), torch.arange(committed),
                        return_hidden=(2,)).hidden[0]
        drafter.head(hidden, torch.arange(committed), again, target_norm=target.norm)
    torch.testing.assert_close(own.k[:, :, :, :committed], again.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(own.v[:, :, :, :committed], again.v, atol=1e-5, rtol=1e-4)


# ---- verification starts at layer E ----------------------------------------------------------


def count_layer_calls(target: Transformer) -> tuple[dict, list]:
    """{layer: [tokens per call]} filled by hooks on every layer; returns it and the hooks."""
    calls, hooks = defaultdict(list), []
    for i, layer in enumerate(target.layers):
        hooks.append(layer.register_forward_hook(
            lambda module, args, out, i=i: calls[i].append(args[0].shape[1])))
    return calls, hooks


@pytest.mark.parametrize("exit_layer, k", [(1, 4), (2, 3), (3, 1)])
def test_verification_runs_layers_e_to_l_over_the_draft_and_early_layers_once(
    target, exit_layer, k
):
    drafter = EarlyExitDrafter(random_exit(target, exit_layer, "norm"), k)
    prompt = PROMPTS[2]
    cache = target.new_cache(max_slots=64)
    with torch.no_grad():
        prefill = target(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1), cache)
    drafter.begin(DecodeSetup(target, torch.tensor(prompt), SamplingParams(), None, 64, cache))
    calls, hooks = count_layer_calls(target)
    try:
        draft = drafter.propose(DraftContext(torch.tensor(prompt), None))
        assert {i: calls[i] for i in range(LAYERS)} == {
            i: [1] * k if i < exit_layer else [] for i in range(LAYERS)}  # drafting
        assert cache.length == len(prompt) - 1 and draft.early.hidden.shape == (k, 32)
        calls.clear()
        rows = torch.tensor([[prompt[-1], *draft.tokens.tolist()]])  # [1, k+1]
        positions = len(prompt) - 1 + torch.arange(k + 1)
        with torch.no_grad():
            out = _resume_after_early_layers(target, rows, positions, cache,
                                             Tree.chain(k).mask_with_root, (), draft.early)
    finally:
        for hook in hooks:
            hook.remove()
    # layers [0, E) for the one token not drafted through them, [E, L) over all k + 1 rows
    assert {i: calls[i] for i in range(LAYERS)} == {
        i: [1] if i < exit_layer else [k + 1] for i in range(LAYERS)}
    full = target(torch.tensor([prompt + draft.tokens.tolist()]), torch.arange(len(prompt) + k))
    torch.testing.assert_close(out.logits[0], full.logits[0, -(k + 1):], atol=1e-5, rtol=0)
    assert prefill.logits.shape[1] == len(prompt) - 1


# ---- exact sampling --------------------------------------------------------------------------

N_SAMPLES = 1000
T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)


@pytest.mark.parametrize("params, kind, threshold", [
    pytest.param(T1, "adapter", 0.5, id="adapter-0.5-t1"),  # the default run's case
    *(pytest.param(params, kind, threshold, id=f"{kind}-{threshold}-{name}",
                   marks=pytest.mark.slow)
      for name, params in (("t1", T1), ("top_p", TOP_P))
      for kind, threshold in (("norm", None), ("adapter", None), ("adapter", 0.5))
      if (name, kind, threshold) != ("t1", "adapter", 0.5)),
])
def test_sampling_through_an_early_exit_follows_the_target_law(params, kind, threshold,
                                                                request):
    target = Transformer.from_hf(tiny_llama(3, vocab=8, layers=2, hidden=16, std=0.5))
    drafter = EarlyExitDrafter(random_exit(target, 1, kind, seed=4, std=0.1), 2, threshold)
    assert_drafted_sampling_is_exact(target, drafter, params, law_samples(request, N_SAMPLES))


# ---- errors before any generation ------------------------------------------------------------


@pytest.mark.parametrize("hidden, layers, message", [
    (48, LAYERS, "the exit head has hidden_size 32, the target 48"),
    (32, 2, r"E must be an integer in \[1, 2\).*got 3 for this 2-layer target"),
])
def test_an_exit_for_another_target_is_refused_before_generating(target, hidden, layers,
                                                                  message):
    drafter = EarlyExitDrafter(random_exit(target, 3, "adapter"), 3)
    other = Transformer.from_hf(tiny_llama(6, hidden=hidden, layers=layers))
    with pytest.raises(ValueError, match=message):
        generate(other, [3, 4], drafter=drafter, max_new_tokens=2)
