"""Sweeps from configs (eval/sweep.py, eval/lossless.py): the grid, checked before any weights
load, the models it needs, loaded once, and each grid point's decoders."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from selfspec.draft_vocab import DraftVocab, load_draft_vocab
from selfspec.drafters import (
    Drafter,
    EagleDrafter,
    EarlyExitDrafter,
    LookupCorpus,
    SmallModelDrafter,
)
from selfspec.from_config.common import CONF_DIR, as_list, checked_settings, device, sampling_params
from selfspec.from_config.drafters import (
    SHIPPED,
    check_ngram_settings,
    early_exit_layers,
    early_exit_thresholds,
    load_eagle,
    load_early_exit,
    load_lookup_corpus,
    load_medusa,
    medusa_choices,
    medusa_drafter,
    merged_nodes,
    ngram_drafter,
    ngram_medusa_drafter,
    norm_exit,
    tree_depth,
    tree_node_counts,
)
from selfspec.from_config.models import (
    draft_model_config,
    load_hf_model,
    load_model,
    load_target,
    load_tokenizer,
    model_config,
    random_models,
    resolve_model_path,
)
from selfspec.from_config.prompts import sweep_prompt_texts
from selfspec.heads.eagle import EagleHead
from selfspec.heads.early_exit import ExitHead
from selfspec.heads.medusa import MedusaHeads
from selfspec.measure.autosize import SizeChoice, choose_size
from selfspec.measure.costs import CostProfile, covering_lengths, measure_cost_profile
from selfspec.measure.floor import FloorSettings
from selfspec.measure.grid import METHODS, GridPoint, SweepGrid, SweepRow
from selfspec.measure.passes import BenchSettings, Method
from selfspec.measure.peers import HFDecoder, OurDecoder
from selfspec.model import Transformer
from selfspec.prompts import Prompt
from selfspec.sampling import SamplingParams

NGRAM_CORPUS = "ngram/corpus"  # n-gram lookup in the context and the ngram.corpus file
NGRAM_MEDUSA = "ngram+medusa"  # Medusa's candidates and n-gram lookup's, merged
DEFAULT_SWEEP_METHODS = ("small_model", "ngram")  # + medusa, eagle when heads are given


BASELINE_MODES = ("interleaved", "shared")


_NEEDS_DRAFT_MODEL = ("small_model", "hf_assisted")


_HF_METHODS = ("hf_assisted", "hf_prompt_lookup")


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep will run, checked before any weights load: the grid, the prompt texts,
    and whether baselines are shared per sampling setting (else interleaved beside each row)."""

    grid: SweepGrid
    prompts: list[Prompt]
    shared_baseline: bool = False
    calibration: list[Prompt] = field(default_factory=list)  # auto rows' (see calibration_texts)


@dataclass
class SweepModels:
    """The weights a sweep's methods need, each loaded once (hf_*: transformers models)."""

    target: Transformer
    draft: Transformer | None = None
    draft_vocabs: dict[int, DraftVocab] = field(default_factory=dict)  # small_model/V{K} rows
    medusa_heads: MedusaHeads | None = None
    medusa_target: Transformer | None = None  # Medusa-2: the LoRA-adapted target they verify on
    tree: DictConfig | None = None  # Medusa's tree config (static or top-k products)
    eagle_head: EagleHead | None = None
    ngram: DictConfig | None = None  # n-gram lookup's settings
    lookup_corpus: LookupCorpus | None = None  # the ngram/corpus rows' corpus
    eagle: DictConfig | None = None  # EAGLE-2 tree settings: total_tokens, top_k, ...
    exits: dict | None = None  # early exits by (E, kind): the norm exits and trained adapters
    hf_target: Any = None
    hf_draft: Any = None


