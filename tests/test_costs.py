"""The cost profile c(N) of target forwards, and the oracle drafter that sets the loop's
ceiling: a perfect draft accepted in full, so its speedup can be held against tau / c(k+1)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from omegaconf import OmegaConf

from selfspec import SamplingParams, decode, from_config, generate
from selfspec.measure.costs import CostProfile, covering_lengths, measure_cost_profile
from selfspec.measure.floor import FloorSettings, measure_floor
from selfspec.measure.oracle import OracleDrafter
from selfspec.measure.passes import compare_with_plain
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


def test_c_is_relative_to_one_token_and_takes_the_next_measured_length():
    profile = CostProfile({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}, 200, "cpu", "float32")
    assert profile.c(1) == 1.0 and profile.c(4) == pytest.approx(1.6)
    assert profile.c(3) == pytest.approx(1.6)  # not measured: the next length above
    assert profile.bound(tau=3.2, nodes=3) == pytest.approx(3.2 / 1.6)  # a forward over 4
    assert profile.bound(tau=3.2, nodes=3, draft_cost=0.4) == pytest.approx(3.2 / 2.0)
    assert profile.as_dict()["c"][8] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="measured up to N=8, not 9"):
        profile.c(9)


def test_the_bound_of_steps_of_several_sizes_takes_the_mean_forward_cost():
    profile = CostProfile({1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}, 200, "cpu", "float32")
    # 2 steps without a draft (c(1) = 1), 1 of one node (c(2) = 1.2), 1 of three (c(4) = 1.6)
    assert profile.bound(2.0, [2, 1, 0, 1], draft_cost=0.1) == pytest.approx(
        2.0 / ((2 * 1.0 + 1.2 + 1.6) / 4 + 0.1))
    assert profile.bound(2.5, [0, 0, 0, 7]) == pytest.approx(profile.bound(2.5, 3))
    assert profile.bound(1.0, [5]) == 1.0  # plain decoding
    with pytest.raises(ValueError, match="count steps by draft size"):
        profile.bound(1.0, [])


@pytest.mark.parametrize("tokens, lengths", [
    (1, (1,)), (5, (1, 2, 3, 4, 5)), (16, tuple(range(1, 17))),
    (20, (*range(1, 17), 24)), (64, (*range(1, 17), 24, 32, 48, 64)),
    (300, (*range(1, 17), 24, 32, 48, 64)),  # capped at 64 tokens
])
def test_covering_lengths_reach_every_forward_a_sweep_verifies(tokens, lengths):
    assert covering_lengths(tokens) == lengths


def test_the_profile_times_every_length_and_leaves_the_target_as_it_was(target):
    tokens = torch.randint(96, (1, 12), generator=torch.Generator().manual_seed(1))
    before = target(tokens, torch.arange(12)).logits
    profile = measure_cost_profile(target, (2, 5), cache_length=16, repeats=2, warmup=1)
    assert sorted(profile.seconds) == [1, 2, 5] and all(s > 0 for s in profile.seconds.values())
    assert profile.c(1) == 1.0 and profile.device == "cpu" and profile.dtype == "float32"
    assert torch.equal(target(tokens, torch.arange(12)).logits, before)
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_cost_profile(target, (2,), repeats=0)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_oracle_is_accepted_in_full_and_lossless(target, k):
    prompt = [3, 17, 5, 9]
    plain = generate(target, prompt, max_new_tokens=20)
    oracle = generate(target, prompt, drafter=OracleDrafter(k), max_new_tokens=20)
    assert oracle.tokens == plain.tokens
    assert oracle.stats.accepted == oracle.stats.drafted  # every proposed token is kept
    # each step yields k + 1 tokens until the last, which may be cut by max_new_tokens
    assert oracle.stats.steps == -(-20 // (k + 1))


def test_a_prepared_oracle_replays_its_answers_without_generating_again(target, monkeypatch):
    """The answers are computed by prepare, ahead of any timing: the timed generation that
    replays them runs no second greedy generation inside begin."""
    prompt, oracle = [3, 17, 5, 9], OracleDrafter(1)
    oracle.prepare(target, [prompt], 20)
    plain = generate(target, prompt, max_new_tokens=20).tokens

    def no_second_generation(*args, **kwargs):
        raise AssertionError("the oracle generated again inside a timed generation")

    monkeypatch.setattr(decode, "generate", no_second_generation)
    for k in (1, 4):
        replay = generate(target, prompt, drafter=oracle.with_draft_tokens(k),
                           max_new_tokens=20)
        assert replay.tokens == plain and replay.stats.accepted == replay.stats.drafted


def test_a_training_report_line_says_where_the_drafters_time_went(target):
    comparison = compare_with_plain(target, OracleDrafter(2), [[3, 17, 5, 9]], max_new_tokens=8)
    assert comparison.lossless is True
    assert comparison.time_split["verify"]["share"] >= 0
    line = comparison.describe("toy")
    assert "; time: prefill " in line and " forward " in line and " other " in line


def test_the_oracle_refuses_sampling_and_bad_lengths(target):
    with pytest.raises(ValueError, match="replays greedy decoding"):
        generate(target, [3, 4], drafter=OracleDrafter(2), sampling=SamplingParams(1.0),
                 max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        OracleDrafter(0)


def random_config(**arch):
    """conf/model/random-7b.yaml shrunk to a toy of the same kind."""
    cfg = OmegaConf.create({"model": OmegaConf.load(from_config.CONF_DIR / "model/random-7b.yaml"),
                            "device": "cpu", "seed": 3})
    cfg.model.dtype = "fp32"
    cfg.model.arch.update(arch)
    return cfg


def test_a_random_weights_target_shares_its_weights_with_its_transformers_twin():
    cfg = random_config(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2)
    target, hf_model = from_config.timing_models(cfg)
    tokens = torch.randint(80, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = target(tokens, torch.arange(9)).logits, hf_model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert target.embed_tokens.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    again, _ = from_config.timing_models(cfg)  # seeded: the same weights again
    assert torch.equal(again.lm_head.weight, target.lm_head.weight)
    with pytest.raises(from_config.ModelNotAvailable, match="random weights and no files"):
        from_config.resolve_model_path(cfg.model)


def test_the_floor_benchmark_reports_plain_speeds_costs_and_the_oracle(target):
    hf_model = tiny_llama(0, vocab=96, layers=2)  # the weights `target` was converted from
    settings = FloorSettings(prompt_tokens=12, new_tokens=8, num_prompts=1, repeats=1,
                             draft_lengths=(1, 3), cost_lengths=(1, 2, 4))
    figures = measure_floor(target, hf_model, settings)
    assert figures["plain_tokens_per_s"] > 0 and figures["hf_plain_tokens_per_s"] > 0
    assert figures["peak_memory_mb"] > 0 and figures["peak_memory_kind"].startswith("cpu_")
    assert list(figures["cost_profile"]["c"]) == [1, 2, 4]
    assert [r["k"] for r in figures["oracle"]] == [1, 3]
    for row in figures["oracle"]:
        assert row["lossless"] is True and row["tau"] > 1
        assert row["bound"] == pytest.approx(
            row["tau"] / figures["cost_profile"]["c"][2 if row["k"] == 1 else 4])
        assert 0 < row["time_split"]["forward"]["share"] < 1  # the oracle's steps, split
    with pytest.raises(ValueError, match="cost_lengths must reach max"):
        FloorSettings(draft_lengths=(8,), cost_lengths=(1, 4))
    with pytest.raises(ValueError, match="cuda_graphs must be true, false or null, got 'yes'"):
        FloorSettings(cuda_graphs="yes")
