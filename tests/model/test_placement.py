"""A target's layers over several devices (`selfspec.model.placement`): the plans accelerate's
planner makes without any GPU, explicit maps, the errors of bad maps, and that a placed target,
its cache split beside its layers, gives the single-device logits and greedy tokens under every
kind of draft. On a CPU-only machine every device is the CPU: the split cache is built over
CPU parts; where CUDA is present the tiny target is also split between cuda:0 and the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import random_exit, random_medusa_heads, run_script, tiny_llama, tiny_model

from selfspec import Transformer, generate
from selfspec.drafters import EarlyExitDrafter, MedusaDrafter, NgramDrafter
from selfspec.from_config.models import model_config
from selfspec.heads import MedusaConfig
from selfspec.model.kv_cache import KVCache, SegmentedKVCache
from selfspec.model.placement import Placement
from selfspec.model.plan import check_present, place, plan_placement
from selfspec.step import use_cuda_graphs

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9, 4, 17, 5, 3, 9, 4]]
NEW_TOKENS = 24
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama70b():
    from omegaconf import OmegaConf

    return model_config(OmegaConf.load(ROOT / "conf" / "model" / "llama2-70b.yaml"))


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


@pytest.fixture(scope="module")
def plain_greedy(target) -> dict:
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


# ---- plans ---------------------------------------------------------------------------------


def test_auto_spreads_a_70b_target_evenly_over_four_gpus_without_any_gpu(llama70b):
    memory = {i: "80GiB" for i in range(4)}
    placement = plan_placement(llama70b, "auto", memory, torch.bfloat16, home="cuda:0")
    counts = [sum(d == torch.device("cuda", i) for d in placement.layers) for i in range(4)]
    assert sum(counts) == 80 and max(counts) - min(counts) <= 2, counts
    # Layers stay in order: one contiguous run per device.
    assert [device for _, _, device in placement.segments()] == [
        torch.device("cuda", i) for i in range(4)]
    assert placement.home == torch.device("cuda", 0) and placement.spans_devices


def test_sequential_fills_the_first_gpu_before_the_next(llama70b):
    memory = {i: "80GiB" for i in range(4)}
    placement = plan_placement(llama70b, "sequential", memory, torch.bfloat16, home="cuda:0")
    counts = [sum(d == torch.device("cuda", i) for d in placement.layers) for i in range(4)]
    assert counts[0] > 40 and counts[2:] == [0, 0], counts


@pytest.mark.parametrize("entry", [["train/medusa.py"],
                                   ["eval/sweep.py", "methods=[small_model,ngram]"]])
def test_the_dry_run_prints_the_placement_and_each_devices_memory(entry, tmp_path, monkeypatch,
                                                                  capsys):
    """The field's reference pair: Llama-2-70B over four GPUs, Llama-2-7B drafting beside its
    LM head; planned here, where there is no GPU and no weight."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_script(entry[0], [
        *entry[1:], "model=llama2-70b", "dry_run=true", "model.device_map=auto",
        "model.max_memory={0: 80GiB, 1: 80GiB, 2: 80GiB, 3: 80GiB}", "device=cuda:0",
        "wandb.enabled=false"], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert ("plan for llama2-7b" in out) == (entry[0] == "eval/sweep.py")
    rows = [line.split() for line in out.splitlines()
            if line.strip().startswith("cuda:")]
    assert [row[0] for row in rows] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    weights = [float(row[row.index("weights") + 1]) for row in rows]
    assert 128 < sum(weights) < 129 and max(weights) < 80  # 128.5 GiB of bf16 weights


def test_an_explicit_map_places_each_layer_range(target):
    placement = plan_placement(target.config, {"0-1": "cpu", 2: "cpu", "3": 0}, home="cpu")
    assert placement.layers == (CPU, CPU, CPU, torch.device("cuda", 0))
    assert placement.segments() == [(0, 3, CPU), (3, 4, torch.device("cuda", 0))]
    assert placement.device_of("layers.3.mlp.up_proj.weight") == torch.device("cuda", 0)
    assert placement.device_of("lm_head.weight") == CPU


