"""The only module that reads configs: turns the Hydra config tree (conf/) into library objects.

Entry points call these functions and stay short; everything below them takes plain values.
A model config names its weights four ways, tried in order: a local `path`, a shipped
package `asset` (selfspec/assets/<asset>), a `gguf` file inside an installed pip package
(converted once into a cache folder, `selfspec.converted`), the Hugging Face cache for
`hf_id` (never a download). Its `arch` block holds the architecture facts, so plans need no
weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from selfspec import training
from selfspec.bench import METHODS, BenchSettings, Method, SweepGrid
from selfspec.converted import GGUFSource, SourceNotInstalled, gguf_model_folder
from selfspec.data import (
    load_sharegpt,
    packed_chat_dataset,
    packed_stdlib_dataset,
    rows_from_dataset,
    self_distill,
    self_distill_rows,
)
from selfspec.decode import GenerationSettings
from selfspec.devices import check_device
from selfspec.drafters import (
    Drafter,
    MedusaDrafter,
    MedusaProductDrafter,
    NgramDrafter,
    SmallModelDrafter,
)
from selfspec.heads.io import load_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.lora import ADAPTER_DIR, LoraSettings, add_lora, merge_adapter
from selfspec.model import ModelConfig, Transformer
from selfspec.objectives import Medusa2Objective, MedusaObjective
from selfspec.peers import HFDecoder, OurDecoder
from selfspec.plan import ModelPlan, plan_model
from selfspec.prompts import (
    EncodedPrompt,
    Prompt,
    encode_prompts,
    humaneval_prompts,
    mt_bench_prompts,
    spec_bench_prompts,
    stdlib_heldout_prompts,
)
from selfspec.sampling import SamplingParams
from selfspec.training import TokenRows, TrainSettings
from selfspec.tree import Tree

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra config root (a repository folder, not package data)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DRAFTERS = ("small_model", "ngram", "none")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Fields where the config's facts and the checkpoint's config.json must agree.
_CHECKED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "model_type")


class ModelNotAvailable(ValueError):
    """The weights of a configured model are not on this machine (the message says why)."""


# ---- models --------------------------------------------------------------------------------


def model_config(cfg_model: DictConfig) -> ModelConfig:
    """The architecture (no weights) from a model config's `arch` block, or from the model
    folder's config.json when `arch` is null (a local model: `model=local model.path=...`)."""
    name = cfg_model.get("name")
    if cfg_model.get("arch") is None:
        config_file = resolve_model_path(cfg_model) / "config.json"
        return ModelConfig.from_hf(json.loads(config_file.read_text()))
    arch = OmegaConf.to_container(cfg_model.arch, resolve=True)
    if "head_dim" not in arch and {"hidden_size", "num_heads"} <= arch.keys():
        arch["head_dim"] = arch["hidden_size"] // arch["num_heads"]  # unless it differs
    arch["eos_token_ids"] = tuple(arch.get("eos_token_ids") or ())
    try:
        return ModelConfig(**arch)
    except TypeError as exc:  # an unknown or missing field
        raise ValueError(f"model config {name!r}: bad `arch` block ({exc})") from None


def model_plan(cfg: DictConfig) -> ModelPlan:
    """The memory plan of cfg.model over cfg.num_gpus GPUs, built on the meta device."""
    return plan_model(model_config(cfg.model), cfg.model.name, int(cfg.num_gpus))


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_path(cfg_model: DictConfig, key: str = "model") -> Path:
    """The local folder holding the model's weights, or ModelNotAvailable saying what was tried.

    key: where the config sits in the tree ("model", "model.draft"), for the message's fix.
    """
    if cfg_model.get("path"):
        folder = Path(cfg_model.path).expanduser()
        if _is_model_folder(folder):
            return folder
        tried = [f"{key}.path={folder}: no config.json there"]
        raise ModelNotAvailable(_unavailable_message(cfg_model, key, tried))
    tried = [f"{key}.path: not set"]
    if cfg_model.get("asset"):
        folder = Path(str(resources.files("selfspec") / "assets" / cfg_model.asset))
        if _is_model_folder(folder):
            return folder
        tried.append(f"the shipped asset {folder}: missing (build it: scripts/build_tiny.py)")
    if cfg_model.get("gguf"):
        return _converted_gguf(cfg_model, key)
    if cfg_model.get("hf_id"):
        folder = _hf_cache_snapshot(cfg_model.hf_id)
        if folder is not None:
            return folder
        cache = _hf_cache_dir()
        tried.append(f"the Hugging Face cache ({cache}): no snapshot of {cfg_model.hf_id}")
    raise ModelNotAvailable(_unavailable_message(cfg_model, key, tried))


