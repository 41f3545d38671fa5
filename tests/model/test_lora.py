"""LoRA adapters (lora.py): fresh ones change nothing, counts, settings, saving and merging."""

import copy

import pytest
import torch
from helpers import perturbed_lora, tiny_llama

from selfspec import Transformer
from selfspec.model.lora import (
    LINEAR_LAYERS,
    LoraSettings,
    add_lora,
    lora_parameter_count,
    merge_adapter,
    save_adapter,
)

TOKENS = torch.randint(2, 64, (3, 20), generator=torch.Generator().manual_seed(7))  # [B, T]
POSITIONS = torch.arange(TOKENS.shape[1])


def toy_target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


def test_fresh_adapters_leave_the_target_unchanged_and_only_they_train():
    base = toy_target()
    expected = base(TOKENS, POSITIONS).logits
    adapted = add_lora(copy.deepcopy(base), LoraSettings(rank=4))
    assert torch.equal(adapted(TOKENS, POSITIONS).logits, expected)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    # one A and one B per adapted linear layer, 2 layers x 7 linear layers
    assert len(trainable) == 2 * 2 * len(LINEAR_LAYERS)
    assert sum(p.numel() for n, p in adapted.named_parameters() if n in trainable) == (
        lora_parameter_count(base, LoraSettings(rank=4)))


def test_lora_parameters_are_counted_from_shapes_alone():
    with torch.device("meta"):  # as a dry run does: no weights
        model = Transformer(toy_target().config)
    settings = LoraSettings(rank=3, target_modules=("q_proj", "down_proj"))
    # hidden 32; q_proj 32 -> 32 (4 heads x 8); down_proj 64 -> 32; 2 layers
    assert lora_parameter_count(model, settings) == 2 * 3 * ((32 + 32) + (64 + 32))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"alpha": 0}, "alpha must be > 0"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\)"),
        ({"target_modules": ("lm_head",)}, r"\['lm_head'\] are not linear layers"),
    ],
)
def test_bad_lora_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSettings(**kwargs)


def test_a_saved_adapter_merges_into_a_plain_target(tmp_path):
    adapted = perturbed_lora(add_lora(toy_target(), LoraSettings(rank=4)))
    with torch.no_grad():
        expected = adapted(TOKENS, POSITIONS).logits
    save_adapter(adapted, tmp_path / "adapter")
    merged = merge_adapter(toy_target(), tmp_path / "adapter")
    assert type(merged) is Transformer
    got = merged(TOKENS, POSITIONS).logits
    assert (got - expected).abs().max() < 1e-4
    assert (got - toy_target()(TOKENS, POSITIONS).logits).abs().max() > 1e-2  # it did change


def test_merging_a_missing_or_foreign_adapter_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no LoRA adapter in .*adapter_config.json"):
        merge_adapter(toy_target(), tmp_path)
    save_adapter(add_lora(toy_target(), LoraSettings(rank=4)), tmp_path / "adapter")
    wider = Transformer.from_hf(tiny_llama(1, hidden=48))
    with pytest.raises(ValueError, match="does not fit this target.*load the target it was"):
        merge_adapter(wider, tmp_path / "adapter")