@pytest.mark.parametrize(("device_map", "max_memory", "message"), [
    ({"0-2": "cpu"}, None, r"layers 3 of 4 have no device"),
    ({"0-2": "cpu", "2-3": "cpu"}, None, r"layer 2 is placed twice"),
    ({"0-9": "cpu"}, None, r"layers 0-9 lie outside the model's 0-3"),
    ({"first": "cpu"}, None, r"'first' is not a layer range"),
    ({"0-3": "gpu7"}, None, r"'gpu7' is not a device"),
    ("everywhere", None, r"choose null, auto, balanced, sequential or a mapping"),
    ("auto", {0: "lots"}, r"model.max_memory: 'lots' is not a size"),
    ("auto", [1, 2], r"model.max_memory: give a mapping of devices to sizes"),
])
def test_bad_maps_are_one_clear_line(target, device_map, max_memory, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(target.config, device_map, max_memory)


def test_max_memory_too_small_for_the_model_is_refused(llama70b):
    with pytest.raises(ValueError, match=r"model.max_memory \(60 GiB in all\) is too small for "
                                         r"this model's weights \(128.5 GiB in bfloat16\)"):
        plan_placement(llama70b, "auto", {0: "30GiB", 1: "30GiB"}, torch.bfloat16)
    with pytest.raises(ValueError, match=r"cuda:1 holds 63.8 GiB of weights .* given 40.0 GiB"):
        plan_placement(llama70b, {"0-39": 0, "40-79": 1}, {0: "80GiB", 1: "40GiB"},
                       torch.bfloat16, home="cuda:0")


def test_a_device_this_machine_lacks_is_refused_before_any_load():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    absent = Placement(CPU, (CPU, torch.device("cuda", count)))
    with pytest.raises(ValueError, match=rf"on cuda:{count}, but this machine has {count} CUDA"):
        check_present(absent)


def test_the_command_line_refuses_an_absent_device_in_one_line(tmp_path, monkeypatch, capsys):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    monkeypatch.chdir(tmp_path)
    code, _, err = run_script("eval/generate.py", [
        "model=tiny", "device=cpu", f"model.device_map={{0-1: cpu, 2-7: {count + 3}}}",
        "drafter=none"], monkeypatch, capsys)
    assert code == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: model.device_map places the model on cuda:{count + 3}")


# ---- a placed target -----------------------------------------------------------------------


def test_each_parameter_and_cache_layer_lies_where_the_plan_says(tmp_path, target):
    folder = tmp_path / "model"
    target.save_pretrained(folder)
    placement = plan_placement(target.config, {"0-1": "cpu", "2-3": "cpu"})
    placed = Transformer.from_pretrained(folder, placement=placement)
    assert placed.placement == placement
    for name, param in placed.named_parameters():
        assert param.device == placement.device_of(name), name
    cache = placed.new_cache(max_slots=32)
    for layer, device in enumerate(placement.layers):
        kv = torch.zeros(1, placed.config.num_kv_heads, 1, placed.config.head_dim)
        k, _ = cache.write(layer, kv, kv)
        assert k.device == device
    tokens = torch.tensor([PROMPTS[0]])
    positions = torch.arange(tokens.shape[1])
    torch.testing.assert_close(placed(tokens, positions).logits, target(tokens, positions).logits,
                               atol=1e-5, rtol=0)


def segmented_cache(target: Transformer, cut: int):
    """new_cache for `target` as a target placed over two devices builds it: layers [0, cut)
    and [cut, L) in caches of their own (both on the CPU here)."""

    def new_cache(batch_size: int = 1, max_slots: int | None = None, dtype=None):
        sizes = (batch_size, target.config.num_kv_heads, max_slots, target.config.head_dim)
        return SegmentedKVCache([(0, KVCache(cut, *sizes)),
                                 (cut, KVCache(LAYERS - cut, *sizes))])

    return new_cache


DRAFTERS = {
    "plain": lambda target: None,
    "ngram chain": lambda target: NgramDrafter(num_draft_tokens=4, max_ngram=3),
    "medusa tree": lambda target: MedusaDrafter(
        random_medusa_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2), seed=1),
        [[0], [1], [0, 0], [0, 1], [1, 0]]),
    "early exit": lambda target: EarlyExitDrafter(random_exit(target, 2, "adapter"), 3, None),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_cache_split_beside_its_layers_keeps_greedy_output(monkeypatch, target, plain_greedy,
                                                             drafter):
    monkeypatch.setattr(target, "new_cache", segmented_cache(target, cut=2))
    for prompt, expected in plain_greedy.items():
        result = generate(target, list(prompt), drafter=DRAFTERS[drafter](target),
                          max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected, drafter
        assert drafter == "plain" or result.stats.drafted > 0


def test_a_sliding_familys_split_cache_keeps_greedy_output(monkeypatch):
    """Gemma 3 (a window of WINDOW tokens on its even layers) with its cache split beside
    its layers: each part gives its key positions, trees and the early exit as one cache."""
    gemma = Transformer.from_hf(tiny_model("gemma3", 0, layers=LAYERS)).eval()
    expected = {tuple(p): generate(gemma, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}
    monkeypatch.setattr(gemma, "new_cache", segmented_cache(gemma, cut=1))
    for drafter in ("plain", "medusa tree", "early exit"):
        for prompt, tokens in expected.items():
            result = generate(gemma, list(prompt), drafter=DRAFTERS[drafter](gemma),
                              max_new_tokens=NEW_TOKENS)
            assert result.tokens == tokens, drafter


def test_a_planted_bug_a_commit_that_skips_a_segment_is_caught(monkeypatch, target,
                                                              plain_greedy):
    monkeypatch.setattr(target, "new_cache", segmented_cache(target, cut=2))

    def commit_first_part_only(self, accepted_slots):  # the later layers keep rejected rows
        self.parts[0].commit(torch.as_tensor(accepted_slots))

    monkeypatch.setattr(SegmentedKVCache, "commit", commit_first_part_only)
    # The later layers then attend to rejected rows: other tokens, or a cache that outgrew
    # the step's mask.
    with pytest.raises((AssertionError, RuntimeError)):
        for prompt, expected in plain_greedy.items():
            result = generate(target, list(prompt), drafter=DRAFTERS["ngram chain"](target),
                              max_new_tokens=NEW_TOKENS)
            assert result.tokens == expected


def test_a_placed_target_decodes_eagerly(target):
    placed = Transformer.from_hf(tiny_llama(0, layers=LAYERS))
    place(placed, Placement(CPU, (CPU,) * LAYERS))
    assert use_cuda_graphs(None, placed) is False and not placed.placement.spans_devices
    assert use_cuda_graphs(True, placed) is True  # one device: static steps as ever


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_tiny_target_split_between_cuda_and_the_cpu_gives_the_same_tokens(target,
                                                                               plain_greedy):
    placed = Transformer.from_hf(tiny_llama(0, layers=LAYERS))
    place(placed, plan_placement(placed.config, {"0-1": 0, "2-3": "cpu"}, home="cuda:0"))
    assert isinstance(placed.new_cache(max_slots=8), SegmentedKVCache)
    assert placed.layers[3].mlp.up_proj.weight.device == CPU
    for prompt, expected in plain_greedy.items():
        for drafter in DRAFTERS.values():
            result = generate(placed, list(prompt), drafter=drafter(placed),
                              max_new_tokens=NEW_TOKENS)
            assert result.tokens == expected


def test_the_config_keys_place_the_shipped_target_and_keep_its_tokens(cfg_of):
    from selfspec.from_config.models import load_target

    plain = load_target(cfg_of("generate", "model=tiny"))
    placed = load_target(cfg_of("generate", "model=tiny", "model.device_map={0-3: cpu, 4-7: cpu}"))
    assert placed.placement.layers == (CPU,) * 8 and plain.placement is None
    prompt = [1, 100, 200, 300, 400]
    assert (generate(placed, prompt, max_new_tokens=16).tokens
            == generate(plain, prompt, max_new_tokens=16).tokens)


def test_a_target_over_several_devices_refuses_a_batch_in_one_line():
    placed = Transformer.from_hf(tiny_llama(0, layers=LAYERS))
    placed.placement = Placement(CPU, (CPU, CPU, torch.device("meta"), torch.device("meta")))
    with pytest.raises(ValueError, match="placed over several devices .* decodes one prompt at "
                                         "a time"):
        generate(placed, [PROMPTS[0], PROMPTS[1]], max_new_tokens=4)


def test_a_moe_layer_is_placed_whole_with_its_experts(tmp_path):
    """Qwen3-MoE with a dense first layer: the plan counts each layer's own weights (experts
    included), and a placed model holds each layer's router and experts with the layer."""
    from selfspec.model.plan import _layer_params

    hf = tiny_model("qwen3_moe", 0, layers=LAYERS)
    hf.save_pretrained(tmp_path)
    config = Transformer.from_pretrained(tmp_path).config
    with torch.device("meta"):
        layers = Transformer(config).layers
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert _layer_params(config) == sizes and sizes[0] < sizes[1]
    placement = Placement(CPU, (CPU, CPU, torch.device("meta"), torch.device("meta")))
    placed = Transformer.from_pretrained(tmp_path, placement=placement)
    for name, param in placed.named_parameters():
        assert param.device == placement.device_of(name), name
    assert placed.layers[2].mlp.experts.gate_up_proj.device.type == "meta"
    assert placed.layers[1].mlp.gate.weight.device == CPU