def _converted_gguf(cfg_model: DictConfig, key: str) -> Path:
    """The cached conversion of the model's GGUF file (converted now if missing)."""
    g = cfg_model.gguf
    source = GGUFSource(str(g.package), str(g.version), str(g.file))
    try:
        return gguf_model_folder(str(cfg_model.name), source)
    except SourceNotInstalled as exc:
        raise SourceNotInstalled(f"model {cfg_model.name!r}: {exc} (or point {key}.path at a "
                                 f"model folder)") from None


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of repo_id, looked up without any network access."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, HFValidationError):  # LocalEntryNotFoundError is an OSError
        return None
    return folder if _is_model_folder(folder) else None


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _unavailable_message(cfg_model: DictConfig, key: str, tried: list[str]) -> str:
    name, hf_id = cfg_model.get("name"), cfg_model.get("hf_id")
    ident = f" (Hugging Face id {hf_id})" if hf_id else ""
    example = f", e.g. from `hf download {hf_id}` elsewhere" if hf_id else ""
    lines = [
        f"model {name!r}{ident} is not available on this machine.",
        "Tried:",
        *(f"  - {t}" for t in tried),
        f"Fix: point {key}.path=/local/folder at downloaded weights (a folder with config.json "
        f"and *.safetensors{example}).",
    ]
    if hf_id:
        lines.append(f"Otherwise this machine needs Hugging Face Hub access to download {hf_id} "
                     f"into its cache (nothing is downloaded here).")
    lines.append("dry_run=true prints the model's memory plan without weights.")
    return "\n".join(lines)


def device(cfg: DictConfig) -> torch.device:
    """cfg.device, checked: this machine has it (e.g. device=cuda needs a CUDA GPU)."""
    return check_device(cfg.get("device", "cpu"))


def load_target(cfg: DictConfig) -> Transformer:
    """The target model of cfg.model, checked against its config's architecture facts."""
    target = _load_model(cfg.model, "model", cfg.model.dtype, device(cfg))
    if cfg.model.get("arch") is not None:
        check_architecture(model_config(cfg.model), target.config, cfg.model.name, target.source)
    return target


def _load_model(
    cfg_model: DictConfig, key: str, dtype: str, on: torch.device
) -> Transformer:
    folder = resolve_model_path(cfg_model, key)
    return Transformer.from_pretrained(folder, dtype=torch_dtype(dtype), device=on)


def check_architecture(
    expected: ModelConfig, loaded: ModelConfig, name: str, source: str | None
) -> None:
    """Refuse weights whose config.json contradicts the config (the plan would be wrong)."""
    wrong = {f: (getattr(expected, f), getattr(loaded, f)) for f in _CHECKED_FIELDS
             if getattr(expected, f) != getattr(loaded, f)}
    if wrong:
        details = ", ".join(f"{f}: config {a} vs checkpoint {b}" for f, (a, b) in wrong.items())
        raise ValueError(
            f"the weights in {source} do not match model config {name!r} ({details}); point "
            f"model.path at that model's weights or choose the model config that matches them"
        )


def generation_settings(cfg: DictConfig) -> GenerationSettings:
    """eval/generate.py's settings, checked with its device, target folder and drafter choice
    before any model loads."""
    device(cfg)
    resolve_model_path(cfg.model)
    drafter_choice(cfg)
    return GenerationSettings(max_new_tokens=cfg.max_new_tokens,
                              sampling=sampling_params(cfg.sampling), seed=int(cfg.seed))


def drafter_choice(cfg: DictConfig) -> tuple[str, int]:
    """(cfg.drafter, cfg.num_draft_tokens), checked; the small draft model must be on disk."""
    kind, k = cfg.drafter, cfg.num_draft_tokens
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DRAFTERS)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
    if kind == "small_model":
        resolve_model_path(_draft_model_config(cfg, "use drafter=ngram"), "model.draft")
    return kind, k


