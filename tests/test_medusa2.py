"""Medusa-2: LoRA adapters on the target (peft) trained jointly with the heads, the KL term to
the original target, adapter export and merge, and decoding against the adapted target."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from accelerate.state import AcceleratorState
from helpers import tiny_llama

from selfspec import Transformer, generate
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.heads import MedusaConfig, MedusaHeads
from selfspec.lora import (
    LINEAR_LAYERS,
    LoraSettings,
    add_lora,
    lora_parameter_count,
    merge_adapter,
    save_adapter,
)
from selfspec.losses import kl_to_teacher
from selfspec.objectives import Medusa2Objective
from selfspec.training import TokenRows, TrainSettings, fit, make_accelerator

TOKENS = torch.randint(2, 64, (3, 20), generator=torch.Generator().manual_seed(7))  # [B, T]
POSITIONS = torch.arange(TOKENS.shape[1])


def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


def perturbed(model, seed: int = 0, std: float = 0.05):
    """Random adapter B matrices (fresh ones are zero), so the adapted target differs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)
    return model


def medusa2(seed: int = 1) -> Medusa2Objective:
    base = target()
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(32, 64, num_heads=2)).init_from_lm_head(base.lm_head.weight)
    return Medusa2Objective(add_lora(base, LoraSettings(rank=4)), heads)


# ---- adapters -------------------------------------------------------------------------------


def test_fresh_adapters_leave_the_target_unchanged_and_only_they_train():
    base = target()
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
        model = Transformer(target().config)
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
    adapted = perturbed(add_lora(target(), LoraSettings(rank=4)))
    with torch.no_grad():
        expected = adapted(TOKENS, POSITIONS).logits
    save_adapter(adapted, tmp_path / "adapter")
    merged = merge_adapter(target(), tmp_path / "adapter")
    assert type(merged) is Transformer
    got = merged(TOKENS, POSITIONS).logits
    assert (got - expected).abs().max() < 1e-4
    assert (got - target()(TOKENS, POSITIONS).logits).abs().max() > 1e-2  # it did change


def test_merging_a_missing_or_foreign_adapter_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no LoRA adapter in .*adapter_config.json"):
        merge_adapter(target(), tmp_path)
    save_adapter(add_lora(target(), LoraSettings(rank=4)), tmp_path / "adapter")
    wider = Transformer.from_hf(tiny_llama(1, hidden=48))
    with pytest.raises(ValueError, match="does not fit this target.*load the target it was"):
        merge_adapter(wider, tmp_path / "adapter")


# ---- the loss ---------------------------------------------------------------------------------


def test_kl_to_teacher_matches_a_hand_computation_and_honours_the_mask():
    logits, teacher = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    p, q = teacher.softmax(-1), logits.softmax(-1)
    per_position = (p * (p.log() - q.log())).sum(-1)[:, :-1]  # position t predicts t + 1
    assert kl_to_teacher(logits, teacher).item() == pytest.approx(per_position.mean().item(),
                                                                  rel=1e-5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]])  # counts: (0, 0) and (1, 2)
    expected = (per_position[0, 0] + per_position[1, 2]) / 2
    assert kl_to_teacher(logits, teacher, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl_to_teacher(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_to_teacher(logits, teacher, torch.zeros(2, 4)).item() == 0.0
    with pytest.raises(ValueError, match=r"must both be \[B, T, V\]"):
        kl_to_teacher(logits, teacher[:, :3])


# ---- the objective ----------------------------------------------------------------------------


def test_the_objective_trains_heads_and_adapters_towards_the_original_target():
    objective = medusa2()
    perturbed(objective.target)
    original = target()  # an untouched copy: the teacher must be exactly this model
    out = objective(TOKENS, torch.ones_like(TOKENS))
    with torch.no_grad():
        adapted_logits = objective.target(TOKENS, POSITIONS).logits
        expected_kl = kl_to_teacher(adapted_logits, original(TOKENS, POSITIONS).logits)
    assert out.metrics["medusa/lm_kl"] == pytest.approx(float(expected_kl), rel=1e-5)
    assert out.metrics["medusa/lm_kl"] > 1e-4
    out.loss.backward()
    for name, param in objective.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name  # the target's own weights never train


def test_adapters_learn_at_a_fraction_of_the_heads_rate():
    objective = medusa2()
    heads, adapters = objective.param_groups(1e-3)
    assert heads["lr"] == 1e-3 and adapters["lr"] == pytest.approx(2.5e-4)
    assert {id(p) for p in heads["params"]} == {id(p) for p in objective.heads.parameters()}
    assert len(adapters["params"]) == 2 * 2 * len(LINEAR_LAYERS)
    with pytest.raises(ValueError, match="adapter_lr_scale must be > 0"):
        Medusa2Objective(objective.target, objective.heads, adapter_lr_scale=0.0)


@pytest.fixture
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)


def train_medusa2(run_dir, **overrides) -> Medusa2Objective:
    settings = TrainSettings(**{"run_dir": str(run_dir), "max_steps": 4, "micro_batch_size": 2,
                                "lr": 3e-3, "save_every": 2, **overrides})
    objective = medusa2()
    tokens = torch.randint(64, (16, 16), generator=torch.Generator().manual_seed(2))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    fit(objective, rows, None, settings, accelerator=make_accelerator(settings))
    AcceleratorState._reset_state(True)
    return objective


def test_an_interrupted_medusa2_run_resumes_to_the_same_heads_and_adapters(
    tmp_path, fresh_accelerate_state
):
    whole = train_medusa2(tmp_path / "whole")
    train_medusa2(tmp_path / "cut", stop_after=2)
    resumed = train_medusa2(tmp_path / "cut", resume=True)
    trained = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in trained.items())  # B moved
    # Exact, as in test_training.py: one process and thread count repeat the same float steps.
    for name, param in resumed.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, trained[name]), name


# ---- decoding with Medusa-2 heads ---------------------------------------------------------------


def test_greedy_with_medusa2_equals_plain_greedy_of_the_adapted_target(tmp_path):
    objective = medusa2()
    perturbed(objective.target, std=0.3)
    save_adapter(objective.target, tmp_path / "adapter")
    adapted, original = merge_adapter(target(), tmp_path / "adapter"), target()
    drafter = MedusaDrafter(objective.heads.eval(), [[0], [1], [0, 0], [0, 1], [1, 0]])
    differs = 0
    for prompt in ([5], [3, 9, 4, 11], [7, 8, 7, 8, 7, 8]):
        plain = generate(adapted, prompt, max_new_tokens=20).tokens
        assert generate(adapted, prompt, drafter=drafter, max_new_tokens=20).tokens == plain
        differs += plain != generate(original, prompt, max_new_tokens=20).tokens
    assert differs > 0  # the adapted target is another model: the check above could fail


def test_the_kl_term_pulls_a_drifted_adapted_target_back():
    objective = medusa2()
    perturbed(objective.target, std=0.2)
    objective.lm_weight = 100.0  # the KL term dominates the heads' loss
    adapters = [p for p in objective.target.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    kls = []
    for _ in range(20):
        out = objective(TOKENS, torch.ones_like(TOKENS))
        kls.append(out.metrics["medusa/lm_kl"])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert math.isfinite(kls[-1]) and kls[-1] < kls[0] / 4, kls
