"""Sweeps from configs (eval/sweep.py, eval/lossless.py): the grid, checked before any weights
load, the models it needs, loaded once, and each grid point's decoders."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_count
from selfspec.drafters import Drafter
from selfspec.from_config.common import CONF_DIR, as_list, checked_settings, sampling_params
from selfspec.from_config.methods import Loaded, MethodEntry, cost_rows, entry, registry
from selfspec.from_config.methods.hf_peers import ONE_PROMPT
from selfspec.from_config.models import (
    compile_steps,
    load_hf_model,
    load_target,
    model_config,
    model_plan,
    resolve_model_path,
    target_spec,
)
from selfspec.from_config.prompts import sweep_prompt_texts
from selfspec.measure.autosize import SizeChoice, choose_size
from selfspec.measure.costs import CostProfile, covering_lengths, measure_cost_profile
from selfspec.measure.floor import FloorSettings
from selfspec.measure.grid import GridLine, GridPoint, SweepGrid, SweepRow, Variant
from selfspec.measure.oracle import eagle2_shape
from selfspec.measure.passes import BenchSettings, Method
from selfspec.measure.peers import OurDecoder
from selfspec.measure.prompts import Prompt
from selfspec.model import Transformer, loading
from selfspec.model.plan import plan_model
from selfspec.sampling import SamplingParams

BASELINE_MODES = ("interleaved", "shared")


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep will run, checked before any weights load: the grid, the prompt texts,
    and whether baselines are shared per sampling setting (else interleaved beside each row)."""

    grid: SweepGrid
    prompts: list[Prompt]
    shared_baseline: bool = False
    calibration: list[Prompt] = field(default_factory=list)  # auto rows' (see calibration_texts)


def plan_sweep(cfg: DictConfig, num_prompts: int, *, greedy_only: bool = False) -> SweepPlan:
    """The grid and prompts of cfg, or a clear error (unknown method or sampling, draft length
    < 1, a method without its heads, missing weights or prompt file, no prompts), before any
    load."""
    methods = sweep_methods(cfg)
    samplings = (("greedy", SamplingParams()),) if greedy_only else named_samplings(cfg.samplings)
    lengths = draft_lengths(cfg)
    mode = str(cfg.get("baseline", "interleaved"))
    if mode not in BASELINE_MODES:
        raise ValueError(f"unknown baseline mode {mode!r}: choose {' or '.join(BASELINE_MODES)}")
    split_time(cfg), cuda_graphs(cfg), compile_steps(cfg)  # checked now, used after loading
    if not _flag(cfg, "cost_profile") and wants_auto(cfg):
        raise ValueError("num_draft_tokens=auto predicts speedups from the cost profile: set "
                         "cost_profile=true, or drop auto")
    texts = sweep_prompt_texts(cfg.data, num_prompts)
    resolve_model_path(cfg.model)
    lines = tuple(line for method in methods for line in grid_lines(cfg, method, lengths))
    batches = (1,) if greedy_only else batch_sizes(cfg, methods)
    # The lossless check (greedy_only) needs no auto rows: they repeat a fixed length.
    grid = SweepGrid(lines, samplings, auto=wants_auto(cfg) and not greedy_only,
                     batch_sizes=batches)
    return SweepPlan(grid, texts, mode == "shared", calibration_texts(cfg, num_prompts, grid))


def grid_lines(cfg: DictConfig, method: MethodEntry, lengths: tuple[int, ...]
               ) -> tuple[GridLine, ...]:
    """A method's lines of the grid: its variants, each at the lengths it runs at; checked
    (its files, its settings) before any weights load."""
    method.check(cfg, lengths)
    return tuple(GridLine(v, method.lengths(cfg, v, lengths), auto=method.ours)
                 for v in method.variants(cfg, True))


def sweep_dry_run(cfg: DictConfig) -> str:
    """What a sweep would put where, without weights: the target's memory plan and placement,
    and the draft model's plan where a method runs it (beside the LM head, on cfg.device)."""
    runs_draft = any(method.runs_draft_model for method in sweep_methods(cfg))
    text = [model_plan(cfg).format()]
    draft = cfg.model.get("draft")
    if runs_draft and draft is not None and draft.get("arch") is not None:
        plan = plan_model(model_config(draft), draft.name, int(cfg.num_gpus))
        text += [f"draft model (on {cfg.device}, beside the LM head):", plan.format()]
    return "\n".join(text)


