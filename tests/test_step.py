"""The static-shape step (`selfspec.step`): the same logits, hidden states and cache as the
eager forward, step after step, with padding rows, tree masks, commits and rollbacks; and the
same tokens through `generate(cuda_graphs=True)` with every drafter. On a CPU the static step
runs eagerly; where CUDA is present the same tests replay captured CUDA graphs. Each test runs
the step as written and compiled (inductor, over fused products: `compile_steps`)."""

from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace

import pytest
import torch
from helpers import first_layers, tiny_llama, tiny_model

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import NgramDrafter, SmallModelDrafter
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.measure.oracle import OracleDrafter
from selfspec.model.placement import Placement
from selfspec.step import (
    BUCKETS,
    StaticSteps,
    bucket_of,
    capture,
    collector_paused,
    static_steps,
    use_cuda_graphs,
)

# (device, compile_steps)
# The compiled step (inductor) compiles for half a minute on a CPU: the slow run's.
DEVICES = [("cpu", False), pytest.param(("cpu", True), marks=pytest.mark.slow)] + (
    [("cuda", False), ("cuda", True)] if torch.cuda.is_available() else [])
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module", params=DEVICES,
                ids=lambda p: p[0] + ("-compiled" if p[1] else ""))
def target(request) -> Transformer:
    device, compiled = request.param
    model = Transformer.from_hf(tiny_llama(0), device=device)
    model.compile_steps = compiled
    return model


def device_of(target: Transformer) -> torch.device:
    return target.embed_tokens.weight.device


def on(*devices: str, linear_layers: frozenset[int] = frozenset()) -> SimpleNamespace:
    """A stand-in target: its home device, and its layers over `devices` (placed if several);
    linear_layers: its recurrent layers."""
    home = torch.device(devices[0])
    placement = Placement(home, tuple(map(torch.device, devices))) if len(devices) > 1 else None
    return SimpleNamespace(placement=placement,
                           embed_tokens=SimpleNamespace(weight=SimpleNamespace(device=home)),
                           config=SimpleNamespace(linear_layers=linear_layers))


def test_buckets_and_the_auto_setting():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 128, 129)] == [1, 2, 4, 8, 16, 128, None]
    assert use_cuda_graphs(None, on("cuda:0")) is True
    assert use_cuda_graphs(None, on("cpu")) is False
    assert use_cuda_graphs(False, on("cuda:0")) is False
    # Placed over several devices: eager, and graphs asked for are refused.
    assert use_cuda_graphs(None, on("cuda:0", "cuda:1")) is False
    with pytest.raises(ValueError, match="placed over several devices decodes eagerly"):
        use_cuda_graphs(True, on("cuda:0", "cuda:1"))
    # A recurrent target: eager, and graphs asked for are refused.
    assert use_cuda_graphs(None, on("cuda:0", linear_layers=frozenset({0}))) is False
    with pytest.raises(ValueError, match="recurrent target .* decodes eagerly"):
        use_cuda_graphs(True, on("cuda:0", linear_layers=frozenset({0})))
    with pytest.raises(ValueError, match="cuda_graphs must be None .*, True or False, got 'no'"):
        generate(Transformer.from_hf(tiny_llama(0)), [3, 4], max_new_tokens=2, cuda_graphs="no")
    model = Transformer.from_hf(tiny_llama(0))
    model.compile_steps = "yes"
    with pytest.raises(ValueError, match="compile_steps must be True or False, got 'yes'"):
        generate(model, [3, 4], max_new_tokens=2, cuda_graphs=True)


def test_a_static_step_gives_the_eager_forward_step_after_step(target):
    assert_static_steps_follow_the_eager_forward(target)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "compiled"])  # compiling its buckets takes ~90 s here
def test_a_sliding_familys_static_step_gives_the_eager_forward(compiled):
    """Gemma 3 (q/k norms fused and compiled too; a window of WINDOW tokens, shorter than
    the cache): the mask built on the device keeps each row to its window, by position."""
    model = Transformer.from_hf(tiny_model("gemma3", 0))
    assert model.config.sliding_window < len(PROMPT)
    model.compile_steps = compiled
    assert_static_steps_follow_the_eager_forward(model)


