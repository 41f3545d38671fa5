"""The sweep's grid: methods x draft lengths x sampling settings (`SweepGrid`), its points,
and the row of figures each point becomes (`SweepRow`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from selfspec.checks import is_count
from selfspec.sampling import SamplingParams


@dataclass(frozen=True)
class Variant:
    """One kind of row of a method: the method's name and its settings besides the draft
    length. Methods with settings that make rows (an exit layer, a draft vocabulary, a lookup
    tree) subclass it with typed fields; `label` formats it for display only.

    peer_of: for a Hugging Face peer, our method that does the same thing (its rows are
    compared with that method's at the same draft length); None for our own methods.
    """

    method: str

    @property
    def peer_of(self) -> str | None:
        return None

    def label(self) -> str:
        return self.method

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GridLine:
    """A variant and the draft lengths it runs at. auto: whether an auto row may follow (one
    at the length chosen among these); the Hugging Face peers have none."""

    variant: Variant
    lengths: tuple[int, ...]
    auto: bool = True

    def __post_init__(self) -> None:
        bad = [k for k in self.lengths if not is_count(k)]
        if bad or not self.lengths:
            raise ValueError(f"draft lengths must be integers >= 1, got {list(self.lengths)} "
                             f"(e.g. num_draft_tokens=[2,4])")


@dataclass(frozen=True)
class GridPoint:
    """auto: the draft length is chosen when the point's turn comes, among `candidates` (the
    line's fixed lengths), by `selfspec.measure.autosize.choose_size` on calibration prompts."""

    variant: Variant
    draft_length: int
    sampling_name: str
    sampling: SamplingParams
    auto: bool = False
    candidates: tuple[int, ...] = ()
    batch_size: int = 1  # prompts decoded together (its baseline: plain decoding of them)

    @property
    def method(self) -> str:
        """The point's row name, for display."""
        return self.variant.label()


@dataclass(frozen=True)
class SweepGrid:
    """lines (a variant and its draft lengths) x named sampling settings x batch sizes. auto:
    after each line's fixed rows, a row at the length chosen among them
    (`num_draft_tokens=[1,2,4,auto]`), where the line allows one, at batch size 1."""

    lines: tuple[GridLine, ...]
    samplings: tuple[tuple[str, SamplingParams], ...]
    auto: bool = False
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if not self.lines:
            raise ValueError("no methods to sweep: give at least one (e.g. "
                             "methods=[small_model,ngram])")
        if not self.samplings:
            raise ValueError("no sampling settings: give at least one (e.g. samplings=[greedy])")
        if not self.batch_sizes or not all(map(is_count, self.batch_sizes)):
            raise ValueError(f"bench.batch_sizes: give integers >= 1, e.g. [1,2,4,8], got "
                             f"{list(self.batch_sizes)}")

    @property
    def methods(self) -> tuple[str, ...]:
        """The lines' row names, in order."""
        return tuple(line.variant.label() for line in self.lines)

    @property
    def variants(self) -> tuple[Variant, ...]:
        return tuple(line.variant for line in self.lines)

    def variant(self, label: str) -> Variant:
        """The line's variant whose row name is `label`."""
        found = {line.variant.label(): line.variant for line in self.lines}
        if label not in found:
            raise ValueError(f"no row {label!r} in this grid: it has {', '.join(found)}")
        return found[label]

    def points(self) -> list[GridPoint]:
        points = []
        for batch in self.batch_sizes:
            for name, sampling in self.samplings:
                for line in self.lines:
                    lengths = sorted(set(line.lengths))
                    points += [GridPoint(line.variant, k, name, sampling, batch_size=batch)
                               for k in lengths]
                    if self.auto and line.auto and batch == 1:
                        points.append(GridPoint(line.variant, max(lengths), name, sampling,
                                                True, tuple(lengths)))
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
    at that sampling (see `add_auto_ratios`). variant: the row's variant as fields (`method`
    is its label, for display); peer_of: on a Hugging Face peer's row, our method's name."""

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
    first_difference: dict | None = None  # lossless False: where (`divergence.first_difference`)
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
    variant: dict[str, Any] = field(default_factory=dict)
    peer_of: str | None = None
    batch_size: int = 1
    latency_s_mean: float | None = None
    latency_s_p90: float | None = None
    baseline_latency_s_mean: float | None = None
    baseline_latency_s_p90: float | None = None
    # tau of the steps starting in each span of `metrics.POSITION_SPAN` new tokens
    tau_by_position: list[float | None] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


COLUMNS = tuple(f.name for f in fields(SweepRow))
