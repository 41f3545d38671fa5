"""Side-by-side measurement of drafting methods against plain decoding of the same target.

Speedup is a ratio of tokens per second measured in the same process on the same prompts.
By default plain and speculative runs are interleaved prompt by prompt so that machine drift
hits both; warm-up generations are excluded. Every generation is timed the same way, around
the call, whichever library runs it (ours or Hugging Face `generate`). Next to every speedup
stands a repetition measure: a small model's greedy output can collapse into loops that any
drafter predicts.

A sweep is a grid of methods x draft lengths x sampling settings (`SweepGrid`); each grid
point becomes one `SweepRow`. Building the decoders from configs is build.py's job: this
module receives them ready (`Method`) and only measures.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from selfspec.decode import GenerationResult, generate
from selfspec.drafters.base import Drafter
from selfspec.metrics import GenerationStats
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams

# Methods a sweep knows; the hf_* ones run Hugging Face `generate` on the same weights.
METHODS = ("small_model", "ngram", "medusa", "hf_assisted", "hf_prompt_lookup")
# Our method whose Hugging Face peer does the same thing (for the ours-over-HF ratio).
HF_PEERS = {"hf_assisted": "small_model", "hf_prompt_lookup": "ngram"}


# ---- decoders: one timed generation -------------------------------------------------------


class Decoder(Protocol):
    """One way to generate a continuation; wall_time_s is measured around the whole call.

    measures_draft_time: whether stats.draft_time_s holds the drafting time (False: unknown).
    """

    measures_draft_time: bool

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult: ...


@dataclass
class OurDecoder:
    """selfspec's decode loop: plain decoding when drafter is None."""

    target: Transformer
    drafter: Drafter | None = None
    measures_draft_time: bool = True

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult:
        device = self.target.embed_tokens.weight.device
        generator = torch.Generator(device=device).manual_seed(seed)
        start = time.perf_counter()
        result = generate(self.target, list(prompt), drafter=self.drafter, sampling=sampling,
                          max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids) or None,
                          generator=generator)
        _sync(device)
        result.stats.wall_time_s = time.perf_counter() - start  # timed like every decoder
        return result


@dataclass
class HFDecoder:
    """Hugging Face `generate` on the same weights: plain (no assistant, no lookup), assisted
    generation with a draft model (`assistant`), or prompt lookup (`prompt_lookup=True`).

    Drafts have a fixed length `num_draft_tokens` (constant schedule, no confidence cut-off).
    Acceptance is read from the target's forward calls: each call's input length gives the
    tokens drafted and the next call's cache length the tokens kept. Draft time is measured
    only for assisted generation (time inside the assistant's forwards: a lower bound).
    """

    model: Any  # a transformers PreTrainedModel (causal LM)
    assistant: Any | None = None
    num_draft_tokens: int = 0
    prompt_lookup: bool = False
    max_ngram: int = 3  # prompt lookup's longest n-gram, as NgramDrafter's default

    @property
    def measures_draft_time(self) -> bool:
        return self.assistant is not None

    def __call__(
        self, prompt: Sequence[int], sampling: SamplingParams, max_new_tokens: int, seed: int,
        stop_ids: Sequence[int],
    ) -> GenerationResult:
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.model.device)
        kwargs = {**self._mode_kwargs(), **_hf_sampling_kwargs(sampling)}
        torch.manual_seed(seed)  # HF samples from the global RNG
        with _ForwardLog(self.model, self.assistant) as log:
            start = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                eos_token_id=list(stop_ids) or None, pad_token_id=_pad_id(self.model), **kwargs,
            )
            _sync(ids.device)
            seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        stats = log.stats(len(prompt), len(tokens))
        stats.wall_time_s = seconds
        return GenerationResult(tokens, stats)

    def _mode_kwargs(self) -> dict[str, Any]:
        if self.assistant is not None:
            # transformers reads these from the assistant's own generation config.
            config = self.assistant.generation_config
            config.num_assistant_tokens = self.num_draft_tokens
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0  # 0 disables the early cut-off
            return {"assistant_model": self.assistant}
        if self.prompt_lookup:
            return {"prompt_lookup_num_tokens": self.num_draft_tokens,
                    "max_matching_ngram_size": self.max_ngram}
        return {}


