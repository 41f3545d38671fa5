"""The forward with skip_layers (layer-skip drafting): no layer skipped is the plain forward,
logits and cache; a skipped layer passes the residual stream on and writes no K/V, giving the
logits of the model with those layers removed; bad layer ids are refused."""

import copy

import pytest
import torch
from helpers import tiny_llama

from selfspec import Transformer

LAYERS = 4
TOKENS, POSITIONS = torch.tensor([[3, 9, 4, 7, 11]]), torch.arange(5)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(0, layers=LAYERS)


@pytest.fixture(scope="module")
def target(hf_model) -> Transformer:
    return Transformer.from_hf(hf_model)


def without_layers(hf_model, skip: set[int]) -> Transformer:
    """The reference: the same weights with the skipped layers removed from the model."""
    pruned = copy.deepcopy(hf_model)
    kept = [layer for i, layer in enumerate(pruned.model.layers) if i not in skip]
    pruned.model.layers = torch.nn.ModuleList(kept)
    pruned.config.num_hidden_layers = len(kept)
    return Transformer.from_hf(pruned)


def forward_with_cache(model: Transformer, **options):
    """The logits of a forward over a short prefix then TOKENS, and the cache it wrote."""
    cache = model.new_cache(max_slots=16)
    with torch.inference_mode():
        model(torch.tensor([[5, 6]]), torch.arange(2), cache, **options)
        out = model(TOKENS, POSITIONS + 2, cache, **options)
    return out, cache


@pytest.mark.parametrize("nothing", [(), frozenset()], ids=["tuple", "frozenset"])
def test_skipping_no_layer_is_the_plain_forward(target, nothing):
    plain, plain_cache = forward_with_cache(target)
    out, cache = forward_with_cache(target, skip_layers=nothing)
    assert torch.equal(out.logits, plain.logits)
    assert cache.length == plain_cache.length == 7
    assert torch.equal(cache.k, plain_cache.k) and torch.equal(cache.v, plain_cache.v)


@pytest.mark.parametrize("skip", [{1}, {0, 3}, {1, 2}, {0, 1, 2, 3}], ids=str)
def test_skipped_layers_do_not_run_and_write_no_kv(hf_model, target, skip):
    out, cache = forward_with_cache(target, skip_layers=tuple(skip))
    reference, reference_cache = forward_with_cache(without_layers(hf_model, skip))
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    assert cache.length == 7  # the slots count as advanced, as for an early exit's
    running = [i for i in range(LAYERS) if i not in skip]
    torch.testing.assert_close(cache.k[running], reference_cache.k)
    torch.testing.assert_close(cache.v[running], reference_cache.v)
    for layer in skip:  # a fresh cache is zeros: untouched
        assert not cache.k[layer].any() and not cache.v[layer].any()


def test_a_skipped_layer_passes_the_residual_stream_on(target):
    with torch.inference_mode():
        out = target(TOKENS, POSITIONS, skip_layers=(2,), return_hidden=(1, 2, 3, 4))
    # hidden l: the stream after l layers; layer 2 (the third) is skipped
    assert torch.equal(out.hidden[1], out.hidden[2])
    assert not torch.equal(out.hidden[0], out.hidden[1])


@pytest.mark.parametrize("bad", [(4,), (-1,), (True,), (1.0,), 2], ids=str)
def test_bad_layer_ids_are_refused(target, bad):
    with pytest.raises(ValueError, match="skip_layers must be"):
        target(TOKENS, POSITIONS, skip_layers=bad)
