"""Side-by-side measurement of drafting methods against plain decoding of the same target.

Speedup is a ratio of tokens per second measured in the same process on the same prompts.
By default plain and speculative runs are interleaved prompt by prompt so that machine drift
hits both; warm-up generations are excluded. Every generation is timed the same way, around
the call, whichever library runs it (ours or Hugging Face `generate`). Next to every speedup
stands a repetition measure: a small model's greedy output can collapse into loops that any
drafter predicts.

A sweep is a grid of methods x draft lengths x sampling settings (`SweepGrid`); each grid
point becomes one `SweepRow`. Building the decoders from configs is `selfspec.build`'s job: this
module receives them ready (`Method`) and only measures. The decoders live in peers.py,
peak memory in memory.py, and writing and presenting the rows in results.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from selfspec.costs import CostProfile
from selfspec.decode import GenerationResult
from selfspec.drafters.base import Drafter
from selfspec.memory import PeakMemory
from selfspec.metrics import GenerationStats, describe_split
from selfspec.model import Transformer
from selfspec.peers import Decoder, OurDecoder
from selfspec.sampling import SamplingParams

if TYPE_CHECKING:  # autosize measures through this module
    from selfspec.autosize import SizeChoice

# Methods a sweep knows; the hf_* ones run Hugging Face `generate` on the same weights.
METHODS = ("small_model", "ngram", "medusa", "ngram+medusa", "eagle", "early_exit",
           "hf_assisted", "hf_prompt_lookup")
# Our method whose Hugging Face peer does the same thing (for the ours-over-HF ratio).
HF_PEERS = {"hf_assisted": "small_model", "hf_prompt_lookup": "ngram"}


# ---- measuring one method against its baseline --------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """repeats: timed passes over the prompt set; warmup: untimed generations per decoder
    before timing starts; stop_ids: EOS ids that end a generation (empty: never stop early)."""

    max_new_tokens: int = 64
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("repeats", 1), ("warmup", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(
                    f"BenchSettings: {name} must be an integer >= {low}, got {value!r}"
                )


@dataclass(frozen=True)
class Method:
    """A grid point's decoder and its baseline: plain decoding of the same target by the same
    library (ours for our drafters, Hugging Face's for the hf_* peers)."""

    name: str
    draft_length: int
    decoder: Decoder
    baseline: Decoder
    baseline_name: str = "plain"
    draft_nodes: int | None = None  # tokens per draft (a tree has more than its depth)


@dataclass
class Pass:
    """One decoder over the prompt set, repeated: per-repeat totals and summed counters.

    outputs: the tokens of every prompt in the first repeat (seeds repeat, so do outputs)."""

    new_tokens: list[int] = field(default_factory=list)  # per repeat
    seconds: list[float] = field(default_factory=list)  # per repeat
    stats: GenerationStats = field(default_factory=GenerationStats)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, repeat: int, result: GenerationResult) -> None:
        if repeat == len(self.seconds):
            self.new_tokens.append(0)
            self.seconds.append(0.0)
        self.new_tokens[repeat] += result.stats.new_tokens
        self.seconds[repeat] += result.stats.wall_time_s
        self.stats.merge(result.stats)
        if repeat == 0:
            self.outputs.append(result.tokens)

    @property
    def tokens_per_s(self) -> list[float]:
        return [n / s if s else 0.0 for n, s in zip(self.new_tokens, self.seconds, strict=True)]


def run_passes(
    decoders: Sequence[Decoder],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    settings: BenchSettings,
) -> list[Pass]:
    """Warm every decoder up, then time them interleaved prompt by prompt, repeat by repeat.

    Prompt i is generated with seed `settings.seed + i` in every repeat and by every decoder.
    """
    if not prompts:
        raise ValueError("run_passes: no prompts to measure on")
    warm_tokens = min(16, settings.max_new_tokens)
    for decoder in decoders:
        for w in range(settings.warmup):
            decoder(prompts[w % len(prompts)], sampling, warm_tokens, settings.seed, ())
    passes = [Pass() for _ in decoders]
    for repeat in range(settings.repeats):
        for i, prompt in enumerate(prompts):
            for decoder, summary in zip(decoders, passes, strict=True):
                summary.add(repeat, decoder(prompt, sampling, settings.max_new_tokens,
                                            settings.seed + i, settings.stop_ids))
    return passes