def quiet_transformers() -> None:
    """Silence transformers' warnings (assisted generation warns on every draft call) so a
    sweep's progress bar and report stay readable. For entry points: it is process-wide."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def _hf_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    if sampling.greedy:
        return {"do_sample": False}
    # top_k=0 is passed explicitly: HF's own default would be 50.
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so the clock stops when the tokens really exist."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(model) -> int:
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0


class _ForwardLog:
    """Records (input length, cached length) of every target forward during one generate,
    and the time spent inside the assistant's forwards."""

    def __init__(self, model, assistant=None):
        self.model, self.assistant = model, assistant
        self.calls: list[tuple[int, int]] = []
        self.draft_seconds, self._tick, self._handles = 0.0, 0.0, []

    def __enter__(self) -> _ForwardLog:
        self._handles.append(self.model.register_forward_pre_hook(self._record, with_kwargs=True))
        if self.assistant is not None:
            self._handles.append(self.assistant.register_forward_pre_hook(self._start))
            self._handles.append(self.assistant.register_forward_hook(self._stop))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _record(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        cache = kwargs.get("past_key_values")
        self.calls.append((ids.shape[1], cache.get_seq_length() if cache is not None else 0))

    def _start(self, module, args) -> None:
        self._tick = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.draft_seconds += time.perf_counter() - self._tick

    def stats(self, prompt_len: int, new_tokens: int) -> GenerationStats:
        """Counters as our loop keeps them. Before call i the sequence holds c_i committed
        tokens (the prompt, then cache + the root); call i keeps c_{i+1} - c_i - 1 drafts."""
        stats = GenerationStats(new_tokens=new_tokens, draft_time_s=self.draft_seconds)
        committed = [prompt_len if past == 0 else past + 1 for _, past in self.calls]
        committed.append(prompt_len + new_tokens)
        for i, (length, past) in enumerate(self.calls):
            drafted = length - (prompt_len if past == 0 else 1)
            accepted = max(0, min(drafted, committed[i + 1] - committed[i] - 1))
            stats.record_step(drafted, drafted, accepted)
        return stats


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
        _accumulate(self.stats, result.stats)
        if repeat == 0:
            self.outputs.append(result.tokens)

    @property
    def tokens_per_s(self) -> list[float]:
        return [n / s if s else 0.0 for n, s in zip(self.new_tokens, self.seconds, strict=True)]


def _accumulate(total: GenerationStats, part: GenerationStats) -> None:
    for name in ("new_tokens", "steps", "target_forwards", "drafted", "accepted",
                 "wall_time_s", "draft_time_s"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for name in ("accept_histogram", "position_drafted", "position_accepted"):
        counts, more = getattr(total, name), getattr(part, name)
        counts.extend([0] * (len(more) - len(counts)))
        for i, value in enumerate(more):
            counts[i] += value


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


# ---- peak memory ---------------------------------------------------------------------------


class PeakMemory:
    """Peak memory while the block runs, in MiB (`peak_mb`), and what was measured (`kind`):

    - cuda_max_allocated: torch.cuda.max_memory_allocated, its peak reset on entry (tensors
      only, not the allocator's cache);
    - cpu_peak_rss_sampled: the process's resident set size (weights, caches, Python), read
      from /proc every `interval_s` by a thread: short spikes between samples can be missed;
    - cpu_lifetime_peak_rss: where /proc is missing, the process's peak RSS since it started.
    """

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.02):
        self.device, self.interval_s = torch.device(device), interval_s
        self.peak_mb, self.kind = 0.0, ""
        self._peak, self._done, self._thread = 0, threading.Event(), None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            self.kind = "cuda_max_allocated"
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss_bytes() is not None:
            self.kind = "cpu_peak_rss_sampled"
            self._peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        else:
            self.kind = "cpu_lifetime_peak_rss"
        return self

    def __exit__(self, *exc) -> None:
        if self.kind == "cuda_max_allocated":
            self._peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._done.set()
            self._thread.join()
            self._peak = max(self._peak, _rss_bytes() or 0)
        else:  # ru_maxrss is KiB on Linux, bytes on macOS
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._peak = rss if platform.system() == "Darwin" else rss * 1024
        self.peak_mb = self._peak / 2**20

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self._peak = max(self._peak, _rss_bytes() or 0)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---- the grid -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GridPoint:
    method: str
    draft_length: int
    sampling_name: str
    sampling: SamplingParams


@dataclass(frozen=True)
class SweepGrid:
    """methods x draft lengths x named sampling settings.

    medusa_depth: the depth of the Medusa tree. Medusa at draft length k uses the tree's
    nodes of depth <= k, so lengths beyond the depth would repeat the full tree: they are
    folded into one row at the tree's depth.
    """

    methods: tuple[str, ...]
    draft_lengths: tuple[int, ...]
    samplings: tuple[tuple[str, SamplingParams], ...]
    medusa_depth: int | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
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
        return [GridPoint(method, k, name, sampling)
                for name, sampling in self.samplings
                for method in dict.fromkeys(self.methods)
                for k in self.lengths_of(method)]


@dataclass(frozen=True)
class SweepRow:
    """One configuration's figures. tau counts the bonus token; tokens/s are medians over
    repeats (min/max beside them); speedup = median tokens/s over the baseline's, measured in
    the same run (speedup_min/max: the per-repeat ratios); lossless: greedy outputs equal the
    baseline's (None when sampling); draft_time_share: None where not measured;
    ours_over_hf: on hf_* rows, our peer method's tokens/s over this row's."""

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
        lossless=lossless,
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
) -> list[SweepRow]:
    """Measure every grid point in this process, in order, with a progress bar.

    make_method(name, k) builds a point's decoders when its turn comes (and they are dropped
    after it, with any draft caches). shared_baseline: measure each baseline once per sampling
    setting instead of beside every row (half the time, less robust to machine drift).
    """
    from tqdm.auto import tqdm

    rows, shared = [], {}
    bar = tqdm(points, desc="sweep", unit="config", disable=not progress)
    for point in bar:
        bar.set_postfix_str(f"{point.method} k={point.draft_length} {point.sampling_name}")
        method = make_method(point.method, point.draft_length)
        key = (method.baseline_name, point.sampling_name)
        row, base = measure_row(method, point, prompts, settings, shared.get(key), device)
        if shared_baseline:
            shared[key] = base
        rows.append(row)
    return add_peer_ratios(rows)


