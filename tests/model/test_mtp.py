"""MTP modules as configuration of the target (model/config.py, transformer.py's MtpModule,
checkpoint.py's layouts): the forward against the reference re-expressed from vLLM, each
checkpoint layout written and read back, config.json's keys, the random-weights preset."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mtp_reference import QWEN3_NEXT, mimo_forward, mtp_target, nextn_forward, qwen_mtp_forward
from safetensors.torch import load_file, save_file

from selfspec.model import ModelConfig, Transformer
from selfspec.model.loading import with_random_mtp
from selfspec.model.moe import MoE

TOKENS = torch.tensor([[3, 17, 42, 8, 8, 21, 5, 60, 33]])


def chained_outputs(target, index: int, hidden: torch.Tensor, steps: int = 2):
    """Module `index`'s outputs and logits over TOKENS, step 1 reading the target's hidden
    states and each later step its own outputs (tokens one further along each time)."""
    outs = []
    for step in range(steps):
        count = hidden.shape[1]
        next_tokens = TOKENS[:, 1 + step: 1 + step + count]
        hidden = hidden[:, : next_tokens.shape[1]]
        positions = torch.arange(next_tokens.shape[1])
        out = target.mtp_forward(index, target.embed_tokens(next_tokens), hidden, positions)
        outs.append((out[0], target.mtp_logits(index, out)[0]))
        hidden = out
    return outs


def reference_outputs(forward, hidden: torch.Tensor, steps: int = 2):
    outs = []
    for step in range(steps):
        next_tokens = TOKENS[0, 1 + step: 1 + step + hidden.shape[0]]
        hidden = hidden[: len(next_tokens)]
        out, logits = forward(next_tokens, hidden, torch.arange(len(next_tokens)))
        outs.append((out, logits))
        hidden = out
    return outs


@pytest.mark.parametrize("layout, modules, arch", [
    ("nextn", 2, {}), ("mtp", 1, {}), ("mimo", 2, {}),
    pytest.param("mtp", 1, QWEN3_NEXT, id="qwen3_next")])  # its gated layer, (1 + w) norms
def test_the_forward_matches_the_reference_from_vllm(tmp_path, layout, modules, arch):
    target = mtp_target(layout, seed=1, modules=modules, **arch)
    folder = target.save_pretrained(tmp_path / layout)
    weights = load_file(str(folder / "model.safetensors"))  # the checkpoint's own names
    with torch.no_grad():
        hidden = target(TOKENS, torch.arange(TOKENS.shape[1])).last_hidden  # [1, T, h]
        for index in range(modules):
            ours = chained_outputs(target, index, hidden)
            if layout in ("nextn", "mimo"):
                def forward(*args, index=index, layout=layout):
                    reference = nextn_forward if layout == "nextn" else mimo_forward
                    return reference(weights, target.config, index, *args)
            else:
                def forward(*args):
                    return qwen_mtp_forward(weights, target.config, *args)
            for (out, logits), (ref_out, ref_logits) in zip(
                    ours, reference_outputs(forward, hidden[0]), strict=True):
                torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert ours[0][1].std() > 1  # peaky laws: a wrong weight is far off


@pytest.mark.parametrize("layout, family, names", [
    ("nextn", "llama", ["model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                        "model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight",
                        "model.layers.2.shared_head.head.weight",
                        "model.layers.2.embed_tokens.weight",
                        "model.layers.2.self_attn.q_proj.weight",
                        "model.layers.3.mlp.down_proj.weight"]),
    ("mtp", "qwen3", ["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                      "mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_norm.weight",
                      "mtp.layers.0.mlp.up_proj.weight"]),
    ("mimo", "qwen2", ["model.mtp_layers.1.token_layernorm.weight",
                       "model.mtp_layers.0.hidden_layernorm.weight",
                       "model.mtp_layers.0.input_proj.weight",
                       "model.mtp_layers.1.final_layernorm.weight",
                       "model.mtp_layers.0.self_attn.q_proj.bias",
                       "model.mtp_layers.1.mlp.gate_proj.weight"]),
    ("nextn", "qwen3_moe", ["model.layers.2.mlp.experts.3.gate_proj.weight",
                            "model.layers.2.mlp.gate.weight", "model.layers.2.eh_proj.weight"]),
])
def test_a_folder_in_each_layout_round_trips(tmp_path, layout, family, names):
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "expert_intermediate_size": 16} \
        if family == "qwen3_moe" else {}
    modules = 2 if family in ("llama", "qwen2") else 1
    target = mtp_target(layout, seed=2, family=family, modules=modules, **extra)
    folder = target.save_pretrained(tmp_path / "saved")
    stored = load_file(str(folder / "model.safetensors"))
    assert set(names) <= set(stored)
    assert not [name for name in stored if ".mtp." in name or "block." in name]
    hf_config = json.loads((folder / "config.json").read_text())
    key = "mtp_num_hidden_layers" if layout == "mtp" else "num_nextn_predict_layers"
    assert hf_config[key] == modules
    loaded = Transformer.from_pretrained(folder)
    assert loaded.config == target.config
    assert isinstance(loaded.mtp[0].block.mlp, MoE) == bool(extra)
    with torch.no_grad():
        positions = torch.arange(TOKENS.shape[1])
        mine, theirs = target(TOKENS, positions), loaded(TOKENS, positions)
        torch.testing.assert_close(theirs.logits, mine.logits, atol=0, rtol=0)
        for index in range(modules):
            for a, b in zip(chained_outputs(target, index, mine.last_hidden),
                            chained_outputs(loaded, index, theirs.last_hidden), strict=True):
                torch.testing.assert_close(b[1], a[1], atol=0, rtol=0)


def test_config_json_names_the_modules_and_bad_settings_are_refused():
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert ModelConfig.from_hf(base).mtp_modules == 0
    nextn = ModelConfig.from_hf(base | {"num_nextn_predict_layers": 1})
    assert (nextn.mtp_modules, nextn.mtp_layout) == (1, "nextn")
    qwen = ModelConfig.from_hf(base | {"mtp_num_hidden_layers": 1})
    assert (qwen.mtp_modules, qwen.mtp_layout) == (1, "mtp")
    assert ModelConfig.from_hf(qwen.to_hf()) == qwen
    assert "mtp" not in repr(ModelConfig.from_hf(base))  # caches keyed by repr stay valid
    assert qwen.cut(1).mtp_modules == 0
    with pytest.raises(ValueError, match="mtp_layout must be one of nextn, mtp"):
        ModelConfig.from_hf(base).__class__(**{**vars(nextn), "mtp_layout": None})
    with pytest.raises(ValueError, match="share one fc and norms: mtp_modules must be 1"):
        ModelConfig.from_hf(base | {"mtp_num_hidden_layers": 2})


def test_a_target_cut_for_a_draft_model_leaves_the_modules_out():
    target = mtp_target("nextn", seed=3)
    first = target.first_layers(1)
    assert first.config.mtp_modules == 0 and len(first.mtp) == 0


def random_mtp_spec(weights: bool):
    from omegaconf import OmegaConf

    from selfspec.from_config.models import target_spec

    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "random-mtp.yaml"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf), "device": "cpu", "seed": 3})
    return target_spec(cfg, weights)


def test_the_random_preset_names_a_module_made_seeded():
    """The preset's arch names a NextN layer; its random weights are seeded (normal, std 0.02,
    as transformers initialises a linear layer), the decoder's left as they are."""
    config = random_mtp_spec(weights=False).config
    assert (config.mtp_modules, config.mtp_layout) == (1, "nextn")
    base = replace(config, mtp_modules=0, mtp_layout=None)
    decoder = Transformer(base)
    one = with_random_mtp(decoder, config, seed=3)
    assert one.config == config and len(one.mtp) == 1
    two = with_random_mtp(Transformer(base), config, seed=3)
    torch.testing.assert_close(one.mtp[0].proj.weight, two.mtp[0].proj.weight, atol=0, rtol=0)
    assert 0.015 < one.mtp[0].proj.weight.std() < 0.025  # transformers' std, not a default
    assert torch.equal(one.mtp[0].norm.weight, torch.ones(64))  # norms at their identity