def build_drafter(cfg: DictConfig, target: Transformer) -> Drafter | None:
    """The drafter named by cfg.drafter (small_model | ngram | none); None = plain decoding."""
    kind, k = drafter_choice(cfg)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(num_draft_tokens=k)
    draft_cfg = _draft_model_config(cfg, "use drafter=ngram")
    draft = _load_model(draft_cfg, "model.draft", cfg.model.dtype, device(cfg))
    return SmallModelDrafter(draft, num_draft_tokens=k)


# ---- sampling and prompts ------------------------------------------------------------------


def sampling_params(cfg_sampling: DictConfig) -> SamplingParams:
    return _settings(SamplingParams, "sampling", temperature=float(cfg_sampling.temperature),
                     top_k=int(cfg_sampling.top_k), top_p=float(cfg_sampling.top_p))


def _settings(cls: type, section: str, **values: Any) -> Any:
    """cls(**values), its errors naming the setting as the config does (sampling.top_p)."""
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"{cls.__name__}: ", f"{section}.", 1)) from None


def data_path(cfg_data: DictConfig) -> Path:
    """The data config's question file, checked: cfg_data.path when set (a relative path is
    relative to the repository root, so runs work from any cwd), else the copy shipped in the
    package (cfg_data.asset, under selfspec/assets/)."""
    if cfg_data.get("path"):
        path = Path(cfg_data.path).expanduser()
        path = path if path.is_absolute() else (REPO_ROOT / path).resolve()
    elif cfg_data.get("asset"):
        path = Path(str(resources.files("selfspec") / "assets" / cfg_data.asset))
    else:
        raise ValueError(f"data config {cfg_data.name!r} names no question file: set "
                         f"data.path=/file.jsonl")
    if not path.is_file():
        raise FileNotFoundError(
            f"{cfg_data.name} question file not found: {path}; set data.path=/file.jsonl"
        )
    return path


def prompts(cfg_data: DictConfig) -> list[Prompt]:
    """The first cfg_data.num_prompts prompts of the data config's prompt set."""
    name, n = cfg_data.name, int(cfg_data.num_prompts)
    if n < 1:
        raise ValueError(f"data.num_prompts must be >= 1, got {n}")
    if name == "humaneval":
        found = humaneval_prompts()
    elif name == "stdlib_heldout":
        found = stdlib_heldout_prompts(n, int(cfg_data.num_lines))
    elif name == "mt_bench":
        found = mt_bench_prompts(data_path(cfg_data))
    elif name == "spec_bench":
        found = spec_bench_prompts(data_path(cfg_data))
    else:
        raise ValueError(
            f"unknown prompt set {name!r}: choose humaneval, stdlib_heldout, mt_bench or spec_bench"
        )
    return found[:n]


def load_prompts(cfg_data: DictConfig, tokenizer) -> list[EncodedPrompt]:
    """The data config's prompts as token ids of `tokenizer` (a `transformers` tokenizer)."""
    return encode_prompts(
        prompts(cfg_data), tokenizer, int(cfg_data.max_prompt_tokens), bool(cfg_data.chat)
    )



# ---- training ------------------------------------------------------------------------------


# Settings a resumed run may change: they shape neither the weights nor the optimizer.
RESUMABLE_CHANGES = (
    "trainer.resume", "trainer.stop_after", "trainer.threads", "trainer.log_every",
    "trainer.eval_every", "trainer.eval_rows", "trainer.save_every", "trainer.keep_checkpoints",
    "train_data.cache_dir", "final_eval", "wandb", "tree", "data", "sampling", "device",
    "dry_run", "num_gpus", "run_dir",
)


def record_run_config(cfg: DictConfig, settings: TrainSettings) -> None:
    """Keep cfg in the run folder; a resume with other weight- or optimizer-shaping settings
    is refused (see `training.record_run_config`)."""
    training.record_run_config(settings.run_dir, OmegaConf.to_container(cfg, resolve=True),
                               resume=settings.resume, may_change=RESUMABLE_CHANGES)


def train_settings(cfg: DictConfig) -> TrainSettings:
    """TrainSettings from cfg.trainer and cfg.optim (the run folder is cfg.run_dir)."""
    t, o = cfg.trainer, cfg.optim
    return TrainSettings(
        run_dir=str(cfg.run_dir), max_steps=int(t.max_steps),
        micro_batch_size=int(t.micro_batch_size), grad_accum=int(t.grad_accum),
        lr=float(o.lr), weight_decay=float(o.weight_decay), warmup_steps=int(o.warmup_steps),
        clip_grad=float(o.clip_grad), log_every=int(t.log_every), eval_every=int(t.eval_every),
        eval_rows=int(t.eval_rows), save_every=int(t.save_every),
        keep_checkpoints=int(t.keep_checkpoints), seed=int(cfg.seed), resume=bool(t.resume),
        stop_after=None if t.stop_after is None else int(t.stop_after),
    )