def add_peer_ratios(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """Set ours_over_hf on every hf_* row whose peer (same draft length and sampling) ran."""
    speed = {(r.method, r.draft_length, r.sampling): r.tokens_per_s for r in rows}
    out = []
    for r in rows:
        peer = speed.get((HF_PEERS.get(r.method), r.draft_length, r.sampling))
        ratio = peer / r.tokens_per_s if peer is not None and r.tokens_per_s else None
        out.append(SweepRow(**{**r.as_dict(), "ours_over_hf": ratio}))
    return out



def best_rows(rows: Sequence[SweepRow]) -> dict[str, dict[str, Any]]:
    """Per "method/sampling": the draft length with the highest speedup, and its figures."""
    best: dict[str, SweepRow] = {}
    for row in rows:
        key = f"{row.method}/{row.sampling}"
        if key not in best or row.speedup > best[key].speedup:
            best[key] = row
    keep = ("draft_length", "speedup", "tau", "tokens_per_s", "repeated_4gram_share", "lossless")
    return {key: {k: getattr(r, k) for k in keep} for key, r in best.items()}

# ---- results on disk ----------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: cores, threads, versions, accelerator."""
    import transformers

    facts = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        facts["cuda_device"] = torch.cuda.get_device_name(0)
    return facts


def write_results(
    rows: Sequence[SweepRow], folder: str | Path, extra: Mapping[str, Any] | None = None
) -> tuple[Path, Path]:
    """results.json ({**extra, "columns", "rows"}) and results.csv (one line per row; list
    cells as JSON) in folder; returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    records = [r.as_dict() for r in rows]
    json_path, csv_path = folder / "results.json", folder / "results.csv"
    payload = {**(extra or {}), "columns": list(COLUMNS), "rows": records}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table_rows(records))
    return json_path, csv_path


def table_rows(records: Sequence[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows with list cells turned into JSON text (for CSV files and W&B tables)."""
    for record in records:
        yield {k: json.dumps(v) if isinstance(v, list) else v for k, v in record.items()}


def format_table(rows: Sequence[SweepRow]) -> str:
    """A plain-text summary, one line per row, for the terminal."""
    head = (f"{'method':<17}{'k':>3} {'sampling':<8}{'tau':>6}{'acc':>6}{'tok/s':>9}"
            f"{'speedup':>9}{'rep4':>6}  lossless")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.method:<17}{r.draft_length:>3} {r.sampling:<8}{r.tau:>6.2f}"
            f"{r.acceptance_rate:>6.2f}{r.tokens_per_s:>9.1f}{r.speedup:>8.2f}x"
            f"{r.repeated_4gram_share:>6.2f}  {'' if r.lossless is None else r.lossless}"
        )
    return "\n".join(lines)


