"""A hybrid target (Qwen3-Next, Qwen3.5: Gated DeltaNet layers among gated full-attention
layers, 3:1) as configuration of the one decoder: loaded from a folder transformers'
Qwen3NextForCausalLM or Qwen3_5ForCausalLM saved, in parity with it (logits, cached steps,
greedy), written back, its cache's state."""

import json

import pytest
import torch

from selfspec import generate
from selfspec.model import ModelConfig, Transformer
from selfspec.model.recurrent_cache import HybridCache

transformers = pytest.importorskip("transformers", reason="pip install transformers")
pytest.importorskip("transformers.models.qwen3_next", reason="pip install 'transformers>=5'")

TOKENS = torch.tensor([[3, 17, 42, 8, 8, 21, 5, 60, 33, 9, 12]])


def hf_qwen3_next(seed: int = 0, family: str = "qwen3_next"):
    """A tiny random Qwen3NextForCausalLM, or Qwen3_5ForCausalLM (fp32): layers 0-2 linear
    attention, 3 full."""
    if family.startswith("qwen3_next"):
        kind, model_class = transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM
        extra = {"num_experts": 0}
        if family == "qwen3_next_moe":  # a dense layer among sparse ones with a shared expert
            extra = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                     "shared_expert_intermediate_size": 24, "mlp_only_layers": [1]}
    else:  # half of each head rotated, by the text's share of its multimodal sections
        kind, model_class = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
        extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True}}
    config = kind(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16 if extra.get(
            "rope_parameters") else 8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, max_position_embeddings=256, **extra)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):  # the decay keeps its own init
                parameter.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text",
                                        pytest.param("qwen3_next_moe", marks=pytest.mark.slow)])
def hybrid(request, tmp_path_factory):
    """(ours loaded from the folder transformers saved, transformers' model)."""
    hf = hf_qwen3_next(family=request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return Transformer.from_pretrained(folder), hf


@torch.no_grad()
def test_a_saved_folder_loads_with_transformers_logits(hybrid):
    ours, hf = hybrid
    config = ours.config
    assert config.linear_layers == {0, 1, 2} and config.attention_output_gate
    assert config.norm_scale == "one_plus_weight"
    assert config.linear_split_projections == (config.model_type == "qwen3_5_text")
    assert config.partial_rotary_factor == (0.5 if config.linear_split_projections else 0.25)
    assert (config.moe_layers, config.shared_expert_intermediate_size) in \
        ((frozenset(), 0), ({0, 2, 3}, 24))
    expected = hf(TOKENS).logits
    got = ours(TOKENS, torch.arange(TOKENS.shape[1])).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.5  # a wrong weight would be far off


@torch.no_grad()
def test_cached_steps_give_the_full_forwards_logits(hybrid):
    """A prefill, then one-token steps and a four-token step through the hybrid cache,
    against transformers' forward over the whole sequence."""
    ours, hf = hybrid
    expected = hf(TOKENS).logits[0]
    cache = ours.new_cache(max_slots=32)
    assert isinstance(cache, HybridCache)
    steps = [ours(TOKENS[:, :4], torch.arange(4), cache).logits[0]]
    for i in range(4, 7):
        steps.append(ours(TOKENS[:, i:i + 1], torch.tensor([i]), cache).logits[0])
    steps.append(ours(TOKENS[:, 7:], torch.arange(7, 11), cache).logits[0])
    torch.testing.assert_close(torch.cat(steps), expected, atol=1e-4, rtol=1e-4)
    assert cache.length == 11


@pytest.mark.slow  # transformers' generate
@torch.no_grad()
def test_greedy_decoding_matches_transformers_generate(hybrid):
    ours, hf = hybrid
    prompt = TOKENS[0, :5].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, prompt, max_new_tokens=12).tokens == expected


@pytest.mark.slow  # transformers' from_pretrained
def test_the_config_round_trips_and_transformers_reads_our_folder(hybrid, tmp_path):
    ours, hf = hybrid
    written = ours.config.to_hf()
    assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert ModelConfig.from_hf(written) == ours.config
    folder = ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits)