def deepspeed_config(cfg: DictConfig) -> dict | None:
    """The DeepSpeed config dict of cfg.deepspeed, or None without DeepSpeed."""
    config = cfg.deepspeed.get("config")
    return None if config is None else OmegaConf.to_container(config, resolve=True)


def load_tokenizer(folder: str | Path):
    """The `transformers` tokenizer saved in a model folder (refused clearly if there is none)."""
    from transformers import AutoTokenizer  # slow import: only when weights are there

    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in model folder {folder} (none of {', '.join(TOKENIZER_FILES)}): "
            f"save the model's tokenizer there (tokenizer.save_pretrained(folder))")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except OSError as exc:  # unreadable or incomplete tokenizer files
        raise ValueError(f"cannot load the tokenizer in {folder} ({exc})") from None


def training_rows(
    cfg: DictConfig, tokenizer, target: Transformer | None = None
) -> tuple[TokenRows, TokenRows]:
    """(train, held-out) packed rows of cfg.train_data at cfg.trainer.seq_len; with
    train_data.self_distill the target rewrites the assistant turns (sharegpt) or continues
    each corpus row after its first tokens (stdlib) first."""
    source, seq_len = cfg.train_data.source, int(cfg.trainer.seq_len)
    if source == "stdlib":
        cache = cfg.train_data.get("cache_dir")
        train, heldout = (
            rows_from_dataset(packed_stdlib_dataset(tokenizer, split, seq_len, cache))
            for split in ("train", "heldout")
        )
        if self_distill_enabled(cfg):
            train, heldout = _distilled_corpus(cfg, target, train, heldout)
    elif source == "sharegpt":
        if not cfg.train_data.get("path"):
            raise ValueError("train_data.source=sharegpt needs train_data.path=/file.json")
        conversations = load_sharegpt(cfg.train_data.path)
        if self_distill_enabled(cfg):
            conversations = self_distill(
                conversations, target, tokenizer, seed=int(cfg.seed),
                max_new_tokens=int(cfg.train_data.self_distill_max_new_tokens),
            )
        cut = max(1, len(conversations) // 20)  # every 20th conversation is held out
        train, heldout = (
            rows_from_dataset(packed_chat_dataset(tokenizer, part, seq_len))
            for part in (conversations[cut:], conversations[:cut])
        )
    else:
        raise ValueError(f"unknown train_data.source {source!r}: choose stdlib or sharegpt")
    cap = cfg.train_data.get("max_rows")
    if cap is not None:
        train = train.select(torch.arange(min(int(cap), len(train))))
    return train, heldout


def self_distill_enabled(cfg: DictConfig) -> bool:
    """train_data.self_distill: true, false, or auto (stdlib yes: batched and cheap;
    sharegpt no: regenerating a chat set one conversation at a time is a long job)."""
    value = cfg.train_data.get("self_distill", False)
    if value == "auto":
        return cfg.train_data.source == "stdlib"
    if not isinstance(value, bool):
        raise ValueError(f"train_data.self_distill must be true, false or auto, got {value!r}")
    return value


def _distilled_corpus(
    cfg: DictConfig, target: Transformer | None, train: TokenRows, heldout: TokenRows
) -> tuple[TokenRows, TokenRows]:
    """The stdlib rows continued by the target itself: as many training rows as the run will
    draw (steps x global batch, or train_data.max_rows if fewer) and the held-out rows that
    evaluation reads."""
    if target is None:
        raise ValueError("train_data.self_distill needs the target to generate with")
    t = cfg.trainer
    drawn = (int(t.max_steps) * int(t.micro_batch_size) * int(t.grad_accum)
             * int(os.environ.get("WORLD_SIZE", "1")))
    cap = cfg.train_data.get("max_rows")
    options = {"prompt_tokens": int(cfg.train_data.self_distill_prompt_tokens),
               "cache_dir": cfg.train_data.get("cache_dir")}
    return (self_distill_rows(train, target, count=min(drawn, int(cap or drawn)), **options),
            self_distill_rows(heldout, target, count=int(t.eval_rows), **options))


def tree_depth(cfg_tree: DictConfig) -> int | None:
    """How deep a tree config drafts: a static tree's depth, a top-k-products config's `depth`
    (None: as many heads as there are)."""
    if cfg_tree.get("choices") is not None:
        return Tree.from_paths(OmegaConf.to_container(cfg_tree.choices)).max_depth
    return None if cfg_tree.get("depth") is None else int(cfg_tree.depth)


def medusa_drafter(
    cfg_tree: DictConfig, heads: MedusaHeads, max_depth: int | None = None
) -> MedusaDrafter | MedusaProductDrafter:
    """The Medusa drafter of a tree config (conf/tree/), at most max_depth deep: a static tree
    (`choices`: its nodes of depth <= max_depth) or a dynamic one (`top_k`, `max_nodes`,
    optional `depth`: each step's best paths of the heads' top-k products)."""
    name = cfg_tree.get("name")
    if cfg_tree.get("choices") is not None:
        choices = OmegaConf.to_container(cfg_tree.choices)
        if max_depth is not None:
            choices = [c for c in choices if len(c) <= max_depth]
        return MedusaDrafter(heads, Tree.from_paths(choices))
    if cfg_tree.get("top_k") is None or cfg_tree.get("max_nodes") is None:
        raise ValueError(f"tree config {name!r} needs `choices` (a static tree) or `top_k` and "
                         f"`max_nodes` (a tree of the heads' top-k products); see conf/tree/")
    depth = tree_depth(cfg_tree) or heads.config.num_heads
    depth = depth if max_depth is None else min(depth, max_depth)
    return MedusaProductDrafter(heads, top_k=int(cfg_tree.top_k),
                                max_nodes=int(cfg_tree.max_nodes), depth=depth)


def medusa_config(cfg: DictConfig, target_config: ModelConfig) -> MedusaConfig:
    return MedusaConfig(
        hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
        num_heads=int(cfg.medusa.num_heads), num_layers=int(cfg.medusa.num_layers),
    )


def medusa_heads(cfg: DictConfig, target: Transformer) -> tuple[MedusaHeads, MedusaConfig]:
    """Fresh Medusa heads sized for the target (output layers copied from its LM head)."""
    config = medusa_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    heads = MedusaHeads(config).to(target.embed_tokens.weight.dtype)
    if cfg.medusa.init_from_lm_head:
        heads.init_from_lm_head(target.lm_head.weight.detach())
    return heads, config


def medusa_version(cfg: DictConfig) -> int:
    """1: heads on the frozen target (Medusa-1); 2: heads and LoRA on the target (Medusa-2)."""
    version = cfg.medusa.get("version", 1)
    if version not in (1, 2):
        raise ValueError(f"medusa.version must be 1 (frozen target) or 2 (joint training with "
                         f"LoRA on the target), got {version!r}")
    return int(version)


def lora_settings(cfg: DictConfig) -> LoraSettings:
    lora = cfg.medusa.lora
    return LoraSettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=tuple(str(m) for m in lora.target_modules))


