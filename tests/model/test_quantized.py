"""The target's quantized copy (selfspec/model/quantized.py) as a draft model: its linears hold
torchao int8 / int4 weights and the target is untouched; its logits are as close to the
target's as the quantization step allows; drafting with it (SmallModelDrafter) is lossless at
greedy and keeps the target's exact law when sampling."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import assert_drafted_sampling_is_exact, law_samples, tiny_llama
from torchao.utils import TorchAOBaseTensor

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import SmallModelDrafter
from selfspec.model import Linear
from selfspec.model import quantized as quantized_module
from selfspec.model.quantized import (
    CPU_INT4,
    CPU_INT8,
    CUDA_INT4,
    CUDA_INT8,
    CUDA_INT8_WIDENED,
    QuantizedLinear,
    check_quantizable,
    layout_for,
    quantized_copy,
)

TINY = Path(__file__).resolve().parents[2] / "selfspec" / "assets" / "tiny" / "target"
PROMPTS = [[2, 3, 4, 5, 2, 3], [9, 8, 7, 6, 5], [11, 12]]
NEW_TOKENS = 24
BITS = [8, 4]

# The tolerance of one quantized product. Rounding a weight to a grid of step D errs uniformly
# by D/sqrt(12). A grid of 2^b - 1 steps spans a row (int8, symmetric: 2 max|w|) or a group of
# 32 (int4: max - min); K normal weights span about 2 sqrt(2 ln K) rms, under 8 rms for every
# width here (7.2 at K = 688), so D < 8 rms / (2^b - 1) and a product errs by less than
# 8 / (2^b - 1) / sqrt(12) of its size: 0.9% (int8), 15% (int4); bf16 rows add 2^-9.
ONE_PRODUCT_ERROR = {b: 8 / (2**b - 1) / math.sqrt(12) + 2**-9 for b in BITS}


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def copies(target, tiny) -> dict:
    """Each target's copy at each bits setting, built once."""
    return {(name, bits): quantized_copy(model, bits) for name, model in
            (("random", target), ("tiny", tiny)) for bits in BITS}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("bits", BITS)
