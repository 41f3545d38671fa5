"""Auto draft sizes: the candidate whose calibration predicts the highest speedup under the cost
profile wins."""

import pytest

from selfspec.drafters import NgramDrafter
from selfspec.measure.autosize import choose_size
from selfspec.measure.costs import CostProfile
from selfspec.measure.oracle import OracleDrafter

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 3, 9, 11]]


def profile(c) -> CostProfile:
    """A made-up profile: a one-token forward of 1 s (so drafting costs ~0) and c(n)."""
    return CostProfile({n: float(c(n)) for n in range(1, 17)}, 100, "cpu", "float32")


def oracles() -> dict[int, OracleDrafter]:
    return {k: OracleDrafter(k) for k in (1, 2, 4, 8)}


def test_every_accepted_draft_and_a_flat_cost_choose_the_longest(target):
    choice = choose_size(target, oracles(), PROMPTS, profile(lambda n: 1.0), max_new_tokens=24)
    assert choice.size == 8
    assert [e.size for e in choice.estimates] == [1, 2, 4, 8]
    taus = [e.tau for e in choice.estimates]
    assert taus == sorted(taus) and taus[0] == pytest.approx(2.0)  # the oracle is always right
    assert choice.predicted_speedup == max(e.predicted_speedup for e in choice.estimates)


def test_a_forward_that_grows_with_its_length_chooses_the_shortest(target):
    choice = choose_size(target, oracles(), PROMPTS, profile(lambda n: n * n), max_new_tokens=24)
    assert choice.size == 1  # tau k + 1 over c(k + 1) = (k + 1)^2: shorter is faster


def test_the_estimate_is_the_profile_bound_of_the_calibration(target):
    costs = profile(lambda n: 1 + n / 4)
    choice = choose_size(target, oracles(), PROMPTS, costs, max_new_tokens=24)
    for e in choice.estimates:
        assert 0 <= e.draft_cost < 0.01  # lookups, against a made-up forward of 1 s
        # Steps verify 1..size nodes (fewer at the end of a generation): c(2)..c(size + 1).
        assert e.predicted_speedup <= e.tau / (costs.c(2) + e.draft_cost) + 1e-9
        assert e.predicted_speedup >= e.tau / (costs.c(e.size + 1) + e.draft_cost) - 1e-9


def test_candidates_beyond_the_profile_are_refused(target):
    with pytest.raises(ValueError, match=r"candidates \[16\] draft more nodes"):
        choose_size(target, {2: NgramDrafter(2), 16: NgramDrafter(16)}, PROMPTS,
                    profile(lambda n: 1.0))
    with pytest.raises(ValueError, match="at least one candidate"):
        choose_size(target, {}, PROMPTS, profile(lambda n: 1.0))