def medusa_objective(
    cfg: DictConfig, target: Transformer, heads: MedusaHeads
) -> MedusaObjective | Medusa2Objective:
    """The training objective of cfg.medusa.version; Medusa-2 wraps the target with LoRA."""
    decay = float(cfg.medusa.decay)
    if medusa_version(cfg) == 1:
        return MedusaObjective(target, heads, decay=decay)
    adapted = add_lora(target, lora_settings(cfg))
    return Medusa2Objective(adapted, heads, decay=decay, lm_weight=float(cfg.medusa.lm_weight),
                            adapter_lr_scale=float(cfg.medusa.lora.lr_scale))


def load_medusa(
    cfg: DictConfig, folder: str | Path, target: Transformer
) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of a train/medusa.py export, and for a Medusa-2 export the target they draft
    for: a fresh copy of cfg's target with the export's LoRA adapter merged (None for
    Medusa-1, whose heads draft for `target` itself, which is never modified)."""
    heads = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    adapter = Path(folder) / ADAPTER_DIR
    return heads, merge_adapter(load_target(cfg), adapter) if adapter.is_dir() else None


# ---- sweeps (eval/sweep.py, eval/lossless.py) ----------------------------------------------

DEFAULT_SWEEP_METHODS = ("small_model", "ngram")  # + medusa when heads are given
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


@dataclass
class SweepModels:
    """The weights a sweep's methods need, each loaded once (hf_*: transformers models)."""

    target: Transformer
    draft: Transformer | None = None
    medusa_heads: MedusaHeads | None = None
    medusa_target: Transformer | None = None  # Medusa-2: the LoRA-adapted target they verify on
    tree: DictConfig | None = None  # Medusa's tree config (static or top-k products)
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
    texts = sweep_prompt_texts(cfg.data, num_prompts)
    check_sweep_weights(cfg, methods)
    depth = medusa_depth(cfg) if "medusa" in methods else None
    return SweepPlan(SweepGrid(methods, lengths, samplings, depth), texts, mode == "shared")


