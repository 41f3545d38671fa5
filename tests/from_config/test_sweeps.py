"""Sweep configs (from_config/sweeps.py): bench configs, auto points, random-weight targets."""

import pytest
import torch
from helpers import group_options, toy
from omegaconf import OmegaConf

from selfspec.from_config import sweeps
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import ModelNotAvailable, model_config, resolve_model_path
from selfspec.from_config.sweeps import plan_sweep, timing_models


@pytest.mark.parametrize("name", group_options("bench"))
def test_every_bench_config_composes(cfg_of, name):
    bench = cfg_of("generate", f"+bench={name}").bench
    assert {"max_new_tokens", "num_prompts", "repeats", "warmup"} <= bench.keys()


def test_auto_points_follow_each_of_our_methods_with_its_fixed_lengths(quick_build, cfg_of,
                                                                       heads_dir):
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[ngram,hf_prompt_lookup,medusa]",
                 f"medusa_heads={heads_dir}", "tree=chain4", "num_draft_tokens=[1,2,4,auto]",
                 "samplings=[greedy]")
    auto = [(p.method, p.candidates) for p in plan_sweep(cfg, 1).grid.points()
            if p.auto]
    assert auto == [("ngram", (1, 2, 4)), ("medusa", (1, 2))]  # no auto row for HF's peers


def test_a_missing_draft_model_is_refused_before_loading(tmp_path, quick_build, cfg_of):
    cfg = cfg_of("sweep", *toy(quick_build, draft="missing"), "methods=[hf_assisted]",
                 f"run_dir={tmp_path}")
    with pytest.raises(ModelNotAvailable, match="model.draft.path"):
        plan_sweep(cfg, 2)


# ---- the random-weights target of timings ----------------------------------------------------


def random_config(preset: str = "random-7b", **arch):
    """conf/model/<preset>.yaml shrunk to a toy of the same kind."""
    cfg = OmegaConf.create({"model": OmegaConf.load(CONF_DIR / f"model/{preset}.yaml"),
                            "device": "cpu", "seed": 3})
    cfg.model.dtype = "fp32"
    cfg.model.arch.update(arch)
    return cfg


def test_a_random_weights_target_shares_its_weights_with_its_transformers_twin():
    cfg = random_config(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2)
    target, hf_model = timing_models(cfg)
    tokens = torch.randint(80, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = target(tokens, torch.arange(9)).logits, hf_model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert target.embed_tokens.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    again, _ = timing_models(cfg)  # seeded: the same weights again
    assert torch.equal(again.lm_head.weight, target.lm_head.weight)
    with pytest.raises(ModelNotAvailable, match="random weights and no files"):
        resolve_model_path(cfg.model)


def test_the_random_moe_target_is_qwen3_30b_a3b_at_half_depth():
    """Its preset's architecture: 15.6B parameters (31 GB in bf16), every layer sparse; shrunk,
    it builds with its transformers twin and gives the same logits."""
    from selfspec.model.plan import count_parameters

    full = model_config(random_config("random-moe").model)
    assert full.model_type == "qwen3_moe" and full.moe_layers == set(range(24))
    assert abs(count_parameters(full) / 15.58e9 - 1) < 0.01
    cfg = random_config("random-moe", vocab_size=80, hidden_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8,
                        num_experts_per_tok=2, expert_intermediate_size=16)
    target, hf_model = timing_models(cfg)
    tokens = torch.randint(80, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = target(tokens, torch.arange(9)).logits, hf_model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_the_dry_run_plans_the_draft_model_only_for_a_method_that_runs_it(cfg_of, monkeypatch):
    """A method's `runs_draft_model` (small_model, hf_assisted) decides whether the sweep's dry
    run plans model.draft beside the target (the plans themselves: tests/model/test_placement.py;
    here they are stand-ins, to skip building a 70B model on meta tensors)."""
    class Plan:
        def __init__(self, name: str):
            self.name = name

        def format(self) -> str:
            return f"plan for {self.name}"

    monkeypatch.setattr(sweeps, "model_plan", lambda cfg: Plan(cfg.model.name))
    monkeypatch.setattr(sweeps, "plan_model", lambda config, name, gpus: Plan(name))

    def plan(methods: str) -> str:
        return sweeps.sweep_dry_run(cfg_of("sweep", "model=llama2-70b", f"methods={methods}"))

    assert plan("[ngram,hf_assisted]").splitlines()[-1] == "plan for llama2-7b"
    assert plan("[small_model]").splitlines()[-1] == "plan for llama2-7b"
    assert plan("[ngram,hf_prompt_lookup]") == "plan for llama2-70b"