@pytest.mark.slow  # a third transformers model
@torch.no_grad()
def test_a_mixture_of_experts_with_a_shared_expert_matches_transformers():
    """Qwen3-Next's sparse layers: routed experts plus a shared expert scaled by its gate."""
    hf = hf_qwen3_next(family="qwen3_next_moe")
    ours = Transformer.from_hf(hf)
    assert hasattr(ours.layers[0].mlp, "shared_expert")
    expected = hf(TOKENS).logits
    torch.testing.assert_close(ours(TOKENS, torch.arange(TOKENS.shape[1])).logits, expected,
                               atol=1e-4, rtol=1e-4)
    without_shared = ours.layers[0].mlp.shared_expert.down_proj.weight
    without_shared.zero_()
    assert not torch.allclose(ours(TOKENS, torch.arange(TOKENS.shape[1])).logits, expected,
                              atol=1e-3)


def test_impossible_widths_and_misplaced_fields_are_refused(tmp_path):
    config = hf_qwen3_next().config.to_dict()
    with pytest.raises(ValueError, match="linear-attention layers need"):
        ModelConfig.from_hf(config | {"linear_num_key_heads": 0})
    (tmp_path / "config.json").write_text(json.dumps(config | {"linear_value_head_dim": 0}))
    with pytest.raises(ValueError, match="config.json: linear-attention layers need"):
        ModelConfig.from_folder(tmp_path)
    qwen3 = ModelConfig.of_family(model_type="qwen3", vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=8, shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="qwen3 config.json cannot express"):
        qwen3.to_hf()


def test_plans_size_each_kind_of_layer_and_only_the_attention_layers_cache():
    """A memory plan counts a linear-attention layer, a full one and a sparse one apart (a
    placement weighs each), and K/V for the attention layers alone."""
    from selfspec.model.plan import _home_params, _layer_params, count_parameters, plan_model

    config = ModelConfig.from_hf(hf_qwen3_next(family="qwen3_next_moe").config.to_dict())
    sizes = _layer_params(config)
    assert sum(sizes) + _home_params(config) == count_parameters(config)
    assert len(set(sizes)) == 3  # sparse linear (0, 2), dense linear (1), sparse full (3)
    kv = 2 * 1 * config.num_kv_heads * config.head_dim * 1024 * 2  # one attention layer, bf16
    assert plan_model(config).kv_bytes_per_1k["bf16"] == kv


def random_hybrid_spec(weights: bool):
    from pathlib import Path

    from omegaconf import OmegaConf

    from selfspec.from_config.models import target_spec

    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "random-hybrid.yaml"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf), "device": "cpu", "seed": 3})
    return target_spec(cfg, weights)


def test_the_random_preset_is_a_qwen3_next_with_its_mtp_module():
    config = random_hybrid_spec(weights=False).config
    assert config.model_type == "qwen3_next" and config.linear_layers == {0, 1, 2}
    assert (config.mtp_modules, config.mtp_layout) == (1, "mtp")


@pytest.mark.slow  # transformers builds the decoder
def test_the_random_preset_loads_and_its_mtp_module_drafts_losslessly():
    from selfspec.drafters.mtp import MtpDrafter
    from selfspec.model.loading import load

    target = load(random_hybrid_spec(weights=True))
    prompt = [5, 6, 7, 5, 6, 7]
    plain = generate(target, prompt, max_new_tokens=16).tokens
    drafted = generate(target, prompt, drafter=MtpDrafter(target, tree=[[0], [0, 0]]),
                       max_new_tokens=16)
    assert drafted.tokens == plain and drafted.stats.drafted > 0


@pytest.mark.slow  # transformers builds the vision tower too (3-4 s)
@torch.no_grad()
def test_a_qwen3_5_image_text_folder_loads_its_text_decoder(tmp_path):
    """Qwen3.5 ships as an image-text model (`Qwen3_5ForConditionalGeneration`: the decoder
    under `model.language_model.`, a vision tower, a nested `text_config`): its text decoder
    loads alone, with the logits transformers gives a text-only input."""
    text = hf_qwen3_next(family="qwen3_5_text").config.to_dict()
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": 32, "patch_size": 4, "temporal_patch_size": 2,
              "spatial_merge_size": 2}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(1)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    for name, parameter in hf.named_parameters():
        if not name.endswith(("A_log", "dt_bias")):
            parameter.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path)
    assert ours.config.model_type == "qwen3_5_text" and ours.config.linear_split_projections
    torch.testing.assert_close(ours(TOKENS, torch.arange(TOKENS.shape[1])).logits,
                               hf(input_ids=TOKENS).logits, atol=1e-4, rtol=1e-4)