@pytest.mark.slow  # transformers builds the decoder twice
def test_the_random_preset_loads_with_seeded_modules():
    from selfspec.model.loading import load

    spec = random_mtp_spec(weights=True)
    one, two = load(spec), load(spec)
    assert one.config.mtp_modules == 1 and one.config.mtp_layout == "nextn"
    torch.testing.assert_close(one.mtp[0].proj.weight, two.mtp[0].proj.weight, atol=0, rtol=0)


def test_a_config_that_counts_modules_the_weights_lack_loads_without_them(tmp_path):
    """DeepSeek-V3's config.json counts a NextN layer even where transformers saved the folder
    (its classes drop the layer): the target loads without modules, and drafts none."""
    target = mtp_target("nextn", seed=4)
    folder = target.save_pretrained(tmp_path / "saved")
    stored = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in stored.items() if not k.startswith("model.layers.2.")},
              str(folder / "model.safetensors"))
    loaded = Transformer.from_pretrained(folder)
    assert (loaded.config.mtp_modules, loaded.config.mtp_layout, len(loaded.mtp)) == (0, None, 0)
    with torch.no_grad():
        positions = torch.arange(TOKENS.shape[1])
        torch.testing.assert_close(loaded(TOKENS, positions).logits,
                                   target(TOKENS, positions).logits, atol=0, rtol=0)


def test_the_plans_count_the_modules_with_the_home_devices_weights():
    from selfspec.model.plan import _home_params, _model_bytes, count_parameters

    config = mtp_target("nextn", family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                        expert_intermediate_size=16).config
    without = replace(config, mtp_modules=0, mtp_layout=None)
    assert _model_bytes(config, torch.float32) == 4 * count_parameters(config)
    added = count_parameters(config) - count_parameters(without)
    assert added > 0 and _home_params(config) - _home_params(without) == added
