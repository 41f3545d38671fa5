"""EAGLE heads (heads/eagle.py): published parameter names, config errors, logits, TTT mask."""

import math

import pytest
import torch
from helpers import eagle_head_config, random_eagle_head

from selfspec.heads import EagleConfig, EagleHead
from selfspec.heads.eagle import default_target_layers, ttt_mask


def test_parameter_names_are_the_published_checkpoints(target):
    v1 = EagleHead(eagle_head_config(target, 1)).state_dict()
    layer = {f"layers.0.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "post_attention_layernorm.weight")}
    assert set(v1) == {"fc.weight", "fc.bias"} | layer  # no input norm, final norm, LM head
    assert v1["fc.weight"].shape == (32, 64)
    v3 = EagleHead(eagle_head_config(target, 3)).state_dict()
    mid = {n.replace("layers.0.", "midlayer.") for n in layer} | {
        "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"}
    assert set(v3) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | mid
    assert v3["fc.weight"].shape == (32, 96) and v3["lm_head.weight"].shape == (48, 32)
    assert v3["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # reads 2h
    assert v3["d2t"].dtype == torch.long and v3["t2d"].dtype == torch.bool


def test_config_errors_are_clear():
    sizes = {"hidden_size": 8, "vocab_size": 20, "intermediate_size": 16, "num_heads": 2,
             "num_kv_heads": 1, "head_dim": 4}
    with pytest.raises(ValueError, match="version must be 1 or 3"):
        EagleConfig(version=2, **sizes)
    with pytest.raises(ValueError, match="EAGLE-1 drafts over the full vocabulary"):
        EagleConfig(version=1, draft_vocab_size=10, **sizes)
    with pytest.raises(ValueError, match="fuses three target layers"):
        EagleConfig(version=3, draft_vocab_size=10, target_layers=(1, 2), **sizes)
    with pytest.raises(ValueError, match="draft_vocab_size 30 exceeds"):
        EagleConfig(version=3, draft_vocab_size=30, target_layers=(1, 2, 3), **sizes)
    assert default_target_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="pass target_layers explicitly"):
        default_target_layers(2)


def test_target_logits_put_draft_scores_at_their_target_ids(target):
    head = random_eagle_head(eagle_head_config(target, 3), seed=1)
    hidden = torch.randn(3, 32)
    draft = head.logits(hidden)  # [3, 48]
    full = head.target_logits(hidden)  # [3, 64]
    ids = head.draft_vocab.target_ids
    assert torch.equal(full[:, ids], draft)
    assert torch.isinf(full[:, ~head.t2d]).all()


def test_the_ttt_mask_is_causal_on_step_zero_and_diagonal_after():
    mask = ttt_mask(4, 2)
    assert mask.shape == (4, 12)
    assert torch.equal(mask[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(mask[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[:, 8:], torch.eye(4, dtype=torch.bool))


def test_head_logits_need_the_targets_lm_head_for_eagle1(target):
    head = EagleHead(eagle_head_config(target, 1))
    with pytest.raises(ValueError, match="pass lm_head=target.lm_head"):
        head.logits(torch.randn(2, 32))
    assert math.isclose(float(head.logits(torch.zeros(1, 32), target.lm_head).abs().sum()), 0.0)
