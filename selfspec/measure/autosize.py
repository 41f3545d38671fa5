"""Drafting that fits the hardware: choose a drafter's size (a draft length k, a tree) by the
speedup that its measured acceptance and the target's measured costs predict.

Each candidate drafts a few calibration prompts (never the evaluation ones); its tau, the
sizes of the drafts it verified and its drafting time per step give, with the target's cost
profile c(N), the predicted speedup tau / (mean c(N + 1) + draft cost), the bound of
`CostProfile.bound`. The candidate with the highest prediction wins: EAGLE-2's timed choice of
`total_token`, and Sequoia's tree search, reduced to measuring what the machine does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from selfspec.drafters.base import Drafter
from selfspec.measure.costs import CostProfile
from selfspec.measure.passes import BenchSettings, run_passes
from selfspec.measure.peers import OurDecoder
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams


@dataclass(frozen=True)
class SizeEstimate:
    """One candidate on the calibration prompts: tau, mean draft nodes per step, its drafting
    in one-token target forwards per step, and the speedup these predict."""

    size: int
    tau: float
    nodes_per_step: float
    draft_cost: float
    predicted_speedup: float


@dataclass(frozen=True)
class SizeChoice:
    """The chosen size and every candidate's estimate (in the candidates' order)."""

    size: int
    estimates: tuple[SizeEstimate, ...]
    calibration_prompts: int

    @property
    def predicted_speedup(self) -> float:
        return next(e.predicted_speedup for e in self.estimates if e.size == self.size)

    def as_dict(self) -> dict:
        return {"size": self.size, "calibration_prompts": self.calibration_prompts,
                "estimates": [asdict(e) for e in self.estimates]}

    def describe(self) -> str:
        rows = ", ".join(f"{e.size}: tau {e.tau:.2f} -> {e.predicted_speedup:.2f}x"
                         for e in self.estimates)
        return f"auto size {self.size} (predicted {self.predicted_speedup:.2f}x; {rows})"


def choose_size(
    target: Transformer,
    candidates: Mapping[int, Drafter],
    prompts: Sequence[Sequence[int]],
    profile: CostProfile,
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
) -> SizeChoice:
    """The candidate size whose drafter the calibration prompts predict to be fastest.

    candidates: {size: drafter}, e.g. {k: NgramDrafter(k) for k in range(1, 9)}. A draft
    bigger than the profile's longest forward is refused: c(N + 1) would be a guess.
    """
    if not candidates or not prompts:
        raise ValueError("choose_size: give at least one candidate and one calibration prompt")
    too_big = [s for s, d in candidates.items() if d.max_nodes + 1 > max(profile.seconds)]
    if too_big:
        raise ValueError(f"choose_size: candidates {too_big} draft more nodes than the cost "
                         f"profile measures (forwards up to {max(profile.seconds)} tokens); "
                         f"profile longer forwards or drop them")
    settings = BenchSettings(max_new_tokens=max_new_tokens, seed=seed, stop_ids=tuple(stop_ids))
    estimates = tuple(_estimate(target, size, drafter, prompts, profile, sampling, settings)
                      for size, drafter in candidates.items())
    best = max(estimates, key=lambda e: e.predicted_speedup)
    return SizeChoice(best.size, estimates, len(prompts))


def _estimate(
    target: Transformer, size: int, drafter: Drafter, prompts: Sequence[Sequence[int]],
    profile: CostProfile, sampling: SamplingParams, settings: BenchSettings,
) -> SizeEstimate:
    (calibration,) = run_passes([OurDecoder(target, drafter, split_time=True)], prompts,
                                sampling, settings)
    stats = calibration.stats
    draft_cost = stats.draft_time_s / max(stats.steps, 1) / profile.seconds[1]
    predicted = profile.bound(stats.tau, stats.nodes_histogram, draft_cost)
    return SizeEstimate(size, stats.tau, stats.nodes_per_step, draft_cost, predicted)