# ---- the grid -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GridPoint:
    """auto: the draft length is chosen when the point's turn comes, among `candidates` (the
    method's fixed lengths), by `selfspec.autosize.choose_size` on calibration prompts."""

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


def measure_row(
    method: Method,
    point: GridPoint,
    prompts: Sequence[Sequence[int]],
    settings: BenchSettings,
    baseline: Pass | None = None,
    device: torch.device | str = "cpu",
) -> tuple[SweepRow, Pass]:
    """Measure one grid point; returns the row and the baseline pass it was compared with.

    baseline: a pass of the baseline measured earlier (shared mode); None = measure it here,
    interleaved with the method prompt by prompt.
    """
    with PeakMemory(device) as memory:
        if baseline is None:
            baseline, ours = run_passes([method.baseline, method.decoder], prompts,
                                        point.sampling, settings)
        else:
            (ours,) = run_passes([method.decoder], prompts, point.sampling, settings)
    lossless = ours.outputs == baseline.outputs if point.sampling.greedy else None
    row = _row(method, point, ours, baseline, memory, lossless)
    return row, baseline


def _row(method: Method, point: GridPoint, ours: Pass, base: Pass, memory: PeakMemory,
         lossless: bool | None) -> SweepRow:
    stats, sampling = ours.stats, point.sampling
    speed, base_speed = ours.tokens_per_s, base.tokens_per_s
    ratios = [a / b if b else 0.0 for a, b in zip(speed, base_speed, strict=True)]
    median, base_median = statistics.median(speed), statistics.median(base_speed)
    return SweepRow(
        method=method.name, draft_length=method.draft_length, draft_nodes=method.draft_nodes,
        sampling=point.sampling_name, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, baseline=method.baseline_name, prompts=len(ours.outputs),
        repeats=len(speed), new_tokens=sum(len(o) for o in ours.outputs),
        tau=stats.tau, acceptance_rate=stats.acceptance_rate,
        acceptance_by_position=stats.acceptance_by_position,
        tokens_per_s=median, tokens_per_s_min=min(speed), tokens_per_s_max=max(speed),
        baseline_tokens_per_s=base_median, baseline_tokens_per_s_min=min(base_speed),
        baseline_tokens_per_s_max=max(base_speed),
        speedup=median / base_median if base_median else 0.0,
        speedup_min=min(ratios), speedup_max=max(ratios),
        target_forwards_per_token=stats.target_forwards / max(stats.new_tokens, 1),
        draft_time_share=(stats.draft_time_s / stats.wall_time_s
                          if method.decoder.measures_draft_time and stats.wall_time_s else None),
        peak_memory_mb=memory.peak_mb, memory_measure=memory.kind,
        repeated_4gram_share=repeated_ngram_share(ours.outputs, 4),
        baseline_repeated_4gram_share=repeated_ngram_share(base.outputs, 4),
        lossless=lossless, nodes_per_step=stats.nodes_per_step,
        nodes_histogram=list(stats.nodes_histogram),
        draft_ms_per_step=(1000 * stats.draft_time_s / stats.steps
                           if method.decoder.measures_draft_time and stats.steps else None),
        time_split=stats.time_split, baseline_time_split=base.stats.time_split,
    )


