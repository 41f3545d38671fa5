"""Memory plans built on the meta device."""

import pytest

from selfspec.model import ModelConfig
from selfspec.model.plan import count_parameters, plan_model

SMALL = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=40, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=4)


def small_param_count(c: ModelConfig, tied: bool = False) -> int:
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embeddings = c.vocab_size * c.hidden_size * (1 if tied else 2)
    return c.num_layers * layer + embeddings + c.hidden_size


def test_parameter_count_matches_the_formula_and_counts_tied_weights_once():
    assert count_parameters(SMALL) == small_param_count(SMALL)
    tied = ModelConfig(**{**vars(SMALL), "tie_word_embeddings": True})
    assert count_parameters(tied) == small_param_count(SMALL, tied=True)


def test_plan_memory_figures():
    plan = plan_model(SMALL, "small", num_gpus=3)
    n = small_param_count(SMALL)
    assert plan.num_params == n
    assert plan.weight_bytes == {"fp32": 4 * n, "bf16": 2 * n, "fp16": 2 * n, "int8": n}
    kv_values = 2 * 3 * 2 * 4 * 1024  # K and V x layers x KV heads x head_dim x tokens
    assert plan.kv_bytes_per_1k == {"bf16": 2 * kv_values, "fp32": 4 * kv_values}
    assert plan.zero3_bytes_per_gpu == -(-2 * n // 3)
    table = plan.format()
    assert f"{n:,}" in table and "ZeRO-3" in table and "3 GPUs" in table and "int8" in table


def test_plan_refuses_a_bad_gpu_count():
    with pytest.raises(ValueError, match="num_gpus must be an integer >= 1"):
        plan_model(SMALL, num_gpus=0)