def plan_sweep(cfg: DictConfig, num_prompts: int, *, greedy_only: bool = False) -> SweepPlan:
    """The grid and prompts of cfg, or a clear error (unknown method or sampling, draft length
    < 1, medusa without heads, missing weights or prompt file, no prompts), before any load."""
    methods = sweep_methods(cfg)
    samplings = (("greedy", SamplingParams()),) if greedy_only else named_samplings(cfg.samplings)
    lengths = draft_lengths(cfg)
    mode = str(cfg.get("baseline", "interleaved"))
    if mode not in BASELINE_MODES:
        raise ValueError(f"unknown baseline mode {mode!r}: choose {' or '.join(BASELINE_MODES)}")
    split_time(cfg), cuda_graphs(cfg)  # these are checked now and used after loading
    if not _flag(cfg, "cost_profile") and wants_auto(cfg):
        raise ValueError("num_draft_tokens=auto predicts speedups from the cost profile: set "
                         "cost_profile=true, or drop auto")
    texts = sweep_prompt_texts(cfg.data, num_prompts)
    check_sweep_weights(cfg, methods)
    if "early_exit" in methods:
        methods = _expand(methods, "early_exit", early_exit_variants(cfg))
    if "small_model" in methods:
        methods = _expand(methods, "small_model", small_model_variants(cfg))
    if "ngram" in methods or NGRAM_MEDUSA in methods:
        check_ngram_settings(cfg.ngram, cfg.model)
    if "ngram" in methods and cfg.ngram.get("corpus"):
        methods = _expand(methods, "ngram", ngram_variants(cfg))
    if NGRAM_MEDUSA in methods:
        check_ngram_medusa(cfg)
        methods = _expand(methods, NGRAM_MEDUSA, ngram_medusa_variants(cfg))
    if "eagle" in methods:
        check_eagle_tree(cfg, lengths)
    depth = medusa_depth(cfg) if "medusa" in methods else None
    # The lossless check (greedy_only) needs no auto rows: they repeat a fixed length.
    grid = SweepGrid(methods, lengths, samplings, depth, auto=wants_auto(cfg) and not greedy_only)
    return SweepPlan(grid, texts, mode == "shared", calibration_texts(cfg, num_prompts, grid))


def sweep_methods(cfg: DictConfig) -> tuple[str, ...]:
    """cfg.methods as names (one name, as a multirun job gets it, counts too); null means
    small_model and ngram, plus medusa when cfg.medusa_heads is set and eagle when
    cfg.eagle_head is."""
    raw, heads, eagle = cfg.get("methods"), cfg.get("medusa_heads"), cfg.get("eagle_head")
    exits = cfg.get("early_exit", {}).get("exits")
    if raw is None:
        return DEFAULT_SWEEP_METHODS + (("medusa",) if heads else ()) + (
            ("eagle",) if eagle else ()) + (("early_exit",) if exits else ())
    methods = tuple(dict.fromkeys(str(m) for m in as_list(raw)))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or '(none given)'} in methods: choose from "
                         f"{', '.join(METHODS)}, e.g. methods=[small_model,ngram]")
    for method in ("medusa", NGRAM_MEDUSA):
        if method in methods and not heads:
            raise ValueError(f"method {method} needs trained heads: set medusa_heads=/path/to/"
                             f"run/checkpoints/step_N/export (an export folder written by "
                             f"train/medusa.py)")
    if "eagle" in methods and not eagle:
        raise ValueError("method eagle needs a trained head: set eagle_head=/path/to/run/"
                         "checkpoints/step_N/export (an export folder written by train/eagle.py)")
    return methods


def draft_lengths(cfg: DictConfig) -> tuple[int, ...]:
    """The fixed draft lengths of num_draft_tokens (`auto` beside them: see wants_auto)."""
    values = [v for v in as_list(cfg.num_draft_tokens) if v != AUTO]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad or not values:
        raise ValueError(f"num_draft_tokens must be integers >= 1 (and optionally auto), got "
                         f"{as_list(cfg.num_draft_tokens)}: e.g. num_draft_tokens=[2,4,8] or "
                         f"num_draft_tokens=[1,2,3,4,auto] (auto chooses among the others)")
    return tuple(int(v) for v in values)


AUTO = "auto"


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


def check_sweep_weights(cfg: DictConfig, methods: tuple[str, ...]) -> None:
    """Every folder the methods need exists (nothing is loaded): target, draft, Medusa and
    EAGLE heads, early exits (one E{E} folder per exit layer)."""
    resolve_model_path(cfg.model)
    if set(methods) & set(_NEEDS_DRAFT_MODEL):
        resolve_model_path(draft_model_config(cfg), "model.draft")
    for key, trainer, users in (("medusa_heads", "medusa", ("medusa", NGRAM_MEDUSA)),
                                ("eagle_head", "eagle", ("eagle",))):
        if set(users) & set(methods):
            _check_head_folder(head_folder(cfg, key), key, trainer)
    exits = cfg.get("early_exit", {}).get("exits") if "early_exit" in methods else None
    if exits:
        for e in early_exit_layers(cfg, model_config(cfg.model).num_layers):
            _check_head_folder(Path(str(exits)).expanduser() / f"E{e}", "early_exit.exits",
                               "early_exit")


