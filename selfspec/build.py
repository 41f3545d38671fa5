"""The only module that reads configs: turns the Hydra config tree (conf/) into library objects.

Entry points call these functions and stay short; everything below them takes plain values.
A model config names its weights three ways, tried in order: a local `path`, a shipped
package `asset` (selfspec/assets/<asset>), the Hugging Face cache for `hf_id` (never a
download). Its `arch` block holds the architecture facts, so plans need no weights.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.data import (
    load_sharegpt,
    packed_chat_dataset,
    packed_stdlib_dataset,
    rows_from_dataset,
    self_distill,
)
from selfspec.drafters import Drafter, NgramDrafter, SmallModelDrafter
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.model import ModelConfig, Transformer
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
    if cfg_model.get("hf_id"):
        folder = _hf_cache_snapshot(cfg_model.hf_id)
        if folder is not None:
            return folder
        cache = _hf_cache_dir()
        tried.append(f"the Hugging Face cache ({cache}): no snapshot of {cfg_model.hf_id}")
    raise ModelNotAvailable(_unavailable_message(cfg_model, key, tried))


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


def load_target(cfg: DictConfig) -> Transformer:
    """The target model of cfg.model, checked against its config's architecture facts."""
    target = _load_model(cfg.model, "model", cfg.model.dtype, cfg.get("device", "cpu"))
    if cfg.model.get("arch") is not None:
        check_architecture(model_config(cfg.model), target.config, cfg.model.name, target.source)
    return target


def _load_model(cfg_model: DictConfig, key: str, dtype: str, device: str) -> Transformer:
    folder = resolve_model_path(cfg_model, key)
    return Transformer.from_pretrained(folder, dtype=torch_dtype(dtype), device=device)


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


def build_drafter(cfg: DictConfig, target: Transformer) -> Drafter | None:
    """The drafter named by cfg.drafter (small_model | ngram | none); None = plain decoding."""
    kind, k = cfg.drafter, int(cfg.num_draft_tokens)
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DRAFTERS)}")
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(num_draft_tokens=k)
    draft_cfg = cfg.model.get("draft")
    if draft_cfg is None or not any(draft_cfg.get(f) for f in ("path", "asset", "hf_id")):
        raise ValueError(
            f"model {cfg.model.name!r} has no standard small draft model: set "
            f"model.draft.path=/local/folder (a model with the target's tokenizer) or use "
            f"drafter=ngram"
        )
    draft = _load_model(draft_cfg, "model.draft", cfg.model.dtype, cfg.get("device", "cpu"))
    return SmallModelDrafter(draft, num_draft_tokens=k)


# ---- sampling and prompts ------------------------------------------------------------------


def sampling_params(cfg_sampling: DictConfig) -> SamplingParams:
    return SamplingParams(
        temperature=float(cfg_sampling.temperature),
        top_k=int(cfg_sampling.top_k),
        top_p=float(cfg_sampling.top_p),
    )


def data_path(cfg_data: DictConfig) -> Path:
    """cfg_data.path as an existing file; a relative path is relative to the repository root
    (so runs work from any cwd)."""
    path = Path(cfg_data.path).expanduser()
    path = path if path.is_absolute() else (REPO_ROOT / path).resolve()
    if not path.is_file():
        raise FileNotFoundError(
            f"{cfg_data.name} question file not found: {path}; set data.path=/file.jsonl or "
            f"SELFSPEC_SHARED_DATA=/folder/holding/{path.name}"
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
    from transformers import AutoTokenizer  # slow import: only when weights are there

    return AutoTokenizer.from_pretrained(str(folder))


def training_rows(
    cfg: DictConfig, tokenizer, target: Transformer | None = None
) -> tuple[TokenRows, TokenRows]:
    """(train, held-out) packed rows of cfg.train_data at cfg.trainer.seq_len; with
    train_data.self_distill the target rewrites the assistant turns first."""
    source, seq_len = cfg.train_data.source, int(cfg.trainer.seq_len)
    if source == "stdlib":
        cache = cfg.train_data.get("cache_dir")
        train, heldout = (
            rows_from_dataset(packed_stdlib_dataset(tokenizer, split, seq_len, cache))
            for split in ("train", "heldout")
        )
    elif source == "sharegpt":
        if not cfg.train_data.get("path"):
            raise ValueError("train_data.source=sharegpt needs train_data.path=/file.json")
        conversations = load_sharegpt(cfg.train_data.path)
        if cfg.train_data.get("self_distill"):
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


def draft_tree(cfg: DictConfig) -> Tree:
    return Tree.from_paths(OmegaConf.to_container(cfg.tree.choices))


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
