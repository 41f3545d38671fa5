"""The cost profile c(N) of target forwards (measure/costs.py): c, bounds, lengths, timing."""

import pytest
import torch
from helpers import tiny_llama

from selfspec.measure.costs import CostProfile, covering_lengths, measure_cost_profile
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


def test_a_moe_targets_profile_counts_the_distinct_experts_each_forward_touches():
    """One token routes to exactly its top k in each MoE layer; more tokens touch more
    experts, never more than the layer holds; a dense target has no such figure."""
    from helpers import tiny_model

    moe = Transformer.from_hf(tiny_model("qwen3_moe", 0, layers=3)).eval()  # 2 MoE layers
    profile = measure_cost_profile(moe, (1, 4, 32), cache_length=8, repeats=1, warmup=0)
    touched = profile.experts_touched
    assert touched[1] == moe.config.num_experts_per_tok == 2
    assert touched[1] < touched[4] <= touched[32] <= moe.config.num_experts
    assert profile.as_dict()["experts_touched"] == touched
    dense = measure_cost_profile(Transformer.from_hf(tiny_llama(0)), (1, 2), cache_length=8,
                                 repeats=1, warmup=0)
    assert dense.experts_touched is None and "experts_touched" not in dense.as_dict()
