"""Every path on every device: tensors are made where their inputs live, random draws use a
generator on the device of the probabilities, a generator on another device is refused,
training rows reach the device of the model they train, and the attention kernel is pinned
per device.

The CUDA variants run where a GPU is present; on a CPU-only machine the "other device" is the
meta device (a model built there, probabilities there), which is enough to reach each check.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import first_layers, fit_dflash_head, fit_medusa_heads, tiny_llama
from torch.nn.attention import SDPBackend

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import (
    DecodeSetup,
    DFlashDrafter,
    LookupCorpus,
    MedusaDrafter,
    MedusaProductDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
)
from selfspec.drafters.layer_skip import LayerSkipDrafter
from selfspec.drafters.lookahead import LookaheadDrafter
from selfspec.heads.base import LossOutput
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.model import ModelConfig, attention_kernels
from selfspec.model.transformer import _kv_for_kernels
from selfspec.sampling import check_generator, sample
from selfspec.training.loop import TrainSettings, _evaluate, _micro_batch
from selfspec.training.rows import TokenRows
from selfspec.verify import verify_linear

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9, 27, 17, 51, 25, 11]]
NEW_TOKENS = 16
SAMPLINGS = [SamplingParams(1.0), SamplingParams(1.0, top_p=0.8)]
DRAFTERS = ["none", "small_model", "small_model_vocab", "ngram", "ngram_corpus_tree", "medusa",
            "medusa_products", "medusa_and_lookup", "layer_skip", "lookahead", "dflash",
            "dflash_tree"]
MEDUSA_CHOICES = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]  # branches: a real tree mask


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0)


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(hf_target, device) -> Transformer:
    return Transformer.from_hf(hf_target, device=device)


@pytest.fixture(scope="module")
def meta_target() -> Transformer:
    """A model on the meta device: a second device on any machine (forwards give shapes)."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    with torch.device("meta"):
        return Transformer(config)


@pytest.fixture(scope="module")
def fitted_heads(hf_target):
    """Medusa heads fit on the CPU to the target's greedy continuations (so drafts get
    accepted); each device gets a copy."""
    cpu_target = Transformer.from_hf(hf_target)
    continuations = {tuple(p): generate(cpu_target, p, max_new_tokens=NEW_TOKENS).tokens
                     for p in PROMPTS}
    return fit_medusa_heads(cpu_target, continuations)[0]


@pytest.fixture(scope="module")
def fitted_block(hf_target):
    """A DFlash head fit on the CPU to the same continuations, blocks of 4."""
    cpu_target = Transformer.from_hf(hf_target)
    continuations = {tuple(p): generate(cpu_target, p, max_new_tokens=NEW_TOKENS).tokens
                     for p in PROMPTS}
    return fit_dflash_head(cpu_target, continuations, block_size=4)[0]


@pytest.fixture(scope="module")
def lookup_corpus(hf_target) -> LookupCorpus:
    """A CPU-side corpus of the target's greedy continuations, as a sweep builds one."""
    cpu_target = Transformer.from_hf(hf_target)
    return LookupCorpus([generate(cpu_target, p, max_new_tokens=NEW_TOKENS).tokens
                         for p in PROMPTS])


@pytest.fixture(scope="module")
def make_drafter(hf_target, fitted_heads, fitted_block, lookup_corpus, device):
    """make_drafter(kind): a fresh drafter of `kind` for the target on the module's device."""
    draft_model = Transformer.from_hf(first_layers(hf_target), device=device)
    heads = copy.deepcopy(fitted_heads).to(device)  # Module.to moves in place
    block = copy.deepcopy(fitted_block).to(device)
    makers = {
        "none": lambda: None,
        "small_model": lambda: SmallModelDrafter(draft_model, 3),
        # A draft vocabulary built on the CPU, as a sweep loads it: the drafter moves it.
        "small_model_vocab": lambda: SmallModelDrafter(
            draft_model, 3, draft_vocab=draft_vocabulary(torch.arange(48), 64, 48)),
        "ngram": lambda: NgramDrafter(4),
        "ngram_corpus_tree": lambda: NgramDrafter(3, corpus=lookup_corpus, max_nodes=6),
        "medusa": lambda: MedusaDrafter(heads, MEDUSA_CHOICES),
        "medusa_products": lambda: MedusaProductDrafter(heads, top_k=2, max_nodes=6),
        "medusa_and_lookup": lambda: UnionDrafter([
            MedusaDrafter(heads, [[0], [1]]),
            NgramDrafter(3, corpus=lookup_corpus, max_nodes=4)], max_nodes=5),
        "layer_skip": lambda: LayerSkipDrafter(skip_layers=(1,), num_draft_tokens=3),
        "lookahead": lambda: LookaheadDrafter(window=3, ngram=3, candidates=2),
        "dflash": lambda: DFlashDrafter(block),
        "dflash_tree": lambda: DFlashDrafter(block, tree_nodes=5),
    }
    return lambda kind: makers[kind]()