def head_folder(cfg: DictConfig, key: str) -> Path:
    """The folder of cfg[key] (medusa_heads, eagle_head): a path, or `shipped` for the heads
    that ship with the model, in selfspec/assets/heads/<model.name>/<key>/."""
    if str(cfg[key]) != SHIPPED:
        return Path(str(cfg[key])).expanduser()
    name = str(cfg.model.get("name"))
    folder = Path(str(resources.files("selfspec") / "assets" / "heads" / name / key))
    if not folder.is_dir():
        raise FileNotFoundError(f"{key}={SHIPPED}: none ship for model={name}; give the export "
                                f"folder of a training run (<run>/checkpoints/step_N/export)")
    return folder


def _check_head_folder(folder: Path, key: str, method: str) -> None:
    if not (folder / "head_config.json").is_file():
        raise FileNotFoundError(
            f"{key}={folder}: no head_config.json there; point it at an export folder "
            f"of train/{method}.py, e.g. outputs/{method}/<run>/checkpoints/step_0000200/"
            f"export")


# ---- early exit: E, kind and confidence stop as axes ------------------------------------------

EARLY_EXIT_NO_STOP = "nostop"


def early_exit_variants(cfg: DictConfig) -> tuple[str, ...]:
    """The early-exit rows' names, early_exit/E{E}/{kind}/stop{threshold} (or nostop): every
    early_exit.exit_layers x the norm exit (and the trained adapter when early_exit.exits names
    a train/early_exit.py export) x every early_exit.confidence_threshold."""
    layers = early_exit_layers(cfg, model_config(cfg.model).num_layers)
    kinds = ("norm", "adapter") if cfg.early_exit.get("exits") else ("norm",)
    stops = [EARLY_EXIT_NO_STOP if t is None else f"stop{t:g}"
             for t in early_exit_thresholds(cfg)]
    return tuple(f"early_exit/E{e}/{kind}/{stop}" for e in layers for kind in kinds
                 for stop in stops)


def _parse_early_exit(name: str) -> tuple[int, str, float | None]:
    """(E, kind, threshold) of an early_exit variant name."""
    _, layer, kind, stop = name.split("/")
    return int(layer[1:]), kind, None if stop == EARLY_EXIT_NO_STOP else float(stop[4:])


def small_model_variants(cfg: DictConfig) -> tuple[str, ...]:
    """The draft model's rows: for each K in small_model.draft_vocab (its K most frequent
    training tokens; null = the whole vocabulary) and each W in small_model.first_candidates
    (the first token's candidates), small_model[/V{K}][/top{W}] (/top1 is left out)."""
    group = cfg.get("small_model", {})
    sizes = as_list(group.get("draft_vocab")) or [None]
    widths = as_list(group.get("first_candidates")) or [1]
    if not all(_is_count(k) for k in sizes if k is not None):
        raise ValueError(f"small_model.draft_vocab: give token counts >= 1 (or null for the "
                         f"whole vocabulary), got {sizes}")
    if not all(map(_is_count, widths)):
        raise ValueError(f"small_model.first_candidates: give candidate counts >= 1 (1: a "
                         f"chain), got {widths}")
    return tuple("small_model" + ("" if k is None else f"/V{k}") + ("" if w == 1 else f"/top{w}")
                 for k in sizes for w in widths)


def ngram_variants(cfg: DictConfig) -> tuple[str, ...]:
    """n-gram lookup's rows with a corpus: ngram (the context alone), then ngram/corpus (chains)
    or ngram/corpus/tree{N} (trees of N nodes) for each of ngram.tree_nodes."""
    return ("ngram", *(NGRAM_CORPUS if n is None else f"{NGRAM_CORPUS}/tree{n}"
                       for n in tree_node_counts(cfg.ngram)))