def assert_static_steps_follow_the_eager_forward(target: Transformer) -> None:
    device = device_of(target)
    steps = StaticSteps(target, max_slots=256 + max(BUCKETS))
    eager = target.new_cache(max_slots=256)
    prompt = torch.tensor([PROMPT], device=device)
    for cache in (eager, steps.cache):
        target(prompt, torch.arange(len(PROMPT), device=device), cache)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
    gen = torch.Generator().manual_seed(0)
    # (rows, mask, what the host does after): chains, a tree with a commit of its second
    # branch, a rollback, a bucket reused at another cache length, and more than any bucket
    plan = [(1, None, None), (3, tree, [0, 2]), (2, None, "truncate"), (5, None, None),
            (1, None, None), (3, tree, [0, 1]), (130, None, None)]
    for n, mask, after in plan:
        tokens = torch.randint(64, (1, n), generator=gen).to(device)
        offsets = torch.tensor([0, 1, 1] if mask is not None else list(range(n)), device=device)
        positions = eager.length + offsets
        expected = target(tokens, positions, eager, mask=mask, return_hidden=(1,))
        got = steps.forward(tokens, positions, mask, layers=(1,))
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.hidden[0], expected.hidden[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.last_hidden, expected.last_hidden, rtol=1e-5, atol=1e-5)
        assert steps.cache.length == eager.length
        if after == "truncate":
            for cache in (eager, steps.cache):
                cache.truncate(cache.length - 1)
        elif after is not None:
            for cache in (eager, steps.cache):
                cache.commit([cache.length - n + i for i in after])
        valid = eager.length
        torch.testing.assert_close(steps.cache.k[:, :, :, :valid], eager.k[:, :, :, :valid],
                                   rtol=1e-5, atol=1e-5)
    if device.type == "cuda":
        assert all(bucket.graph is not None for bucket in steps._buckets.values())
    assert (steps.setup_seconds > 0) == (steps.capture or steps.compiled)


def test_padding_rows_leave_nothing_unusable_in_the_cache(target):
    """A padded first step over an empty cache: its extra row has no past, so it attends to
    itself. A row that attends to nothing can come out NaN (kernels differ), and a NaN slot
    in the cache, even masked out, turns later attention into NaN (0 x NaN)."""
    device = device_of(target)
    steps = StaticSteps(target, max_slots=256 + max(BUCKETS))
    eager = target.new_cache(max_slots=64)
    for n in (3, 1, 2):
        tokens = torch.arange(3, 3 + n, device=device)[None]
        positions = eager.length + torch.arange(n, device=device)
        expected = target(tokens, positions, eager).logits
        got = steps.forward(tokens, positions, None).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_outputs_are_copies_that_the_next_step_leaves_alone(target):
    device = device_of(target)
    steps = StaticSteps(target, max_slots=256 + max(BUCKETS))
    first = steps.forward(torch.tensor([[3]], device=device), torch.tensor([0], device=device),
                          None)
    kept = first.logits.clone()
    steps.forward(torch.tensor([[9]], device=device), torch.tensor([1], device=device), None)
    assert torch.equal(first.logits, kept)


def test_the_steps_are_kept_between_generations_and_grow_when_needed(target):
    steps = static_steps(target, 40)
    steps.cache.advance(5)
    again = static_steps(target, 60)  # fits the same cache: reset and reused
    assert again is steps and again.cache.length == 0
    bigger = static_steps(target, steps.cache.max_slots + 1)
    assert bigger is not steps and bigger.cache.max_slots > steps.cache.max_slots


def test_new_weights_get_new_steps_and_weights_changed_in_place_keep_them():
    """A replay reads the tensors it was captured with: weights cast (new tensors) need new
    steps; weights changed in place (a merged adapter, say) are read as they are."""
    target = Transformer.from_hf(tiny_llama(0))
    steps = static_steps(target, 40)
    with torch.no_grad():
        target.norm.weight.mul_(1.5)
    assert static_steps(target, 40) is steps
    target.to(torch.float64)
    again = static_steps(target, 40)
    assert again is not steps and again.cache.k.dtype == torch.float64
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.clone())
    assert static_steps(target, 40) is not again