def sweep_methods(cfg: DictConfig) -> tuple[MethodEntry, ...]:
    """cfg.methods as registry entries (one name, as a multirun job gets it, counts too); null
    means every method whose `default_when` holds: small_model and ngram, plus medusa when
    cfg.medusa_heads is set, eagle when cfg.eagle_head is, early_exit when early_exit.exits
    is."""
    raw = cfg.get("methods")
    if raw is None:
        return tuple(e for e in registry().values() if e.default_when(cfg))
    names = tuple(dict.fromkeys(str(m) for m in as_list(raw)))
    unknown = [m for m in names if m not in registry()]
    if unknown or not names:
        raise ValueError(f"unknown method(s) {unknown or '(none given)'} in methods: choose from "
                         f"{', '.join(registry())}, e.g. methods=[small_model,ngram]")
    return tuple(entry(name) for name in names)


def draft_lengths(cfg: DictConfig) -> tuple[int, ...]:
    """The fixed draft lengths of num_draft_tokens (`auto` beside them: see wants_auto)."""
    values = [v for v in as_list(cfg.num_draft_tokens) if v != AUTO]
    bad = [v for v in values if not is_count(v)]
    if bad or not values:
        raise ValueError(f"num_draft_tokens must be integers >= 1 (and optionally auto), got "
                         f"{as_list(cfg.num_draft_tokens)}: e.g. num_draft_tokens=[2,4,8] or "
                         f"num_draft_tokens=[1,2,3,4,auto] (auto chooses among the others)")
    return tuple(int(v) for v in values)


AUTO = "auto"


def batch_sizes(cfg: DictConfig, methods: Sequence[MethodEntry]) -> tuple[int, ...]:
    """bench.batch_sizes (default [1]): prompts decoded together, each batch size a set of
    rows; transformers' assisted generation and prompt lookup take one prompt."""
    sizes = tuple(as_list(cfg.bench.get("batch_sizes")) or (1,))
    if not all(map(is_count, sizes)):
        raise ValueError(f"bench.batch_sizes: give integers >= 1, e.g. [1,2,4,8], got "
                         f"{list(sizes)}")
    one_prompt = [m.name for m in methods if m.name in ONE_PROMPT]
    if max(sizes) > 1 and one_prompt:
        raise ValueError(f"{', '.join(one_prompt)} decode one prompt at a time (transformers); "
                         f"leave them out of methods or set bench.batch_sizes=[1]")
    return tuple(dict.fromkeys(sizes))


def wants_auto(cfg: DictConfig) -> bool:
    """num_draft_tokens holds `auto`: a row per method at the length chosen among the others
    by calibration (`selfspec.measure.autosize`); for Medusa and EAGLE the length is the tree's
    depth, so auto picks among trees of different sizes and shapes."""
    return AUTO in as_list(cfg.num_draft_tokens)


def calibration_texts(cfg: DictConfig, num_prompts: int, grid: SweepGrid) -> list[Prompt]:
    """The auto rows' calibration prompts: the auto.calibration_prompts prompts of the data
    set that follow the evaluated ones, so a size is never chosen on the prompts it is
    measured on. None needed without auto rows."""
    if not grid.auto:
        return []
    count = int(cfg.get("auto", {}).get("calibration_prompts", 4))
    evaluated = min(int(num_prompts), int(cfg.data.num_prompts))
    texts = sweep_prompt_texts(cfg.data, evaluated + count)[evaluated:]
    if count < 1 or len(texts) < count:
        raise ValueError(f"auto draft lengths need auto.calibration_prompts >= 1 prompts after "
                         f"the {evaluated} evaluated ones; {cfg.data.name} has {len(texts)} "
                         f"more (raise data.num_prompts, or lower bench.num_prompts or "
                         f"auto.calibration_prompts)")
    return texts