@pytest.fixture(scope="module")
def plain_greedy(target) -> list[list[int]]:
    """Eager plain decoding (on CUDA the other tests run with CUDA graphs, generate's default)."""
    return [generate(target, p, max_new_tokens=NEW_TOKENS, cuda_graphs=False).tokens
            for p in PROMPTS]


def seeded(device: str, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ---- every drafter on every device ----------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_equals_plain_greedy(target, plain_greedy, make_drafter, kind):
    drafter, accepted = make_drafter(kind), 0
    for prompt, expected in zip(PROMPTS, plain_greedy, strict=True):
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert out.tokens == expected
        accepted += out.stats.accepted
    assert kind == "none" or accepted > 0  # the drafts were in play, not all rejected


@pytest.mark.parametrize("kind", DRAFTERS)
def test_static_steps_give_plain_greedy_with_every_drafter(target, plain_greedy, make_drafter,
                                                           kind):
    """cuda_graphs=True: replayed CUDA graphs on CUDA, the same static step run eagerly on a
    CPU; plain_greedy is eager on both."""
    for prompt, expected in zip(PROMPTS, plain_greedy, strict=True):
        out = generate(target, prompt, drafter=make_drafter(kind), max_new_tokens=NEW_TOKENS,
                       cuda_graphs=True)
        assert out.tokens == expected


@pytest.mark.parametrize("params", SAMPLINGS, ids=["t1", "top_p"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_sampling_runs_and_repeats_with_a_generator_on_the_device(
    target, device, make_drafter, kind, params
):
    vocab = target.config.vocab_size
    for prompt in PROMPTS:
        runs = [generate(target, prompt, drafter=make_drafter(kind), sampling=params,
                         max_new_tokens=NEW_TOKENS, generator=seeded(device)).tokens
                for _ in range(2)]
        assert len(runs[0]) == NEW_TOKENS and all(0 <= t < vocab for t in runs[0])
        assert runs[0] == runs[1]  # the seed alone decides: no other source of randomness


def test_the_draft_model_is_fed_on_its_own_device(meta_target):
    """Forwards on the meta device run (shapes only) but refuse inputs from another device."""
    drafter = SmallModelDrafter(meta_target, 2)
    prompt = torch.tensor([3, 4], device="meta")
    drafter.begin(DecodeSetup(meta_target, prompt, SamplingParams(), None, max_length=8))
    logits = drafter._feed([3, 4])
    assert logits.device.type == "meta" and logits.shape == (1, 2, 64)


def test_an_unseeded_sampling_run_makes_its_generator_on_the_device(target):
    out = generate(target, PROMPTS[0], drafter=NgramDrafter(4), sampling=SamplingParams(1.0),
                   max_new_tokens=NEW_TOKENS)
    assert len(out.tokens) == NEW_TOKENS


# ---- a generator on another device is refused -----------------------------------------------


def test_the_check_names_both_devices_and_the_fix():
    with pytest.raises(ValueError, match=r"generate: the generator is on cpu but the "
                       r"probabilities are on cuda:0; pass generator=torch\.Generator\("
                       r"device='cuda:0'\)"):
        check_generator(torch.Generator(), torch.device("cuda:0"), "generate")
    check_generator(torch.Generator(), torch.device("cpu"), "generate")  # same device: fine
    check_generator(None, torch.device("cuda:0"), "generate")  # none given: decided later


def test_something_else_than_a_generator_is_refused():
    with pytest.raises(ValueError, match="generator must be a torch.Generator, got int"):
        check_generator(0, "cpu", "generate")


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0)], ids=["greedy", "t1"])
def test_generate_refuses_a_generator_on_another_device_than_the_target(meta_target, params):
    with pytest.raises(ValueError, match="generator is on cpu but the probabilities are on meta"):
        generate(meta_target, [3, 4], sampling=params, max_new_tokens=2,
                 generator=torch.Generator())


def test_verify_and_sample_refuse_a_generator_on_another_device_than_p():
    p = torch.full((2, 4), 0.25, device="meta")
    with pytest.raises(ValueError, match="verify: the generator is on cpu but the probabilities"):
        verify_linear(torch.tensor([1]), None, p, generator=torch.Generator())
    with pytest.raises(ValueError, match="sample: the generator is on cpu but the probabilities"):
        sample(p[0], torch.Generator())


@needs_cuda
def test_a_cpu_generator_is_refused_for_a_cuda_target(hf_target):
    cuda_target = Transformer.from_hf(hf_target, device="cuda")
    with pytest.raises(ValueError, match="generator is on cpu but the probabilities are on cuda"):
        generate(cuda_target, [3, 4], sampling=SamplingParams(1.0), max_new_tokens=2,
                 generator=torch.Generator())


# ---- training rows reach the device the prepared model lives on -----------------------------


class StandInAccelerator:
    """What `_micro_batch` and `_evaluate` read of an Accelerator: one process on `device`."""

    num_processes, process_index = 1, 0

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        return torch.zeros(tensor.shape, dtype=tensor.dtype)  # values do not matter here


