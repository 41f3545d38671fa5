"""Architectures read from Hugging Face configs (model/config.py): families, RoPE scalings."""

import dataclasses

import pytest
from helpers import HF_TINY, family_config
from transformers import LlamaConfig

from selfspec.model import ModelConfig


def test_unsupported_model_type_and_rope_scaling():
    base = LlamaConfig(**HF_TINY).to_dict()
    with pytest.raises(ValueError, match=r"^unsupported model_type 'gpt2'; supported: llama, "
                                         r"mistral, qwen2, qwen3, gemma3_text, gemma2"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="'dynamic'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    legacy = {
        **base,
        "rope_parameters": None,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = ModelConfig.from_hf(legacy)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


ALL_FAMILIES = ("llama", "qwen3", "gemma3", "gemma2", "olmo2", "granite", "phi3", "qwen3_moe",
                "mixtral", "gpt_oss")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_round_trips_through_config_json(family):
    """Read from transformers' config, written back, read again: the same architecture, and
    transformers' own config class reads what we write as the same one."""
    from transformers import AutoConfig

    config = ModelConfig.from_hf(family_config(family).to_dict())
    written = config.to_hf()
    assert ModelConfig.from_hf(written) == config
    theirs = AutoConfig.for_model(**written)
    assert type(theirs) is type(family_config(family))
    assert ModelConfig.from_hf(theirs.to_dict()) == config


def test_a_config_its_family_cannot_express_is_refused():
    llama = ModelConfig.from_hf(family_config("llama").to_dict())
    with pytest.raises(ValueError, match=r"a llama config.json cannot express qk_norm='head'"):
        dataclasses.replace(llama, qk_norm="head").to_hf()
    with pytest.raises(ValueError, match="a llama config.json has no sliding window"):
        dataclasses.replace(llama, sliding_window=4).to_hf()
    gemma = ModelConfig.from_hf(family_config("gemma3").to_dict())
    with pytest.raises(ValueError, match=r"cannot express embedding_multiplier=1\.0"):
        dataclasses.replace(gemma, embedding_multiplier=1.0).to_hf()


def test_a_mixture_of_experts_only_where_the_family_has_one():
    llama = ModelConfig.from_hf(family_config("llama").to_dict())
    with pytest.raises(ValueError, match="a llama config.json has no experts"):
        dataclasses.replace(llama, num_experts=4, num_experts_per_tok=2).to_hf()
    mixtral = ModelConfig.from_hf(family_config("mixtral").to_dict())
    with pytest.raises(ValueError, match=r"cannot express norm_topk_prob=False"):
        dataclasses.replace(mixtral, norm_topk_prob=False).to_hf()
    with pytest.raises(ValueError, match=r"cannot express mlp_only_layers=\(0,\)"):
        dataclasses.replace(mixtral, mlp_only_layers=(0,)).to_hf()
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1\.\.num_experts "
                                         r"\(8\), got 9"):
        dataclasses.replace(mixtral, num_experts_per_tok=9)


def test_qwen3_moe_reads_its_published_keys_and_dense_layers():
    """Published Qwen3-MoE configs say num_experts (transformers writes num_local_experts);
    without norm_topk_prob the top k are not renormalised; decoder_sparse_step and
    mlp_only_layers leave dense layers among the sparse ones; a window covers every layer
    when use_sliding_window."""
    published = {**family_config("qwen3_moe", layers=6).to_dict(), "num_experts": 16,
                 "decoder_sparse_step": 2, "mlp_only_layers": [3], "use_sliding_window": True,
                 "sliding_window": 5}
    del published["num_local_experts"], published["norm_topk_prob"]
    config = ModelConfig.from_hf(published)
    assert (config.num_experts, config.norm_topk_prob) == (16, False)
    assert config.moe_layers == {1, 5} and config.sliding_layers == set(range(6))
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_quantized_weights_are_refused_naming_the_fix():
    gpt_oss = {**family_config("gpt_oss").to_dict(),
               "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match=r"^the weights are quantized \(mxfp4\); dequantize "
                                         r"them with transformers first.*Mxfp4Config\(dequantize"):
        ModelConfig.from_hf(gpt_oss)


def test_configs_written_before_layer_types_get_transformers_defaults():
    """Gemma 3's sliding_window_pattern (every sixth layer full), Gemma 2's alternation,
    Qwen's max_window_layers, a window off unless use_sliding_window, and none for Llama."""
    gemma3 = family_config("gemma3", layers=7).to_dict()
    del gemma3["layer_types"]
    assert ModelConfig.from_hf(gemma3).sliding_layers == {0, 1, 2, 3, 4, 6}
    gemma2 = family_config("gemma2", layers=4).to_dict()
    del gemma2["layer_types"]
    assert ModelConfig.from_hf(gemma2).sliding_layers == {0, 2}
    qwen = family_config("qwen3", layers=4).to_dict() | {"sliding_window": 8}
    del qwen["layer_types"]
    assert not ModelConfig.from_hf(qwen).sliding_layers
    on = ModelConfig.from_hf(qwen | {"use_sliding_window": True, "max_window_layers": 1})
    assert on.sliding_layers == {1, 2, 3} and on.sliding_window == 8
    llama = family_config("llama").to_dict() | {"sliding_window": 8}
    assert ModelConfig.from_hf(llama).sliding_window is None


def test_gemma3_reads_the_older_rope_keys():
    old = family_config("gemma3").to_dict()
    del old["rope_parameters"]
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = ModelConfig.from_hf(old)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.local_rope_scaling is None


def test_a_config_of_the_original_families_reads_as_it_did():
    """Caches are keyed by a config's repr (`weights_fingerprint`: the shipped SmolLM2 answers
    among them): family fields at their defaults are left out of it."""
    config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=4)
    assert repr(config) == (
        "ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, "
        "num_heads=1, num_kv_heads=1, head_dim=4, rope_theta=10000.0, rope_scaling=None, "
        "rms_norm_eps=1e-05, max_position_embeddings=2048, tie_word_embeddings=False, "
        "attention_bias=False, attention_out_bias=False, mlp_bias=False, model_type='llama', "
        "bos_token_id=None, eos_token_ids=())")
    windowed = dataclasses.replace(config, model_type="mistral", sliding_window=4)
    assert repr(windowed).endswith("eos_token_ids=(), sliding_window=4)")