def test_the_copys_linears_hold_torchao_weights_and_the_target_is_untouched(tiny, bits):
    before = {name: tensor.clone() for name, tensor in tiny.state_dict().items()}
    copied = quantized_copy(tiny, bits)
    layers = [m for m in copied.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 7 * tiny.config.num_layers + 1  # q, k, v, o, gate, up, down; head
    assert not any(isinstance(m, Linear) for m in copied.modules())
    for layer in layers:
        assert isinstance(layer.weight, TorchAOBaseTensor), type(layer.weight)
        # int8: one byte a weight; int4: two weights a byte, in the kernel's packed layout
        assert layer.weight.qdata.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert copied.layers[0].mlp.down_proj.padding == (0 if bits == 8 else 16)  # 688 -> 704
    assert torch.equal(copied.embed_tokens.weight, tiny.embed_tokens.weight)
    after = tiny.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert all(isinstance(m, Linear) for m in (tiny.lm_head, tiny.layers[0].mlp.up_proj))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("model", ["random", "tiny"])
def test_each_quantized_product_errs_within_the_quantization_step(target, tiny, copies, model,
                                                                 bits):
    original = {"random": target, "tiny": tiny}[model]
    quantized_layers = dict(copies[model, bits].named_modules())
    generator = torch.Generator().manual_seed(2)
    for name, layer in original.named_modules():
        if isinstance(layer, Linear):
            rows = torch.randn(16, layer.in_features, generator=generator)
            with torch.inference_mode():
                error = relative_error(quantized_layers[name](rows), layer(rows))
            assert 0 < error < ONE_PRODUCT_ERROR[bits], (name, error)


def test_a_quantized_models_divergences_count_as_its_products_near_ties(tiny):
    """Its products round activations to bf16: the lossless check allows bf16's near-ties."""
    from selfspec.measure.divergence import near_tie_tolerance
    from selfspec.measure.peers import OurDecoder

    copied = quantized_copy(tiny, 8)
    logits, rounds_to = OurDecoder(copied).next_token_logits([3, 4, 5])
    assert copied.products_dtype == rounds_to == torch.bfloat16
    assert near_tie_tolerance(logits, rounds_to) > 0
    assert OurDecoder(tiny).next_token_logits([3, 4, 5])[1] == torch.float32  # fp32: none


@pytest.mark.parametrize("bits", BITS)
def test_gradients_flow_through_a_quantized_product_as_through_the_weight_it_holds(bits):
    """Heads train through a quantized target's LM head: the rows' gradient is the upstream
    gradient times the weight the kernel computes with (aten's kernels have no derivative),
    within one product's quantization error of the full-precision layer's gradient."""
    generator = torch.Generator().manual_seed(3)
    for width in (40, 64):  # 40: widened to the kernel's multiple with zero columns
        layer = Linear(width, 48)
        quantized = quantized_module._quantized_linear(layer, layout_for(bits, "cpu"))
        rows = torch.randn(6, width, generator=generator, requires_grad=True)
        upstream = torch.randn(6, 48, generator=generator)
        quantized(rows).backward(upstream)
        expected = torch.autograd.grad(layer(rows), rows, upstream)[0]
        assert 0 < relative_error(rows.grad, expected) < ONE_PRODUCT_ERROR[bits]
        dense = quantized.dense_weight()
        assert dense.shape == layer.weight.shape
        assert relative_error(dense, layer.weight.detach()) < ONE_PRODUCT_ERROR[bits]


@pytest.mark.parametrize("bits", BITS)
def test_the_trained_targets_logits_err_as_little_as_one_product(tiny, copies, bits):
    """On a trained target the norms and the residual stream keep the copy's logits about as
    close as one product (measured: 0.4% for int8, 4% for int4); twice it bounds them. (The
    random target's peaky attention amplifies them: 2% and 36%.)"""
    tokens = torch.randint(tiny.config.vocab_size, (1, 40),
                           generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = tiny(tokens, torch.arange(40)).logits
        got = copies["tiny", bits](tokens, torch.arange(40)).logits
    error = relative_error(got, expected)
    assert 0 < error < 2 * ONE_PRODUCT_ERROR[bits], error


def test_a_tied_head_is_quantized_apart_from_the_full_precision_embedding(target):
    torch.manual_seed(0)
    tied = Transformer(replace(target.config, tie_word_embeddings=True))
    copied = quantized_copy(tied, 8)
    assert isinstance(copied.lm_head, QuantizedLinear)
    assert copied.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(copied.embed_tokens.weight, tied.embed_tokens.weight)
    assert tied.lm_head.weight is tied.embed_tokens.weight  # the target stays tied


@pytest.mark.parametrize("bits", BITS)
def test_biases_stay_full_precision_beside_quantized_weights(target, bits):
    """Qwen2's q/k/v biases: added in fp32 after the quantized product."""
    torch.manual_seed(0)
    biased = Transformer(replace(target.config, attention_bias=True))
    layer = quantized_copy(biased, bits).layers[0].self_attn.q_proj
    assert torch.equal(layer.bias, biased.layers[0].self_attn.q_proj.bias)
    rows = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = biased.layers[0].self_attn.q_proj(rows)
        assert relative_error(layer(rows), expected) < ONE_PRODUCT_ERROR[bits]


# the shipped target's copies (int8 4 s, int4 11 s) run in the full run; random targets quick
@pytest.mark.parametrize("model, bits", [("random", 8), ("random", 4), pytest.param(
    "tiny", 8, marks=pytest.mark.slow), pytest.param("tiny", 4, marks=pytest.mark.slow)])
def test_greedy_drafting_is_lossless_at_every_draft_length(target, tiny, copies, model, bits):
    original = {"random": target, "tiny": tiny}[model]
    drafted = 0
    for prompt in PROMPTS:
        expected = generate(original, prompt, max_new_tokens=NEW_TOKENS).tokens
        for k in range(1, 7):
            drafter = SmallModelDrafter(copies[model, bits], num_draft_tokens=k)
            result = generate(original, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
            assert result.tokens == expected, (prompt, k)
            drafted += result.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("params, bits", [
    pytest.param(SamplingParams(temperature=1.0), 8, id="8-T=1"),  # the default run's case
    pytest.param(SamplingParams(temperature=1.0), 4, id="4-T=1", marks=pytest.mark.slow),
    *(pytest.param(SamplingParams(temperature=0.8, top_p=0.9), bits, id=f"{bits}-top_p",
                   marks=pytest.mark.slow) for bits in BITS)])
def test_sampling_with_the_copy_keeps_the_targets_two_token_law(target, copies, bits, params,
                                                                request):
    drafter = SmallModelDrafter(copies["random", bits], num_draft_tokens=2)
    assert_drafted_sampling_is_exact(target, drafter, params, law_samples(request))


def test_bits_and_devices_it_cannot_build_are_refused(target):
    with pytest.raises(ValueError, match=r"bits must be 8 or 4 .*got 3"):
        quantized_copy(target, 3)
    with torch.device("meta"):
        on_meta = Transformer(target.config)
    with pytest.raises(ValueError, match=r"the CPU or a CUDA GPU .* on meta; use device=cpu or "
                                         r"device=cuda"):
        quantized_copy(on_meta, 8)


def test_int4_is_refused_in_one_line_naming_the_fix_where_its_kernel_fails(monkeypatch):
    assert quantized_module.int4_failure() is None  # it runs on this machine
    monkeypatch.setattr(quantized_module, "int4_failure", lambda *_: "RuntimeError: no kernel")
    with pytest.raises(ValueError) as refused:
        check_quantizable(4, "cpu")
    message = str(refused.value)
    assert "\n" not in message and "int4 does not run on this machine" in message
    assert "use bits 8" in message and "torchao==0.18.0" in message
    check_quantizable(8, "cpu")


# ---- layouts by device: chosen and refused on any machine, the CUDA kernels where CUDA is -----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_each_device_gets_its_layout(monkeypatch):
    assert layout_for(8, "cpu") is CPU_INT8 and layout_for(4, "cpu") is CPU_INT4
    assert layout_for(4, "cuda") is CUDA_INT4 and layout_for(4, "cuda:1") is CUDA_INT4
    assert dict(CUDA_INT4.config_kwargs) == {"group_size": 128,
                                             "int4_packing_format": "tile_packed_to_4d"}
    assert quantized_module.int8pack_failure("cpu") is None  # the CPU's kernel runs here
    # int8 on CUDA: aten's int8pack kernel where the CUDA build has it, else torchao's product
    monkeypatch.setattr(quantized_module, "int8pack_failure", lambda device: None)
    assert layout_for(8, "cuda") is CUDA_INT8
    monkeypatch.setattr(quantized_module, "int8pack_failure",
                        lambda device: "NotImplementedError: no CUDA kernel")
    assert layout_for(8, "cuda") is CUDA_INT8_WIDENED


def test_int4_on_a_gpu_older_than_tinygemm_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError) as refused:
        check_quantizable(4, "cuda")
    message = str(refused.value)
    assert "\n" not in message and "compute capability 8.0 or newer" in message
    assert "Tesla T4 has 7.5: use bits 8" in message
    with pytest.raises(ValueError, match="the CPU or a CUDA GPU .* on mps"):
        check_quantizable(8, "mps")


def test_torchaos_widening_int8_product_is_the_int8pack_kernels_up_to_bf16(target):
    """CUDA_INT8_WIDENED multiplies through torchao's own product, which runs on the CPU too:
    the same quantized weight as aten's kernel computes with, to bf16's rounding, and a copy in
    that layout decodes greedily as itself through speculative decoding."""
    generator = torch.Generator().manual_seed(4)
    layer = Linear(64, 48)
    kernel = quantized_module._quantized_linear(layer, CPU_INT8)
    widened = quantized_module._quantized_linear(layer, CUDA_INT8_WIDENED)
    assert widened.scale is None and "torchao's product" in repr(widened)
    rows = torch.randn(5, 64, generator=generator)
    with torch.inference_mode():
        assert relative_error(widened(rows), kernel(rows)) < 2**-7
    copy = quantized_copy(target, 8, layout=CUDA_INT8_WIDENED)
    assert copy.lm_head.layout is CUDA_INT8_WIDENED
    for prompt in PROMPTS[:2]:
        plain = generate(copy, prompt, max_new_tokens=12).tokens
        drafted = generate(copy, prompt, drafter=SmallModelDrafter(target, num_draft_tokens=3),
                           max_new_tokens=12)
        assert drafted.tokens == plain and drafted.stats.drafted > 0


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
def test_the_cuda_layouts_multiply_within_one_quantization_step(bits):
    generator = torch.Generator().manual_seed(5)
    for width, out in ((64, 48), (200, 96)):  # 200: widened to the layout's multiple
        layer = Linear(width, out).cuda()
        quantized = quantized_module._quantized_linear(layer, layout_for(bits, "cuda"))
        rows = torch.randn(6, width, generator=generator).cuda()
        with torch.inference_mode():
            assert relative_error(quantized(rows), layer(rows)) < ONE_PRODUCT_ERROR[bits]


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, None], ids=["eager", "graphs"])
@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_cuda_target_keeps_its_own_law_under_drafting(bits, cuda_graphs):
    """The copy is the target here: the full-precision model drafts for it, and sampling keeps
    the copy's exact two-token law (chi-square), eager and in captured static steps."""
    full = Transformer.from_hf(tiny_llama(0, vocab=64, layers=2, hidden=64), device="cuda")
    copied = quantized_copy(full, bits)
    assert copied.lm_head.layout is layout_for(bits, "cuda")
    drafter = SmallModelDrafter(full, num_draft_tokens=2)
    assert_drafted_sampling_is_exact(copied, drafter, SamplingParams(1.0),
                                     cuda_graphs=cuda_graphs)


def test_a_mixture_of_experts_target_is_refused_in_one_line():
    from helpers import tiny_model

    moe = Transformer.from_hf(tiny_model("mixtral", 0))
    with pytest.raises(ValueError, match=r"^quantized copy: a mixtral target's experts are "
                                         r"stacked tensors.*draft with a dense model"):
        quantized_copy(moe, 8)
