"""A quantized frozen target (model.quantize=int8|int4): every output is exact against it, heads
train on it (their gradients through its quantized LM head), and bad settings are one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    law_samples,
    run_trainer,
    sharegpt_file,
    three_layer_target,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import SmallModelDrafter
from selfspec.from_config.generation import generation_settings
from selfspec.from_config.methods.medusa import check_medusa_settings
from selfspec.from_config.models import load_target
from selfspec.from_config.sweeps import plan_sweep
from selfspec.model.quantized import QuantizedLinear, quantized_copy


def test_model_quantize_loads_the_targets_quantized_copy(cfg_of):
    fp32 = load_target(cfg_of("generate", "model=tiny"))
    for setting, bits in (("int8", 8), ("int4", 4)):
        target = load_target(cfg_of("generate", "model=tiny",
                                    f"model.quantize={setting}"))
        assert isinstance(target.lm_head, QuantizedLinear) and target.lm_head.bits == bits
        assert target.source == fp32.source  # its tokenizer is the target's
        prompt = [1, 5, 9, 40, 41]
        assert generate(target, prompt, max_new_tokens=4).tokens  # it decodes


@pytest.mark.parametrize("overrides, message", [
    (["model.quantize=int2"], "model.quantize: choose null, int8 or int4"),
    (["model.quantize=int8", "model.dtype=fp16"], "model.quantize=int8 quantizes an fp32 or bf16"),
    (["model.quantize=int4", "+compile=true"], "compile=true: a quantized target's products"),
    (["+compile=maybe"], "compile must be true or false"),
])
def test_bad_quantize_settings_are_refused_before_any_weights_load(cfg_of, monkeypatch,
                                                                   overrides, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the setting was checked")

    monkeypatch.setattr(Transformer, "from_pretrained", no_loading)
    with pytest.raises(ValueError, match=message):
        generation_settings(cfg_of("generate", "model=tiny", *overrides))
    with pytest.raises(ValueError, match=message):
        load_target(cfg_of("generate", "model=tiny", *overrides))


def test_methods_that_need_the_full_precision_target_refuse_a_quantized_one(cfg_of):
    cfg = cfg_of("sweep", "model=tiny", "model.quantize=int8", "methods=[hf_assisted]")
    with pytest.raises(ValueError, match="hf_assisted runs transformers' full-precision copy"):
        plan_sweep(cfg, 1)
    medusa2 = cfg_of("train_medusa", "model=tiny", "model.quantize=int8", "medusa.version=2")
    with pytest.raises(ValueError, match="medusa.version=2 trains LoRA adapters"):
        check_medusa_settings(medusa2)


@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_a_drafter_keeps_the_quantized_targets_law(bits, request):
    full = Transformer.from_hf(tiny_llama(0, vocab=64, layers=2, hidden=64)).eval()
    target = quantized_copy(full, bits)
    drafter = SmallModelDrafter(full, num_draft_tokens=2)  # the full model drafts for it
    assert_drafted_sampling_is_exact(target, drafter, SamplingParams(1.0), law_samples(request))


@pytest.mark.slow
def test_exit_adapters_train_through_a_quantized_lm_head(tmp_path, quick_build):
    model = three_layer_target(quick_build, tmp_path / "model")
    run_dir = tmp_path / "run"
    done = run_trainer(
        "early_exit", "model=local", f"model.path={model}", "model.quantize=int8",
        "train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
        "trainer.max_steps=4", "trainer.micro_batch_size=4", "trainer.seq_len=32",
        "trainer.save_every=4", "trainer.eval_every=4", "trainer.threads=1",
        "final_eval.num_prompts=2", "final_eval.max_new_tokens=12", "early_exit.exit_layers=[2]",
        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["E2/adapter/lossless"] is True
    assert f"tau {summary['E2/adapter/tau']:.2f}, speedup x" in done.stdout  # the report, its file
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and torch.isfinite(torch.tensor(losses)).all()
