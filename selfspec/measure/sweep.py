"""A sweep: every grid point measured in this process, in order, then the ratios that compare
rows (auto against the best fixed length, ours against the Hugging Face peer) and each row's
bound from the target's cost profile. Building the decoders from configs is the composition
package's job: `run_sweep` receives a function that makes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from selfspec.measure.costs import CostProfile
from selfspec.measure.grid import GridPoint, SweepRow, Variant
from selfspec.measure.passes import BenchSettings, Method, measure_row

if TYPE_CHECKING:  # autosize measures through passes
    from selfspec.measure.autosize import SizeChoice

def run_sweep(
    points: Sequence[GridPoint],
    make_method: Callable[[Variant, int], Method],
    prompts: Sequence[Sequence[int]],
    settings: BenchSettings,
    *,
    shared_baseline: bool = False,
    device: torch.device | str = "cpu",
    progress: bool = True,
    choose_length: Callable[[GridPoint], SizeChoice] | None = None,
) -> list[SweepRow]:
    """Measure every grid point in this process, in order, with a progress bar.

    make_method(variant, k) builds a point's decoders when its turn comes (and they are dropped
    after it, with any draft caches). shared_baseline: measure each baseline once per sampling
    setting and batch size instead of beside every row (half the time, less robust to
    machine drift).
    choose_length(point): an auto point's draft length among point.candidates (calibrated on
    prompts other than these); its row is named `<method>/auto`.
    """
    from tqdm.auto import tqdm

    rows, shared = [], {}
    bar = tqdm(points, desc="sweep", unit="config", disable=not progress)
    for point in bar:
        bar.set_postfix_str(f"{point.method} k={'auto' if point.auto else point.draft_length} "
                            f"{point.sampling_name}")
        choice = _choose(choose_length, point) if point.auto else None
        method = make_method(point.variant, choice.size if choice else point.draft_length)
        key = (method.baseline_name, point.sampling_name, point.batch_size)
        row, base = measure_row(method, point, prompts, settings, shared.get(key), device)
        if shared_baseline:
            shared[key] = base
        if choice:
            row = replace(row, method=f"{point.method}/auto", auto_choice=choice.as_dict())
        rows.append(row)
    return add_auto_ratios(add_peer_ratios(rows))


def _choose(choose_length: Callable[[GridPoint], SizeChoice] | None,
            point: GridPoint) -> SizeChoice:
    if choose_length is None:
        raise ValueError(f"run_sweep: {point.method} asks for an auto draft length but no "
                         f"choose_length was given")
    return choose_length(point)


def add_auto_ratios(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """Set auto_vs_best on every `<method>/auto` row: its measured speedup over that of the
    best fixed row of the same method and sampling (1.0: auto found the best one)."""
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.auto_choice is None:
            key = (r.method, r.sampling)
            best[key] = max(best.get(key, 0.0), r.speedup)
    out = []
    for r in rows:
        fixed = best.get((r.method.removesuffix("/auto"), r.sampling))
        ratio = r.speedup / fixed if r.auto_choice is not None and fixed else None
        out.append(replace(r, auto_vs_best=ratio))
    return out


def add_peer_ratios(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """Set ours_over_hf on every Hugging Face peer's row whose counterpart of ours (its
    `peer_of`, at the same draft length and sampling) ran."""
    speed = {(r.method, r.draft_length, r.sampling): r.tokens_per_s for r in rows}
    out = []
    for r in rows:
        peer = speed.get((r.peer_of, r.draft_length, r.sampling))
        ratio = peer / r.tokens_per_s if peer is not None and r.tokens_per_s else None
        out.append(replace(r, ours_over_hf=ratio))
    return out


def add_bounds(rows: Sequence[SweepRow],
               profiles: CostProfile | Mapping[int, CostProfile]) -> list[SweepRow]:
    """Every row's bound and efficiency from a cost profile of its target (docs/design.md,
    "Every speedup is explained"): bound = tau / (c(N + 1) + draft cost), c(N + 1) being its
    mean over the row's steps (N: each step's draft nodes, from nodes_histogram), the draft
    cost = draft time per step in one-token forwards of the profile (0 where the draft time
    is not measured: the bound is then an upper one); efficiency = speedup / bound. A row
    without drafts has bound 1 / (1 + its draft cost). The hf_* rows use c(N) of our forward.
    A row at batch size B takes c_B(N) and the one-token forward of the profile at B
    (profiles: one per batch size; a single profile serves batch size 1). A row with a step
    beyond the profile's lengths, or without a profile at its batch size, keeps None."""
    if isinstance(profiles, CostProfile):
        profiles = {profiles.batch_size: profiles}
    out = []
    for r in rows:
        profile = profiles.get(r.batch_size)
        if profile is None or not r.nodes_histogram \
                or len(r.nodes_histogram) > max(profile.seconds):
            out.append(r)
            continue
        one_token_ms = 1000 * profile.seconds[1]
        cost = None if r.draft_ms_per_step is None else r.draft_ms_per_step / one_token_ms
        bound = profile.bound(r.tau, r.nodes_histogram, cost or 0.0)
        out.append(replace(r, draft_cost=cost, bound=bound, efficiency=r.speedup / bound))
    return out
