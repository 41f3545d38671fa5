"""GenerationStats: counters, merging generations, and the per-step time split."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.metrics import OTHER, PHASES, GenerationStats, describe_split


def timed(steps: int, wall: float, **seconds: float) -> GenerationStats:
    """Stats of a generation of `steps` steps, each phase timed (seconds per phase, total)."""
    stats = GenerationStats(wall_time_s=wall, split_steps=steps)
    for _ in range(steps):
        stats.record_step(draft_nodes=2, draft_depth=2, num_accepted=1)
    for phase in PHASES:
        setattr(stats, f"{phase}_time_s", seconds.get(phase, 0.0))
    return stats


def test_the_split_gives_seconds_per_step_and_shares_with_the_rest_left_over():
    stats = timed(4, 1.0, prefill=0.1, draft=0.2, forward=0.4, probs=0.04, verify=0.08,
                  commit=0.08)
    split = stats.time_split
    assert list(split) == [*PHASES, OTHER]
    assert split["forward"] == pytest.approx({"s_per_step": 0.1, "share": 0.4})
    assert split["prefill"]["s_per_step"] == pytest.approx(0.025)  # spread over the steps
    assert split[OTHER]["share"] == pytest.approx(0.1)  # 1.0 - 0.9, computed, not forced
    assert sum(p["share"] for p in split.values()) == pytest.approx(1.0)
    assert describe_split(split) == ("prefill 10% draft 20% forward 40% probs 4% verify 8% "
                                     "commit 8% other 10%")


def test_merge_adds_every_phase_and_the_timed_steps():
    a = timed(2, 1.0, prefill=0.1, draft=0.3, forward=0.4, probs=0.01, verify=0.02, commit=0.03)
    b = timed(3, 2.0, prefill=0.2, draft=0.5, forward=1.0, probs=0.02, verify=0.04, commit=0.05)
    a.merge(b)
    assert a.steps == a.split_steps == 5 and a.wall_time_s == pytest.approx(3.0)
    for phase, total in zip(PHASES, (0.3, 0.8, 1.4, 0.03, 0.06, 0.08), strict=True):
        assert getattr(a, f"{phase}_time_s") == pytest.approx(total), phase
    assert a.time_split["draft"]["s_per_step"] == pytest.approx(0.8 / 5)
    assert a.time_split[OTHER]["share"] == pytest.approx((3.0 - 2.67) / 3.0)
    assert a.nodes_histogram == [0, 0, 5] and a.nodes_per_step == 2.0


def test_no_split_unless_every_step_was_timed():
    assert GenerationStats().time_split is None  # no steps
    untimed = timed(3, 1.0, draft=0.2)
    untimed.split_steps = 0  # e.g. a GPU generation without split_time
    assert untimed.time_split is None
    mixed = timed(2, 1.0, forward=0.5)
    mixed.merge(untimed)
    assert mixed.steps == 5 and mixed.split_steps == 2 and mixed.time_split is None
    assert describe_split(None) == "split not measured"


def test_as_dict_carries_the_split_and_the_node_histogram():
    record = timed(2, 1.0, forward=0.5).as_dict()
    assert record["time_split"]["forward"]["share"] == pytest.approx(0.5)
    assert record["nodes_histogram"] == [0, 0, 2] and record["forward_time_s"] == 0.5


def test_tau_over_prompts_is_pooled_with_its_standard_error():
    from selfspec.metrics import TauEstimate

    def prompt(steps: int, accepted: int) -> GenerationStats:
        return GenerationStats(steps=steps, accepted=accepted)

    equal = [prompt(10, a) for a in (5, 10, 15, 30)]  # tau 1.5, 2, 2.5, 4 over equal steps
    estimate = TauEstimate.of(equal)
    taus = torch.tensor([1.5, 2.0, 2.5, 4.0], dtype=torch.float64)
    assert estimate.tau == pytest.approx(float(taus.mean()))
    assert estimate.standard_error == pytest.approx(float(taus.std() / 2))  # sd / sqrt(n)
    uneven = TauEstimate.of([prompt(10, 10), prompt(30, 0)])  # pooled: 50 tokens / 40 steps
    assert uneven.tau == pytest.approx(1.25) and uneven.prompts == 2
    assert uneven.standard_error > 0
    assert math.isnan(TauEstimate.of([prompt(4, 2)]).standard_error)


def test_tau_by_position_counts_each_step_in_the_span_it_started_in():
    stats = GenerationStats()
    stats.record_step(3, 3, num_accepted=3, position=0)  # 4 tokens from 0
    stats.record_step(3, 3, num_accepted=1, position=126)  # starts in the first span too
    stats.record_step(3, 3, num_accepted=0, position=128)
    stats.record_step(3, 3, num_accepted=2, position=300)  # span 2; span 1 had one step
    assert stats.steps_by_span == [2, 1, 1] and stats.tokens_by_span == [6, 1, 3]
    assert stats.tau_by_position == [3.0, 1.0, 3.0]
    stats.record_step(3, 3, num_accepted=2)  # no position: tau counts it, the spans do not
    assert sum(stats.steps_by_span) == stats.steps - 1
    other = GenerationStats()
    other.record_step(1, 1, num_accepted=1, position=520)  # span 4, past an empty span 3
    stats.merge(other)
    assert stats.tau_by_position == [3.0, 1.0, 3.0, None, 2.0]
    assert stats.as_dict()["tau_by_position"] == stats.tau_by_position