def sweep_methods(cfg: DictConfig) -> tuple[str, ...]:
    """cfg.methods as names (one name, as a multirun job gets it, counts too); null means
    small_model and ngram, plus medusa when cfg.medusa_heads is set."""
    raw, heads = cfg.get("methods"), cfg.get("medusa_heads")
    if raw is None:
        return DEFAULT_SWEEP_METHODS + (("medusa",) if heads else ())
    methods = tuple(dict.fromkeys(str(m) for m in _as_list(raw)))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown or '(none given)'} in methods: choose from "
                         f"{', '.join(METHODS)}, e.g. methods=[small_model,ngram]")
    if "medusa" in methods and not heads:
        raise ValueError("method medusa needs trained heads: set medusa_heads=/path/to/run/"
                         "checkpoints/step_N/export (an export folder written by train/medusa.py)")
    return methods


def draft_lengths(cfg: DictConfig) -> tuple[int, ...]:
    values = _as_list(cfg.num_draft_tokens)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad or not values:
        raise ValueError(f"num_draft_tokens must be integers >= 1, got {values}: e.g. "
                         f"num_draft_tokens=[2,4,8] (or num_draft_tokens=4)")
    return tuple(int(v) for v in values)


def named_samplings(names) -> tuple[tuple[str, SamplingParams], ...]:
    """Sampling settings by their conf/sampling/ file names, e.g. [greedy, t1, top_p]."""
    found = []
    for name in _as_list(names):
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
    """Every folder the methods need exists (nothing is loaded): target, draft, Medusa heads."""
    resolve_model_path(cfg.model)
    if set(methods) & set(_NEEDS_DRAFT_MODEL):
        resolve_model_path(_draft_model_config(cfg), "model.draft")
    if "medusa" in methods:
        folder = Path(str(cfg.medusa_heads)).expanduser()
        if not (folder / "head_config.json").is_file():
            raise FileNotFoundError(
                f"medusa_heads={folder}: no head_config.json there; point it at an export folder "
                f"of train/medusa.py, e.g. outputs/medusa/<run>/checkpoints/step_0000200/export"
            )


def medusa_depth(cfg: DictConfig) -> int:
    """The deepest Medusa draft: cfg.tree's depth (a top-k-products tree without one: every
    head), capped by the heads' count read from the export's head_config.json (no weights):
    node depth d needs head d-1."""
    meta = json.loads((Path(str(cfg.medusa_heads)).expanduser() / "head_config.json").read_text())
    num_heads = int(meta.get("config", {}).get("num_heads", 0))
    depth = tree_depth(cfg.tree) or num_heads
    return min(depth, num_heads or depth)


def _draft_model_config(
    cfg: DictConfig, otherwise: str = "leave small_model and hf_assisted out of methods"
) -> DictConfig:
    draft_cfg = cfg.model.get("draft")
    if draft_cfg is None or not any(draft_cfg.get(f) for f in ("path", "asset", "hf_id")):
        raise ValueError(
            f"model {cfg.model.name!r} has no standard small draft model: set "
            f"model.draft.path=/local/folder (a model with the target's tokenizer) or "
            f"{otherwise}"
        )
    return draft_cfg


def sweep_prompt_texts(cfg_data: DictConfig, num_prompts: int) -> list[Prompt]:
    """The first min(num_prompts, data.num_prompts) prompts of the data config, or an error."""
    if int(num_prompts) < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {num_prompts}")
    data = OmegaConf.merge(cfg_data, {"num_prompts": min(int(num_prompts),
                                                         int(cfg_data.num_prompts))})
    found = prompts(data)
    if not found:
        raise ValueError(f"prompt set {cfg_data.name!r} gave no prompts; check its data config "
                         f"(data.path, data.num_prompts)")
    return found


