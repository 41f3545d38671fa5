"""Measuring one method against its baseline: plain decoding of the same target, in the same
process, on the same prompts.

Speedup is a ratio of tokens per second. By default plain and speculative runs are interleaved
prompt by prompt so that machine drift hits both; warm-up generations are excluded. Every
generation is timed the same way, around the call, whichever library runs it (ours or Hugging
Face `generate`). Next to every speedup stands a repetition measure: a small model's greedy
output can collapse into loops that any drafter predicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from selfspec.decode import GenerationResult
from selfspec.drafters.base import Drafter
from selfspec.measure.divergence import describe_difference, first_difference
from selfspec.measure.grid import GridPoint, SweepRow, Variant
from selfspec.measure.memory import PeakMemory
from selfspec.measure.peers import Decoder, OurDecoder
from selfspec.metrics import SHARED_BY_ROWS, GenerationStats, describe_split
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams


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
    latencies: list[float] = field(default_factory=list)  # each prompt's, every repeat

    def add(self, repeat: int, result: GenerationResult) -> None:
        self.add_batch(repeat, [result], result.stats.wall_time_s)

    def add_batch(self, repeat: int, results: Sequence[GenerationResult],
                  seconds: float) -> None:
        """A batch's results (each row's wall time: its latency) and the batch's seconds."""
        if repeat == len(self.seconds):
            self.new_tokens.append(0)
            self.seconds.append(0.0)
        self.seconds[repeat] += seconds
        for j, result in enumerate(results):
            self.new_tokens[repeat] += result.stats.new_tokens
            self.latencies.append(result.stats.wall_time_s)
            # The batch's time, and the phase times its rows share, count once.
            shared = {} if j == 0 else dict.fromkeys(SHARED_BY_ROWS, 0)
            self.stats.merge(replace(result.stats, wall_time_s=0.0, **shared))
            if repeat == 0:
                self.outputs.append(result.tokens)
        self.stats.wall_time_s += seconds

    def latency(self, quantile: float) -> float | None:
        """A quantile of the prompts' latencies (0.5: the median), None without any."""
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    @property
    def tokens_per_s(self) -> list[float]:
        return [n / s if s else 0.0 for n, s in zip(self.new_tokens, self.seconds, strict=True)]


def run_passes(
    decoders: Sequence[Decoder],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams,
    settings: BenchSettings,
    batch_size: int = 1,
) -> list[Pass]:
    """Warm every decoder up, then time them interleaved prompt by prompt (batch by batch:
    consecutive prompts, the last batch as many as are left), repeat by repeat.

    Prompt i (a batch: its first prompt i) is generated with seed `settings.seed + i` in every
    repeat and by every decoder.
    """
    if not prompts:
        raise ValueError("run_passes: no prompts to measure on")
    warm_tokens = min(16, settings.max_new_tokens)
    for decoder in decoders:
        for w in range(settings.warmup):
            _decode(decoder, _batch_at(prompts, w * batch_size, batch_size), sampling,
                    warm_tokens, settings.seed, ())
        decoder.forget_learnt()  # the warmup decoded measured prompts
    passes = [Pass() for _ in decoders]
    for repeat in range(settings.repeats):
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            for decoder, summary in zip(decoders, passes, strict=True):
                summary.add_batch(repeat, *_decode(decoder, batch, sampling,
                                                   settings.max_new_tokens, settings.seed + i,
                                                   settings.stop_ids))
    return passes


def _batch_at(prompts: Sequence[Sequence[int]], start: int, size: int) -> list[Sequence[int]]:
    return [prompts[(start + j) % len(prompts)] for j in range(size)]


def _decode(decoder: Decoder, batch: Sequence[Sequence[int]], sampling: SamplingParams,
            max_new_tokens: int, seed: int, stop_ids: Sequence[int]
            ) -> tuple[list[GenerationResult], float]:
    """One prompt through decoder(...), several through decoder.batch(...): the results
    and the seconds the call took."""
    if len(batch) == 1:
        result = decoder(batch[0], sampling, max_new_tokens, seed, stop_ids)
        return [result], result.stats.wall_time_s
    return decoder.batch(batch, sampling, max_new_tokens, seed, stop_ids)


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
    batch = point.batch_size
    with PeakMemory(device) as memory:
        if baseline is None:
            baseline, ours = run_passes([method.baseline, method.decoder], prompts,
                                        point.sampling, settings, batch)
        else:
            (ours,) = run_passes([method.decoder], prompts, point.sampling, settings, batch)
    lossless = ours.outputs == baseline.outputs if point.sampling.greedy else None
    row = _row(method, point, ours, baseline, memory, lossless)
    if lossless is False:
        row = replace(row, first_difference=first_difference(
            method.baseline, prompts, baseline.outputs, ours.outputs))
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
        draft_ms_per_step=(1000 * stats.draft_time_s / (stats.loop_steps or stats.steps)
                           if method.decoder.measures_draft_time and stats.steps else None),
        time_split=stats.time_split, baseline_time_split=base.stats.time_split,
        variant=point.variant.as_dict(), peer_of=point.variant.peer_of,
        batch_size=point.batch_size, latency_s_mean=_mean(ours.latencies),
        latency_s_p90=ours.latency(0.9), baseline_latency_s_mean=_mean(base.latencies),
        baseline_latency_s_p90=base.latency(0.9), tau_by_position=stats.tau_by_position,
    )


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


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
    first_difference: dict | None = None  # lossless False: where (`divergence.first_difference`)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self, prompt_set: str) -> str:
        """One line: tau, speedup, both speeds, draft time share, losslessness, repetition,
        and where the drafter's time went."""
        return (f"tau {self.tau:.2f}, speedup x{self.speedup:.2f} over plain decoding "
                f"({self.tokens_per_s:.1f} vs {self.plain_tokens_per_s:.1f} tokens/s) on "
                f"{self.prompts} {prompt_set} prompts, draft time share "
                f"{self.draft_time_share:.2f}, lossless={self.lossless}"
                + (f" ({describe_difference(self.first_difference)})"
                   if self.first_difference else "") + ", repeated 4-grams "
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
    point = GridPoint(Variant("drafter"), drafter.max_nodes, "custom", sampling)
    settings = BenchSettings(max_new_tokens=max_new_tokens, seed=seed)
    row, _ = measure_row(method, point, prompts, settings, device=target.embed_tokens.weight.device)
    return Comparison(
        tau=row.tau, acceptance_rate=row.acceptance_rate, tokens_per_s=row.tokens_per_s,
        plain_tokens_per_s=row.baseline_tokens_per_s, speedup=row.speedup,
        draft_time_share=row.draft_time_share or 0.0,
        repeated_4gram_share=row.repeated_4gram_share, lossless=row.lossless,
        prompts=row.prompts, new_tokens=row.new_tokens, time_split=row.time_split,
        first_difference=row.first_difference,
    )


def repeated_ngram_share(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of n-grams in the outputs that repeat an earlier n-gram of the same output."""
    total = repeated = 0
    for tokens in outputs:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0
