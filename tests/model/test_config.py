"""Architectures read from Hugging Face configs (model/config.py): families, RoPE scalings."""

import pytest
from helpers import HF_TINY
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