class DeviceRecorder(torch.nn.Module):
    """An objective that records the device of every batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.device, torch.device]] = []

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        self.seen.append((tokens.device, loss_mask.device))
        return LossOutput(torch.zeros(()), {})


@pytest.fixture
def rows() -> TokenRows:
    tokens = torch.arange(10 * 6).view(10, 6)  # [N, T]: row i holds 6i..6i+5
    return TokenRows(tokens, torch.ones_like(tokens))


@pytest.mark.parametrize("where", [*DEVICES, "meta"])
def test_micro_batches_go_to_the_accelerator_device(tmp_path, rows, where):
    settings = TrainSettings(run_dir=str(tmp_path), max_steps=4, micro_batch_size=3)
    batch = _micro_batch(rows, 1, 0, settings, StandInAccelerator(where))
    on_cpu = _micro_batch(rows, 1, 0, settings, StandInAccelerator("cpu"))
    for tensor in (batch.tokens, batch.loss_mask):
        assert tensor.device.type == where and tensor.shape == (3, 6)
    if where != "meta":
        assert torch.equal(batch.tokens.cpu(), on_cpu.tokens)  # the same rows, moved


@pytest.mark.parametrize("where", [*DEVICES, "meta"])
def test_evaluation_rows_go_to_the_accelerator_device(tmp_path, rows, where):
    settings = TrainSettings(run_dir=str(tmp_path), max_steps=4, micro_batch_size=3, eval_rows=7)
    model = DeviceRecorder()
    _evaluate(model, rows, settings, StandInAccelerator(where))
    assert len(model.seen) == 3  # 7 rows in micro-batches of 3
    assert {d.type for pair in model.seen for d in pair} == {where}


# ---- the attention kernel is chosen per device -----------------------------------------------


def enabled_kernels() -> set[str]:
    """The SDPA kernels torch may pick right now."""
    flags = torch.backends.cuda
    return {name for name, on in [("flash", flags.flash_sdp_enabled()),
                                  ("efficient", flags.mem_efficient_sdp_enabled()),
                                  ("math", flags.math_sdp_enabled()),
                                  ("cudnn", flags.cudnn_sdp_enabled())] if on}


def kernels_during_attention(model: Transformer, **forward) -> set[str]:
    """The kernels enabled while the first layer (its attention with it) runs in
    model(**forward)."""
    seen = []
    hook = model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(enabled_kernels()))
    try:
        model(**forward)
    finally:
        hook.remove()
    return seen[0]


def test_the_kernels_are_pinned_on_cuda_and_left_to_torch_elsewhere():
    assert attention_kernels(torch.device("cpu"), masked=True) is None
    assert attention_kernels(torch.device("cpu"), masked=False) is None
    # Flash takes no arbitrary mask: a masked forward gets the memory-efficient kernel, with
    # the math kernel as the last resort; cuDNN never.
    assert attention_kernels(torch.device("cuda:0"), masked=True) == [
        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert attention_kernels(torch.device("cuda:0"), masked=False) == [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def test_repeated_kv_heads_attend_as_grouped_heads():
    """The layout CUDA's fused kernels get (each K/V head repeated for its group) gives the
    attention that grouped heads (enable_gqa) give, with a mask over a cache."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, t, 8, generator=gen) for heads, t in ((6, 3), (2, 5), (2, 5)))
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    outs = []
    for repeat in (False, True):
        kk, vv, grouped = _kv_for_kernels(k, v, 6, repeat_heads=repeat)
        assert grouped is not repeat and kk.shape[1] == (6 if repeat else 2)
        outs.append(F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=grouped))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)


@needs_cuda
def test_cuda_logits_match_the_cpu_logits_with_grouped_heads_a_cache_and_a_tree(hf_target):
    """fp32 on both devices: a prefill, then a tree-masked forward over the cache."""
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    logits = []
    for device in ("cpu", "cuda"):
        model = Transformer.from_hf(hf_target, device=device)
        assert model.config.num_kv_heads < model.config.num_heads  # grouped heads
        cache = model.new_cache(max_slots=16)
        model(torch.tensor([PROMPTS[0]], device=device), torch.arange(10, device=device), cache)
        out = model(torch.tensor([[3, 4, 5]], device=device),
                    torch.tensor([10, 11, 11], device=device), cache, mask=tree_mask.to(device))
        logits.append(out.logits.cpu())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_forward_runs_under_its_device_kernels_and_restores_the_flags(target, device):
    before = enabled_kernels()
    tokens = torch.tensor([[3, 4, 5]], device=device)
    positions = torch.arange(3, device=device)
    plain = kernels_during_attention(target, tokens=tokens, positions=positions)
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
    masked = kernels_during_attention(target, tokens=tokens, positions=positions, mask=tree_mask)
    if device == "cuda":
        assert (plain, masked) == ({"flash", "efficient", "math"}, {"efficient", "math"})
    else:
        assert plain == masked == before  # CPU: torch's own choice, logits unchanged
    assert enabled_kernels() == before