@pytest.mark.parametrize("k", [1, 3, 4])
def test_graphed_speculative_greedy_equals_eager_plain_greedy(target, k):
    plain = generate(target, PROMPT, max_new_tokens=24, cuda_graphs=False).tokens
    assert generate(target, PROMPT, max_new_tokens=24, cuda_graphs=True).tokens == plain
    ngram = generate(target, PROMPT, drafter=NgramDrafter(k), max_new_tokens=24,
                     cuda_graphs=True)
    assert ngram.tokens == plain and ngram.stats.accepted > 0
    # the oracle generates with the same target in begin, in the same persistent cache
    oracle = generate(target, PROMPT, drafter=OracleDrafter(k), max_new_tokens=24,
                      cuda_graphs=True)
    assert oracle.tokens == plain and oracle.stats.accepted == oracle.stats.drafted


def test_graphed_sampling_repeats_with_a_seed(target):
    device = device_of(target)
    runs = [generate(target, PROMPT, drafter=NgramDrafter(3), sampling=SamplingParams(1.0),
                     max_new_tokens=16, cuda_graphs=True,
                     generator=torch.Generator(device=device).manual_seed(0)).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


@pytest.mark.parametrize("vocab", [None, 48], ids=["full_vocab", "draft_vocab"])
def test_a_draft_model_runs_static_steps_of_its_own_when_the_target_does(target, vocab):
    device = device_of(target)
    draft = Transformer.from_hf(first_layers(tiny_llama(0)), device=device)
    drafter = SmallModelDrafter(draft, 3, draft_vocab=None if vocab is None else
                                draft_vocabulary(torch.arange(vocab), 64, vocab))
    plain = generate(target, PROMPT, max_new_tokens=24, cuda_graphs=False).tokens
    out = generate(target, PROMPT, drafter=drafter, max_new_tokens=24, cuda_graphs=True)
    assert out.tokens == plain and out.stats.accepted > 0
    steps = drafter._steps
    assert steps is not None and steps.target is draft and drafter._fed.cache is steps.cache
    if device.type == "cuda":  # its one-token forwards replayed from a graph
        assert any(b.graph is not None for b in steps._buckets.values())
    eager = generate(target, PROMPT, drafter=drafter, max_new_tokens=24, cuda_graphs=False)
    assert eager.tokens == plain and drafter._steps is None


@pytest.mark.slow
def test_one_compiled_graph_per_bucket_serves_every_layer():
    """The compiled stages take a layer's weights as inputs: a new bucket adds one graph per
    stage, however many layers run it (a guard on the layer would add one per layer)."""
    from torch._dynamo.utils import counters

    model = Transformer.from_hf(tiny_llama(0, layers=3, hidden=40))
    model.compile_steps = True
    steps = StaticSteps(model, max_slots=256 + max(BUCKETS))
    model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)), steps.cache)
    graphs = counters["stats"]["unique_graphs"]
    steps.forward(torch.tensor([[3, 4, 5]]), len(PROMPT) + torch.arange(3), None)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    steps.forward(torch.tensor([[3, 4, 6, 7]]), len(PROMPT) + 3 + torch.arange(4), None)  # 4 again
    assert counters["stats"]["unique_graphs"] - graphs == 2


class _FakeCuda:
    """Stand-ins for the CUDA calls `capture` makes, so that its order of work runs on a CPU."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class CUDAGraph:
        def register_generator_state(self, generator):
            pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return _FakeCuda.Stream()

    @staticmethod
    def graph(graph):
        return contextlib.nullcontext()


def test_a_capture_runs_with_the_cyclic_collector_off_and_turns_it_back_on(monkeypatch):
    """A collection inside a capture can free an earlier graph, which invalidates the capture
    (an H200 run of the device tests): the captured run must see the collector off."""
    for name in ("Stream", "CUDAGraph", "stream", "current_stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FakeCuda, name))
    seen = []
    graph, out = capture(lambda: seen.append(gc.isenabled()) or len(seen), "cuda:0")
    assert seen == [True, True, False] and out == 3  # two warm-ups, then the captured run
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