def run_sweep(
    points: Sequence[GridPoint],
    make_method: Callable[[str, int], Method],
    prompts: Sequence[Sequence[int]],
    settings: BenchSettings,
    *,
    shared_baseline: bool = False,
    device: torch.device | str = "cpu",
    progress: bool = True,
    choose_length: Callable[[GridPoint], SizeChoice] | None = None,
) -> list[SweepRow]:
    """Measure every grid point in this process, in order, with a progress bar.

    make_method(name, k) builds a point's decoders when its turn comes (and they are dropped
    after it, with any draft caches). shared_baseline: measure each baseline once per sampling
    setting instead of beside every row (half the time, less robust to machine drift).
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
        method = make_method(point.method, choice.size if choice else point.draft_length)
        key = (method.baseline_name, point.sampling_name)
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
    """Set ours_over_hf on every hf_* row whose peer (same draft length and sampling) ran."""
    speed = {(r.method, r.draft_length, r.sampling): r.tokens_per_s for r in rows}
    out = []
    for r in rows:
        peer = speed.get((HF_PEERS.get(r.method), r.draft_length, r.sampling))
        ratio = peer / r.tokens_per_s if peer is not None and r.tokens_per_s else None
        out.append(SweepRow(**{**r.as_dict(), "ours_over_hf": ratio}))
    return out


def add_bounds(rows: Sequence[SweepRow], profile: CostProfile) -> list[SweepRow]:
    """Every row's bound and efficiency from a cost profile of its target (ARCHITECTURE.md,
    rule 9): bound = tau / (c(N + 1) + draft cost), c(N + 1) being its mean over the row's
    steps (N: each step's draft nodes, from nodes_histogram), the draft cost = draft time per
    step in one-token forwards of the profile (0 where the draft time is not measured: the
    bound is then an upper one); efficiency = speedup / bound. A row without drafts has bound
    1 / (1 + its draft cost). The hf_* rows use c(N) of our forward. A row with a step beyond
    the profile's lengths keeps None."""
    one_token_ms = 1000 * profile.seconds[1]
    out = []
    for r in rows:
        if not r.nodes_histogram or len(r.nodes_histogram) > max(profile.seconds):
            out.append(r)
            continue
        cost = None if r.draft_ms_per_step is None else r.draft_ms_per_step / one_token_ms
        bound = profile.bound(r.tau, r.nodes_histogram, cost or 0.0)
        out.append(replace(r, draft_cost=cost, bound=bound, efficiency=r.speedup / bound))
    return out


# ---- one drafter against plain decoding (train/medusa.py's final report) -------------------


@dataclass(frozen=True)
class Comparison:
    """A drafter against plain decoding: tau counts the bonus token; speedup is the ratio of
    tokens/s; lossless is None when sampling (outputs may then differ and still be exact)."""

    tau: float
    acceptance_rate: float
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float
    draft_time_share: float
    repeated_4gram_share: float
    lossless: bool | None
    prompts: int
    new_tokens: int
    time_split: dict[str, dict[str, float]] | None = None  # the drafter's, GenerationStats'

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self, prompt_set: str) -> str:
        """One line: tau, speedup, both speeds, draft time share, losslessness, repetition,
        and where the drafter's time went."""
        return (f"tau {self.tau:.2f}, speedup x{self.speedup:.2f} over plain decoding "
                f"({self.tokens_per_s:.1f} vs {self.plain_tokens_per_s:.1f} tokens/s) on "
                f"{self.prompts} {prompt_set} prompts, draft time share "
                f"{self.draft_time_share:.2f}, lossless={self.lossless}, repeated 4-grams "
                f"{self.repeated_4gram_share:.2f}; time: {describe_split(self.time_split)}")


def compare_with_plain(
    target: Transformer,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    seed: int = 0,
    split_time: bool | None = None,
    cuda_graphs: bool | None = None,
) -> Comparison:
    """Generate every prompt with plain decoding and with the drafter, interleaved.
    split_time, cuda_graphs: as `generate`'s, for both (True: the time split on any device)."""
    if not prompts:
        raise ValueError("compare_with_plain: no prompts to measure on")
    ours, plain = (OurDecoder(target, d, split_time=split_time, cuda_graphs=cuda_graphs)
                   for d in (drafter, None))
    method = Method("drafter", drafter.max_nodes, ours, plain)
    point = GridPoint("drafter", drafter.max_nodes, "custom", sampling)
    settings = BenchSettings(max_new_tokens=max_new_tokens, seed=seed)
    row, _ = measure_row(method, point, prompts, settings, device=target.embed_tokens.weight.device)
    return Comparison(
        tau=row.tau, acceptance_rate=row.acceptance_rate, tokens_per_s=row.tokens_per_s,
        plain_tokens_per_s=row.baseline_tokens_per_s, speedup=row.speedup,
        draft_time_share=row.draft_time_share or 0.0,
        repeated_4gram_share=row.repeated_4gram_share, lossless=row.lossless,
        prompts=row.prompts, new_tokens=row.new_tokens, time_split=row.time_split,
    )