def ngram_medusa_variants(cfg: DictConfig) -> tuple[str, ...]:
    """ngram+medusa's rows: with a corpus, ngram+medusa (lookup chains) or ngram+medusa/tree{N}
    (lookup trees of N nodes) for each of ngram.tree_nodes; without, one row of context chains."""
    if not cfg.ngram.get("corpus"):
        return (NGRAM_MEDUSA,)
    return tuple(NGRAM_MEDUSA if n is None else f"{NGRAM_MEDUSA}/tree{n}"
                 for n in tree_node_counts(cfg.ngram))


def check_ngram_medusa(cfg: DictConfig) -> None:
    """ngram+medusa's own settings: the merged size, and Medusa choices the heads can fill
    (read from the export's head_config.json, no weights)."""
    merged_nodes(cfg.ngram)
    depth, num_heads = medusa_choices(cfg.ngram).max_depth, _num_medusa_heads(cfg)
    if num_heads and depth > num_heads:
        raise ValueError(f"ngram.medusa_choices are {depth} deep but the heads of "
                         f"medusa_heads={cfg.medusa_heads} are {num_heads} (depth d uses head "
                         f"d-1); use choices at most {num_heads} deep")


def _tree_nodes(name: str) -> int | None:
    """N of an ngram/corpus/tree{N} or ngram+medusa/tree{N} row; None for any other name."""
    head, found, nodes = name.rpartition("/tree")
    return int(nodes) if found and head in (NGRAM_CORPUS, NGRAM_MEDUSA) else None


