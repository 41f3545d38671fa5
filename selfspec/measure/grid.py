"""The sweep's grid: methods x draft lengths x sampling settings (`SweepGrid`), its points,
and the row of figures each point becomes (`SweepRow`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from selfspec.sampling import SamplingParams

# Methods a sweep knows; the hf_* ones run Hugging Face `generate` on the same weights.
METHODS = ("small_model", "ngram", "medusa", "ngram+medusa", "eagle", "early_exit",
           "hf_assisted", "hf_prompt_lookup")
# Our method whose Hugging Face peer does the same thing (for the ours-over-HF ratio).
HF_PEERS = {"hf_assisted": "small_model", "hf_prompt_lookup": "ngram"}


@dataclass(frozen=True)
class GridPoint:
    """auto: the draft length is chosen when the point's turn comes, among `candidates` (the
    method's fixed lengths), by `selfspec.measure.autosize.choose_size` on calibration prompts."""

    method: str
    draft_length: int
    sampling_name: str
    sampling: SamplingParams
    auto: bool = False
    candidates: tuple[int, ...] = ()


@dataclass(frozen=True)
class SweepGrid:
    """methods x draft lengths x named sampling settings.

    medusa_depth: the depth of the Medusa tree. Medusa at draft length k uses the tree's
    nodes of depth <= k, so lengths beyond the depth would repeat the full tree: they are
    folded into one row at the tree's depth.
    auto: after each of our methods' fixed rows, a row at the length chosen among them
    (`num_draft_tokens=[1,2,4,auto]`); the Hugging Face peers have no auto row.
    """

    methods: tuple[str, ...]
    draft_lengths: tuple[int, ...]
    samplings: tuple[tuple[str, SamplingParams], ...]
    medusa_depth: int | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        # A method may name a variant after a slash (early_exit/E4/norm/stop0.6).
        unknown = [m for m in self.methods if m.split("/")[0] not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown or '(none given)'}: choose from "
                             f"{', '.join(METHODS)} (e.g. methods=[small_model,ngram])")
        bad = [k for k in self.draft_lengths if not isinstance(k, int) or k < 1]
        if bad or not self.draft_lengths:
            raise ValueError(f"draft lengths must be integers >= 1, got "
                             f"{list(self.draft_lengths)} (e.g. num_draft_tokens=[2,4])")
        if not self.samplings:
            raise ValueError("no sampling settings: give at least one (e.g. samplings=[greedy])")
        if "medusa" in self.methods and not self.medusa_depth:
            raise ValueError("SweepGrid: medusa needs medusa_depth (the depth of its tree)")

    def lengths_of(self, method: str) -> list[int]:
        if method == "medusa":
            return sorted({min(k, self.medusa_depth) for k in self.draft_lengths})
        return sorted(set(self.draft_lengths))

    def points(self) -> list[GridPoint]:
        points = []
        for name, sampling in self.samplings:
            for method in dict.fromkeys(self.methods):
                lengths = self.lengths_of(method)
                points += [GridPoint(method, k, name, sampling) for k in lengths]
                if self.auto and method not in HF_PEERS:
                    points.append(GridPoint(method, max(lengths), name, sampling, True,
                                            tuple(lengths)))
        return points


@dataclass(frozen=True)
class SweepRow:
    """One configuration's figures. tau counts the bonus token; tokens/s are medians over
    repeats (min/max beside them); speedup = median tokens/s over the baseline's, measured in
    the same run (speedup_min/max: the per-repeat ratios); lossless: greedy outputs equal the
    baseline's (None when sampling); draft_time_share: None where not measured;
    ours_over_hf: on hf_* rows, our peer method's tokens/s over this row's.

    nodes_per_step: mean draft nodes a step proposed, nodes_histogram[n]: the steps that
    proposed n (Hugging Face rows: the prefill counts as a step of 0); draft_ms_per_step: None
    where the draft time is not measured; time_split: `GenerationStats.time_split` (None where
    not measured, e.g. Hugging Face's generate), baseline_time_split: the baseline's.
    draft_cost, bound, efficiency: see `add_bounds` (None without a cost profile).
    auto_choice: on a `<method>/auto` row, the candidates' calibration estimates
    (`SizeChoice.as_dict`); auto_vs_best: its speedup over the best fixed row of the method
    at that sampling (see `add_auto_ratios`)."""

    method: str
    draft_length: int
    draft_nodes: int | None
    sampling: str
    temperature: float
    top_k: int
    top_p: float
    baseline: str
    prompts: int
    repeats: int
    new_tokens: int
    tau: float
    acceptance_rate: float
    acceptance_by_position: list[float]
    tokens_per_s: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    baseline_tokens_per_s: float
    baseline_tokens_per_s_min: float
    baseline_tokens_per_s_max: float
    speedup: float
    speedup_min: float
    speedup_max: float
    target_forwards_per_token: float
    draft_time_share: float | None
    peak_memory_mb: float
    memory_measure: str
    repeated_4gram_share: float
    baseline_repeated_4gram_share: float
    lossless: bool | None
    ours_over_hf: float | None = None
    nodes_per_step: float = 0.0
    nodes_histogram: list[int] = field(default_factory=list)
    draft_ms_per_step: float | None = None
    time_split: dict[str, dict[str, float]] | None = None
    baseline_time_split: dict[str, dict[str, float]] | None = None
    draft_cost: float | None = None
    bound: float | None = None
    efficiency: float | None = None
    auto_choice: dict | None = None
    auto_vs_best: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


COLUMNS = tuple(f.name for f in fields(SweepRow))