def named_samplings(names) -> tuple[tuple[str, SamplingParams], ...]:
    """Sampling settings by their conf/sampling/ file names, e.g. [greedy, t1, top_p]."""
    found = []
    for name in as_list(names):
        path = CONF_DIR / "sampling" / f"{name}.yaml"
        if not path.is_file():
            options = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise ValueError(f"unknown sampling setting {name!r}: choose from "
                             f"{', '.join(options)} (files in {path.parent})")
        found.append((str(name), sampling_params(OmegaConf.load(path))))
    if not found:
        raise ValueError("samplings is empty: give at least one, e.g. samplings=[greedy]")
    return tuple(found)


def bench_settings(cfg: DictConfig, stops: tuple[int, ...]) -> BenchSettings:
    b = cfg.bench
    return checked_settings(BenchSettings, "bench", max_new_tokens=int(b.max_new_tokens),
                            repeats=int(b.repeats), warmup=int(b.warmup), seed=int(cfg.seed),
                            stop_ids=stops)


def load_sweep_models(cfg: DictConfig, variants: Sequence[Variant]) -> Loaded:
    """The target and what `variants` need, each loaded once: ours in cfg.model.dtype, and the
    Hugging Face peers' transformers copies of the same folders in the same dtype."""
    loaded = Loaded(cfg, load_target(cfg))
    chosen: dict[str, list[Variant]] = {}
    for variant in variants:
        chosen.setdefault(variant.method, []).append(variant)
    for name, of_method in chosen.items():
        entry(name).load(loaded, tuple(of_method))
    return loaded


def build_method(
    loaded: Loaded, variant: Variant, k: int, split_time: bool | None = None,
    cuda_graphs: bool | None = None,
) -> Method:
    """Grid point (variant, draft length k) as decoders, its baseline being plain decoding of
    the same target by the same library: our drafter on the target its method verifies on
    (Medusa-2 heads: their LoRA-adapted target, "plain_adapted"), or a peer's own decoders.
    split_time, cuda_graphs: our decoders' (`generate`'s), drafted and plain alike."""
    method = entry(variant.method)
    if not method.ours:
        return method.method(loaded, variant, k)
    drafter = method.drafter(loaded, variant, k)
    target, baseline = method.verified_on(loaded)
    ours, plain = (OurDecoder(target, d, split_time=split_time, cuda_graphs=cuda_graphs)
                   for d in (drafter, None))
    return Method(variant.label(), k, ours, plain, baseline, drafter.max_nodes)


def our_drafter(loaded: Loaded, variant: Variant, k: int) -> Drafter:
    """Our drafter of `variant` at draft length k (a peer of another library has none)."""
    method = entry(variant.method)
    if not method.ours:
        raise ValueError(f"{variant.label()} runs Hugging Face's generate, not a selfspec "
                         f"drafter; eval/sweep.py measures it")
    return method.drafter(loaded, variant, k)


def verified_target(loaded: Loaded, variant: Variant) -> tuple[Transformer, str]:
    """The target a variant's drafts are verified on, and its baseline's name."""
    return entry(variant.method).verified_on(loaded)


def size_chooser(
    loaded: Loaded, calibration: Sequence[Sequence[int]], profile: CostProfile,
    settings: BenchSettings,
) -> Callable[[GridPoint], SizeChoice]:
    """An auto point's draft length: each candidate length drafts the calibration prompts,
    and the one whose tau, draft sizes and draft time predict the highest speedup under the
    profile wins (`selfspec.measure.autosize.choose_size`)."""

    def choose(point: GridPoint) -> SizeChoice:
        target, _ = verified_target(loaded, point.variant)
        candidates = {k: our_drafter(loaded, point.variant, k) for k in point.candidates}
        return choose_size(target, candidates, calibration, profile, sampling=point.sampling,
                           max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                           stop_ids=settings.stop_ids)

    return choose


def method_colors() -> dict[str, str]:
    """Each method's colour in the figures, from the registry."""
    return {name: e.color for name, e in registry().items() if e.color}


def split_time(cfg: DictConfig) -> bool | None:
    """cfg.split_time (true, false or null), see `generate`: true times every phase of every
    step on any device, synchronizing CUDA at each phase boundary."""
    return _true_false_or_null(cfg, "split_time", True)