def _is_count(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _small_model_variant(name: str) -> tuple[int | None, int]:
    """(K, W) of a small_model[/V{K}][/top{W}] row: its draft vocabulary size (None: the
    whole vocabulary) and first-token candidates."""
    parts = name.split("/")[1:]
    size = next((int(p[1:]) for p in parts if p.startswith("V")), None)
    width = next((int(p[3:]) for p in parts if p.startswith("top")), 1)
    return size, width


def _expand(methods: tuple[str, ...], name: str, variants: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(v for m in methods for v in (variants if m == name else (m,)))


def check_eagle_tree(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """EAGLE drafts an EAGLE-2 tree as deep as each draft length k, with eagle.total_tokens
    nodes and eagle.top_k children per frontier node: every k must fit in total_tokens."""
    e = cfg.eagle
    for key in ("total_tokens", "top_k"):
        if isinstance(e[key], bool) or not isinstance(e[key], int) or e[key] < 1:
            raise ValueError(f"eagle.{key} must be an integer >= 1, got {e[key]!r}")
    if max(lengths) > e.total_tokens:
        raise ValueError(f"eagle.total_tokens ({e.total_tokens}) < the longest draft length "
                         f"({max(lengths)}): a tree that deep needs that many nodes; raise "
                         f"eagle.total_tokens or lower num_draft_tokens")


def medusa_depth(cfg: DictConfig) -> int:
    """The deepest Medusa draft: cfg.tree's depth (a top-k-products tree without one: every
    head), capped by the heads' count read from the export's head_config.json (no weights):
    node depth d needs head d-1."""
    num_heads = _num_medusa_heads(cfg)
    depth = tree_depth(cfg.tree) or num_heads
    return min(depth, num_heads or depth)


def _num_medusa_heads(cfg: DictConfig) -> int:
    """The heads' count of the medusa_heads export, from its head_config.json (0: unknown)."""
    meta = json.loads((head_folder(cfg, "medusa_heads") / "head_config.json").read_text())
    return int(meta.get("config", {}).get("num_heads", 0))


def bench_settings(cfg: DictConfig, stops: tuple[int, ...]) -> BenchSettings:
    b = cfg.bench
    return checked_settings(BenchSettings, "bench", max_new_tokens=int(b.max_new_tokens),
                            repeats=int(b.repeats), warmup=int(b.warmup), seed=int(cfg.seed),
                            stop_ids=stops)


def load_sweep_models(cfg: DictConfig, methods: tuple[str, ...]) -> SweepModels:
    """Load what `methods` need, once: ours in cfg.model.dtype, and the hf_* methods'
    transformers copies of the same folders in the same dtype."""
    dtype, on = cfg.model.dtype, device(cfg)
    models = SweepModels(load_target(cfg), ngram=cfg.get("ngram"))
    if any(m.split("/")[0] == "small_model" for m in methods):
        models.draft = load_model(draft_model_config(cfg), "model.draft", dtype, on)
        models.draft_vocabs = {k: load_draft_vocab(models.draft.source, k)
                               for m in methods if m.split("/")[0] == "small_model"
                               and (k := _small_model_variant(m)[0]) is not None}
    merged = any(m.startswith(NGRAM_MEDUSA) for m in methods)
    if "medusa" in methods or merged:
        models.medusa_heads, models.medusa_target = load_medusa(
            cfg, head_folder(cfg, "medusa_heads"), models.target)
        models.tree = cfg.tree
    if (merged and cfg.ngram.get("corpus")) or any(m.startswith(NGRAM_CORPUS) for m in methods):
        models.lookup_corpus = load_lookup_corpus(
            cfg.ngram, cfg.model, load_tokenizer(resolve_model_path(cfg.model)), models.target)
    if "eagle" in methods:
        models.eagle_head = load_eagle(head_folder(cfg, "eagle_head"), models.target)
        models.eagle = cfg.eagle
    if any(m.startswith("early_exit") for m in methods):
        models.exits = _early_exits(cfg, models.target)
    if set(methods) & set(_HF_METHODS):
        models.hf_target = load_hf_model(resolve_model_path(cfg.model), dtype, on)
    if "hf_assisted" in methods:
        folder = resolve_model_path(draft_model_config(cfg), "model.draft")
        models.hf_draft = load_hf_model(folder, dtype, on)
    return models


def build_method(
    models: SweepModels, name: str, k: int, split_time: bool | None = None,
    cuda_graphs: bool | None = None,
) -> Method:
    """Grid point (name, draft length k) as decoders, its baseline being plain decoding of
    the same target by the same library. An early_exit/E/kind/stop row drafts up to k tokens
    with that exit, stopping below that confidence threshold. Medusa at k drafts at most k
    deep (a static tree's nodes of depth <= k; top-k products over k heads); Medusa-2 heads
    draft for, and are compared with plain decoding of, their LoRA-adapted target
    ("plain_adapted"). EAGLE at k drafts an EAGLE-2 dynamic tree k deep (whatever version
    the head is). split_time, cuda_graphs: our decoders' (`generate`'s), drafted and plain
    alike."""
    if name.split("/")[0] in _OUR_METHODS:
        drafter = our_drafter(models, name, k)
        target, baseline = verified_target(models, name)
        ours, plain = (OurDecoder(target, d, split_time=split_time, cuda_graphs=cuda_graphs)
                       for d in (drafter, None))
        return Method(name, k, ours, plain, baseline, drafter.max_nodes)
    if name not in _HF_METHODS:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    _require(models.hf_target, name)
    assistant = _require(models.hf_draft, name) if name == "hf_assisted" else None
    decoder = HFDecoder(models.hf_target, assistant, num_draft_tokens=k,
                        prompt_lookup=name == "hf_prompt_lookup")
    return Method(name, k, decoder, HFDecoder(models.hf_target), "hf_plain", k)


_OUR_METHODS = ("small_model", "ngram", "medusa", NGRAM_MEDUSA, "eagle", "early_exit")


def our_drafter(models: SweepModels, name: str, k: int) -> Drafter:
    """Our method `name` (an early_exit/E/kind/stop or small_model/V{K}/top{W} variant too)
    at draft length k."""
    if name.startswith("early_exit/"):
        exit_layer, kind, threshold = _parse_early_exit(name)
        head = _require(models.exits, name).get((exit_layer, kind))
        return EarlyExitDrafter(_require(head, name), k, threshold)
    if name.split("/")[0] == "ngram":
        corpus = _require(models.lookup_corpus, name) if name != "ngram" else None
        return ngram_drafter(_require(models.ngram, name), k, corpus, _tree_nodes(name))
    if name.split("/")[0] == NGRAM_MEDUSA:
        cfg_ngram = _require(models.ngram, name)
        corpus = _require(models.lookup_corpus, name) if cfg_ngram.get("corpus") else None
        return ngram_medusa_drafter(cfg_ngram, k, _require(models.medusa_heads, name), corpus,
                                    _tree_nodes(name))
    if name.split("/")[0] == "small_model":
        size, width = _small_model_variant(name)
        vocab = None if size is None else _require(models.draft_vocabs.get(size), name)
        return SmallModelDrafter(_require(models.draft, name), num_draft_tokens=k,
                                 draft_vocab=vocab, first_candidates=width)
    if name == "eagle":
        e = _require(models.eagle, name)
        return EagleDrafter(_require(models.eagle_head, name), total_tokens=e.total_tokens,
                            depth=k, top_k=e.top_k, sampled_children=e.sampled_children)
    return medusa_drafter(_require(models.tree, name), _require(models.medusa_heads, name),
                          max_depth=k)


def verified_target(models: SweepModels, name: str) -> tuple[Transformer, str]:
    """The target a method's drafts are verified on, and its baseline's name: Medusa-2
    heads' LoRA-adapted target (for medusa and ngram+medusa), else the target."""
    uses_heads = name.split("/")[0] in ("medusa", NGRAM_MEDUSA)
    if uses_heads and models.medusa_target is not None:
        return models.medusa_target, "plain_adapted"
    return models.target, "plain"


def size_chooser(
    models: SweepModels, calibration: Sequence[Sequence[int]], profile: CostProfile,
    settings: BenchSettings,
) -> Callable[[GridPoint], SizeChoice]:
    """An auto point's draft length: each candidate length drafts the calibration prompts,
    and the one whose tau, draft sizes and draft time predict the highest speedup under the
    profile wins (`selfspec.measure.autosize.choose_size`)."""

    def choose(point: GridPoint) -> SizeChoice:
        target, _ = verified_target(models, point.method)
        candidates = {k: our_drafter(models, point.method, k) for k in point.candidates}
        return choose_size(target, candidates, calibration, profile, sampling=point.sampling,
                           max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                           stop_ids=settings.stop_ids)

    return choose


def _early_exits(cfg: DictConfig, target: Transformer) -> dict[tuple[int, str], ExitHead]:
    """{(E, kind): exit}: the norm exit at every early_exit.exit_layers, and the adapters of
    the early_exit.exits export (each refused for another target or another E)."""
    exits = {}
    for e in early_exit_layers(cfg, target.config.num_layers):
        exits[(e, "norm")] = norm_exit(target, e)
        if cfg.early_exit.get("exits"):
            folder = Path(str(cfg.early_exit.exits)).expanduser() / f"E{e}"
            exits[(e, "adapter")] = load_early_exit(folder, target, exit_layer=e)
    return exits


def _require(value, method: str):
    if value is None:
        raise ValueError(f"build_method: {method} needs weights that were not loaded; pass "
                         f"{method} to load_sweep_models")
    return value


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
) -> CostProfile | None:
    """c(N) of the target, measured once in the sweep's process (None when cfg.cost_profile
    is false): over a cache as long as the sweep's steps see on average (the mean prompt
    length + half of bench.max_new_tokens), at every forward length up to `longest` (capped
    at costs.PROFILE_MAX_TOKENS): `longest_forward(rows)` after the rows, or the cap before
    them when auto rows need it."""
    if not _flag(cfg, "cost_profile"):
        return None
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    cache_length = round(mean_prompt + int(cfg.bench.max_new_tokens) / 2)
    return measure_cost_profile(target, covering_lengths(longest), cache_length=cache_length,
                                cuda_graphs=cuda_graphs(cfg))


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
    lengths = {key: tuple(int(v) for v in as_list(cfg[key]))
               for key in ("draft_lengths", "cost_lengths")}
    return FloorSettings(prompt_tokens=int(cfg.prompt_tokens), new_tokens=int(cfg.new_tokens),
                         num_prompts=int(cfg.num_prompts), repeats=int(cfg.repeats),
                         seed=int(cfg.seed), cuda_graphs=cuda_graphs(cfg), **lengths)


def timing_models(cfg: DictConfig) -> tuple[Transformer, Any]:
    """The target and a transformers copy of the same weights (shared, for random weights)."""
    if cfg.model.get("random_weights"):
        return random_models(cfg)
    folder = resolve_model_path(cfg.model)
    return load_target(cfg), load_hf_model(folder, cfg.model.dtype, device(cfg))