def encode_prompt_texts(
    cfg_data: DictConfig, texts: list[Prompt], tokenizer
) -> list[EncodedPrompt]:
    return encode_prompts(texts, tokenizer, int(cfg_data.max_prompt_tokens), bool(cfg_data.chat))


def stop_ids(cfg: DictConfig, target: Transformer, tokenizer) -> tuple[int, ...]:
    """EOS ids ending a generation (cfg.stop_at_eos), else () for fixed-length generations."""
    if not cfg.get("stop_at_eos", True):
        return ()
    if target.config.eos_token_ids:
        return tuple(target.config.eos_token_ids)
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def positive_int(cfg: DictConfig, key: str) -> int:
    """cfg's setting `key` (dotted), checked to be an integer >= 1."""
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def bench_settings(cfg: DictConfig, stops: tuple[int, ...]) -> BenchSettings:
    b = cfg.bench
    return _settings(BenchSettings, "bench", max_new_tokens=int(b.max_new_tokens),
                     repeats=int(b.repeats), warmup=int(b.warmup), seed=int(cfg.seed),
                     stop_ids=stops)


def load_sweep_models(cfg: DictConfig, methods: tuple[str, ...]) -> SweepModels:
    """Load what `methods` need, once: ours in cfg.model.dtype, and the hf_* methods'
    transformers copies of the same folders in the same dtype."""
    dtype, on = cfg.model.dtype, device(cfg)
    models = SweepModels(load_target(cfg))
    if "small_model" in methods:
        models.draft = _load_model(_draft_model_config(cfg), "model.draft", dtype, on)
    if "medusa" in methods:
        models.medusa_heads, models.medusa_target = load_medusa(cfg, str(cfg.medusa_heads),
                                                                models.target)
        models.tree = cfg.tree
    if set(methods) & set(_HF_METHODS):
        models.hf_target = load_hf_model(resolve_model_path(cfg.model), dtype, on)
    if "hf_assisted" in methods:
        folder = resolve_model_path(_draft_model_config(cfg), "model.draft")
        models.hf_draft = load_hf_model(folder, dtype, on)
    return models


def load_hf_model(folder: str | Path, dtype: str, on: torch.device | str):
    """A transformers causal LM from a model folder, for the Hugging Face peer methods."""
    from transformers import AutoModelForCausalLM  # slow import: only when a peer is swept

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype(dtype))
    return model.to(on).eval()


def build_method(models: SweepModels, name: str, k: int) -> Method:
    """Grid point (name, draft length k) as decoders, its baseline being plain decoding of
    the same target by the same library. Medusa at k drafts at most k deep (a static tree's
    nodes of depth <= k; top-k products over k heads); Medusa-2 heads draft for, and are
    compared with plain decoding of, their LoRA-adapted target ("plain_adapted")."""
    if name in ("small_model", "ngram", "medusa"):
        drafter, nodes = _our_drafter(models, name, k)
        target, baseline = models.target, "plain"
        if name == "medusa" and models.medusa_target is not None:
            target, baseline = models.medusa_target, "plain_adapted"
        return Method(name, k, OurDecoder(target, drafter), OurDecoder(target), baseline, nodes)
    if name not in _HF_METHODS:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")
    _require(models.hf_target, name)
    assistant = _require(models.hf_draft, name) if name == "hf_assisted" else None
    decoder = HFDecoder(models.hf_target, assistant, num_draft_tokens=k,
                        prompt_lookup=name == "hf_prompt_lookup")
    return Method(name, k, decoder, HFDecoder(models.hf_target), "hf_plain", k)


def _our_drafter(models: SweepModels, name: str, k: int) -> tuple[Drafter, int]:
    if name == "ngram":
        return NgramDrafter(num_draft_tokens=k), k
    if name == "small_model":
        return SmallModelDrafter(_require(models.draft, name), num_draft_tokens=k), k
    heads = _require(models.medusa_heads, name)
    drafter = medusa_drafter(_require(models.tree, name), heads, max_depth=k)
    return drafter, drafter.max_nodes


def _require(value, method: str):
    if value is None:
        raise ValueError(f"build_method: {method} needs weights that were not loaded; pass "
                         f"{method} to load_sweep_models")
    return value


def _as_list(value) -> list:
    """A config value that may be one item (a multirun job's value) or a list of them."""
    if isinstance(value, ListConfig | list | tuple):
        return list(value)
    return [] if value is None else [value]