def cuda_graphs(cfg: DictConfig) -> bool | None:
    """cfg.cuda_graphs (null = on for CUDA, true or false), see `generate`."""
    return _true_false_or_null(cfg, "cuda_graphs", None)


def _true_false_or_null(cfg: DictConfig, key: str, default: bool | None) -> bool | None:
    value = cfg.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{key} must be true, false or null, got {value!r}")
    return value


def sweep_cost_profile(
    cfg: DictConfig, target: Transformer, prompts: Sequence[Sequence[int]], longest: int,
    batch_size: int = 1,
) -> CostProfile | None:
    """c(N) of the target, measured once in the sweep's process (None when cfg.cost_profile
    is false): over a cache as long as the sweep's steps see on average (the mean prompt
    length + half of bench.max_new_tokens), at every forward length up to `longest` (capped
    at costs.PROFILE_MAX_TOKENS): `longest_forward(rows)` after the rows, or the cap before
    them when auto rows need it; at batch_size rows a forward."""
    if not _flag(cfg, "cost_profile"):
        return None
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    cache_length = round(mean_prompt + int(cfg.bench.max_new_tokens) / 2)
    return measure_cost_profile(target, covering_lengths(longest), cache_length=cache_length,
                                cuda_graphs=cuda_graphs(cfg), batch_size=batch_size)


def longest_forward(rows: Sequence[SweepRow]) -> int:
    """The most tokens a verification forward of the rows fed: draft nodes + 1."""
    return max(max(r.draft_nodes or r.draft_length, len(r.nodes_histogram) - 1) + 1
               for r in rows)


def _flag(cfg: DictConfig, key: str) -> bool:
    value = cfg.get(key, True)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def floor_settings(cfg: DictConfig) -> FloorSettings:
    """eval/bench_decode.py's settings, checked before any model loads."""
    compile_steps(cfg)  # used when the target loads
    lengths = {key: tuple(int(v) for v in as_list(cfg[key]))
               for key in ("draft_lengths", "cost_lengths")}
    methods = tuple(str(m) for m in as_list(cfg.get("methods") or []))
    if unknown := [name for name in methods if name not in cost_rows()]:
        raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(cost_rows())}")
    return FloorSettings(prompt_tokens=int(cfg.prompt_tokens), new_tokens=int(cfg.new_tokens),
                         num_prompts=int(cfg.num_prompts), repeats=int(cfg.repeats),
                         seed=int(cfg.seed), cuda_graphs=cuda_graphs(cfg),
                         oracle_trees=oracle_trees(cfg.get("oracle_trees") or []),
                         methods=methods,
                         method_tree=oracle_trees([cfg.get("method_tree", "chain4")])[0][1],
                         batch_sizes=tuple(int(b) for b in as_list(cfg.get("batch_sizes") or [])),
                         batch_draft_tokens=int(cfg.get("batch_draft_tokens", 4)), **lengths)


def oracle_trees(names) -> tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]:
    """(name, choices) of each tree the oracle hides its answer in: `eagle2` (EAGLE-2's
    published 60 nodes, depth 6, top-10: `eagle2_shape`) or a conf/tree/ file with choices."""
    found = []
    for name in as_list(names):
        path = CONF_DIR / "tree" / f"{name}.yaml"
        if name == "eagle2":
            choices = eagle2_shape().choices
        else:
            choices = OmegaConf.load(path).get("choices") if path.is_file() else None
        if choices is None:
            options = ["eagle2"] + sorted(p.stem for p in path.parent.glob("*.yaml")
                                          if OmegaConf.load(p).get("choices") is not None)
            raise ValueError(f"oracle_trees: unknown tree {name!r}: choose from "
                             f"{', '.join(options)}")
        found.append((str(name), tuple(tuple(int(r) for r in c) for c in choices)))
    return tuple(found)


def timing_models(cfg: DictConfig) -> tuple[Transformer, Any]:
    """The target and a transformers copy of the same weights (shared, for random weights)."""
    spec = target_spec(cfg)
    if spec.random_weights:
        return loading.random_models(spec)
    return loading.load(spec), load_hf_model(spec.folder, spec.dtype, spec.device)
