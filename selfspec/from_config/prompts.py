"""Evaluation prompts from `conf/data/`: HumanEval, held-out stdlib, MT-bench, Spec-Bench."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.from_config.common import CONF_DIR, REPO_ROOT
from selfspec.measure.prompts import (
    EncodedPrompt,
    Prompt,
    by_category_in_turns,
    encode_prompts,
    humaneval_prompts,
    mt_bench_prompts,
    spec_bench_prompts,
    stdlib_heldout_prompts,
)
from selfspec.model import Transformer


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


def prompt_set(cfg: DictConfig) -> DictConfig:
    """cfg.data with data=auto resolved by the target: MT-bench first turns for a chat model
    (model.chat: true), else HumanEval; the data.* values given beside auto apply to the set
    chosen."""
    if cfg.data.name != "auto":
        return cfg.data
    name = "mt_bench" if cfg.model.get("chat", False) else "humaneval"
    chosen = OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml")
    return OmegaConf.merge(chosen, {k: v for k, v in cfg.data.items() if k != "name"})


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
    elif name in ("spec_bench", "spec_bench_text"):  # the same questions, chat or plain text
        found = spec_bench_prompts(data_path(cfg_data))
    elif name == "auto":
        raise ValueError("data=auto chooses by the target and only eval/generate.py takes it: "
                         "choose data=mt_bench or data=humaneval")
    else:
        raise ValueError(
            f"unknown prompt set {name!r}: choose humaneval, stdlib_heldout, mt_bench, spec_bench "
            f"or spec_bench_text"
        )
    if cfg_data.get("per_category") is not None:
        found = by_category_in_turns(found, int(cfg_data.per_category))
    return found[:n]


def load_prompts(cfg_data: DictConfig, tokenizer) -> list[EncodedPrompt]:
    """The data config's prompts as token ids of `tokenizer` (a `transformers` tokenizer)."""
    return encode_prompts(
        prompts(cfg_data), tokenizer, int(cfg_data.max_prompt_tokens), bool(cfg_data.chat)
    )


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