# ---- lossless check -----------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from plain greedy: where, the tokens from there on, and
    how close plain decoding's choice was there: its top-2 logit gap and the near-tie
    tolerance of the model's dtype (see `near_tie_tolerance`)."""

    method: str
    draft_length: int
    prompt_id: str
    position: int  # index of the first differing new token
    expected: list[int]
    got: list[int]
    top2_gap: float | None = None  # None: the baseline cannot say
    tolerance: float = 0.0

    @property
    def near_tie(self) -> bool:
        """A numeric tie of a low-precision dtype rather than a failure of the method."""
        return self.top2_gap is not None and self.tolerance > 0 and self.top2_gap <= self.tolerance

    def describe(self) -> str:
        text = (f"{self.method} k={self.draft_length} on prompt {self.prompt_id}: first "
                f"difference at new token {self.position}: expected {self.expected[:8]}, "
                f"got {self.got[:8]}")
        if self.top2_gap is None:
            return text
        verdict = ("a numeric near-tie" if self.near_tie else "a real failure")
        return (f"{text}; plain decoding's top-2 logit gap there {self.top2_gap:.4g} "
                f"(near-tie tolerance {self.tolerance:.4g}): {verdict}")


# In bf16/fp16 one forward over N+1 tokens and one over a single token may round a greedy
# near-tie differently, so speculative greedy output may leave plain greedy output where plain
# decoding's two best logits lie within a few units in the last place of the dtype, at the
# logits' scale. fp32 gets no allowance: there the outputs must match token for token.
NEAR_TIE_ULPS = 4


def near_tie_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The top-2 logit gap under which a divergence in `dtype` counts as a numeric tie."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0.0
    return NEAR_TIE_ULPS * torch.finfo(dtype).eps * float(logits.abs().max())


def top2_gap(logits: torch.Tensor) -> float:
    best = logits.float().topk(2).values
    return float(best[0] - best[1])


def greedy_outputs(
    decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[list[int]]:
    greedy = SamplingParams()
    return [decoder(p, greedy, max_new_tokens, 0, stop_ids).tokens for p in prompts]


def greedy_agreement(
    reference: Transformer, other: Transformer, prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> float:
    """Mean share of each plain greedy continuation of `reference` that `other` reproduces
    before their first difference (1.0: identical outputs): how far an adapted target drifted."""
    ours, theirs = (greedy_outputs(OurDecoder(m), prompts, max_new_tokens)
                    for m in (reference, other))
    shares = [_common_prefix(a, b) / max(len(a), 1) for a, b in zip(ours, theirs, strict=True)]
    return sum(shares) / max(len(shares), 1)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first difference (the shorter length when one is a prefix of the other)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def lossless_mismatches(
    method: Method,
    prompts: Sequence[tuple[str, Sequence[int]]],
    reference: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[Mismatch]:
    """Every prompt (id, ids) whose greedy output under `method` differs from `reference`
    (the baseline's greedy outputs, see `greedy_outputs`)."""
    outputs = greedy_outputs(method.decoder, [ids for _, ids in prompts], max_new_tokens, stop_ids)
    found = []
    for (prompt_id, ids), want, got in zip(prompts, reference, outputs, strict=True):
        if list(want) != list(got):
            at = _common_prefix(want, got)
            gap, tolerance = _closeness(method.baseline, [*ids, *want[:at]])
            found.append(Mismatch(method.name, method.draft_length, prompt_id, at,
                                  list(want[at:]), list(got[at:]), gap, tolerance))
    return found


def _closeness(baseline: Decoder, ids: list[int]) -> tuple[float | None, float]:
    """Plain decoding's top-2 logit gap after ids, and the near-tie tolerance of its dtype."""
    if not hasattr(baseline, "next_token_logits"):
        return None, 0.0
    logits, dtype = baseline.next_token_logits(ids)
    return top2_gap(logits), near_tie_tolerance(logits, dtype)


def repeated_ngram_share(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of n-grams in the outputs that repeat an earlier n-gram of the same output."""
    total = repeated = 0
    for tokens in outputs:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0