# ---- W&B ----------------------------------------------------------------------------------


def log_sweep(tracker, rows: Sequence[SweepRow], figures: Mapping[str, Path],
              summary: Mapping[str, Any]) -> None:
    """Rows as JSON-lines records and W&B history (step = row index), the whole grid as a
    wandb.Table, the figures as wandb.Image, and `summary` as the run summary."""
    for i, row in enumerate(rows):
        record = row.as_dict()
        record["acceptance_by_position"] = json.dumps(record["acceptance_by_position"])
        tracker.log(record, step=i)
    tracker.log_summary(dict(summary))
    if tracker.wandb_dir is None:
        return
    import wandb  # the tracker started the run, so wandb.run is it

    records = list(table_rows([r.as_dict() for r in rows]))
    table = wandb.Table(columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in records])
    media = {"results": table}
    media.update({f"plots/{name}": wandb.Image(str(path)) for name, path in figures.items()})
    wandb.run.log(media)


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

    def as_dict(self) -> dict:
        return asdict(self)


def compare_with_plain(
    target: Transformer,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    seed: int = 0,
) -> Comparison:
    """Generate every prompt with plain decoding and with the drafter, interleaved."""
    if not prompts:
        raise ValueError("compare_with_plain: no prompts to measure on")
    method = Method("drafter", drafter.max_nodes, OurDecoder(target, drafter), OurDecoder(target))
    point = GridPoint("drafter", drafter.max_nodes, "custom", sampling)
    settings = BenchSettings(max_new_tokens=max_new_tokens, seed=seed)
    row, _ = measure_row(method, point, prompts, settings, device=target.embed_tokens.weight.device)
    return Comparison(
        tau=row.tau, acceptance_rate=row.acceptance_rate, tokens_per_s=row.tokens_per_s,
        plain_tokens_per_s=row.baseline_tokens_per_s, speedup=row.speedup,
        draft_time_share=row.draft_time_share or 0.0,
        repeated_4gram_share=row.repeated_4gram_share, lossless=row.lossless,
        prompts=row.prompts, new_tokens=row.new_tokens,
    )


# ---- lossless check -----------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from plain greedy: where, and the tokens from there on."""

    method: str
    draft_length: int
    prompt_id: str
    position: int  # index of the first differing new token
    expected: list[int]
    got: list[int]

    def describe(self) -> str:
        return (f"{self.method} k={self.draft_length} on prompt {self.prompt_id}: first "
                f"difference at new token {self.position}: expected {self.expected[:8]}, "
                f"got {self.got[:8]}")


def greedy_outputs(
    decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    stop_ids: Sequence[int] = (),
) -> list[list[int]]:
    greedy = SamplingParams()
    return [decoder(p, greedy, max_new_tokens, 0, stop_ids).tokens for p in prompts]


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
    for (prompt_id, _), want, got in zip(prompts, reference, outputs, strict=True):
        if list(want) != list(got):
            at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                      min(len(want), len(got)))
            found.append(Mismatch(method.name, method.draft_length, prompt_id, at,
                                  list(want[at:]), list(got[at:])))
    return found


def repeated_ngram_share(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of n-grams in the outputs that repeat an earlier n-gram of the same output."""
    total = repeated = 0
    for tokens in outputs:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0
