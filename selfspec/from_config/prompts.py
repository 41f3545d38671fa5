"""Evaluation prompts from `conf/data/`: HumanEval, held-out stdlib, MT-bench, Spec-Bench, code
edits, and the workloads built on them (long answers, conversations of several turns)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.decode import generate
from selfspec.from_config.common import CONF_DIR, REPO_ROOT
from selfspec.measure.prompts import (
    EncodedPrompt,
    Prompt,
    by_category_in_turns,
    code_edit_prompts,
    encode_conversation,
    encode_prompts,
    humaneval_prompts,
    in_groups,
    mt_bench_prompts,
    spec_bench_prompts,
    stdlib_heldout_prompts,
    with_instruction,
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
    """The first cfg_data.num_prompts prompts of the data config's prompt set: its `source`
    (default: its name), narrowed to `categories`, with `instruction` after each text, and
    only those with the follow-ups its `turns` need; with `samples` = G, each G times in a row
    (data.num_prompts counts the distinct prompts)."""
    n = int(cfg_data.num_prompts)
    if n < 1:
        raise ValueError(f"data.num_prompts must be >= 1, got {n}")
    found = _source_prompts(cfg_data, n)
    if cfg_data.get("categories"):
        wanted = [str(c) for c in cfg_data.categories]
        found = [p for p in found if p.category in wanted]
        if not found:
            raise ValueError(f"data.categories={wanted}: no prompt of {cfg_data.name!r} is in "
                             f"them; check the names against the file's `category` fields")
    if cfg_data.get("instruction"):
        found = with_instruction(found, str(cfg_data.instruction))
    turns = _turns(cfg_data)
    if turns > 1:
        found = [p for p in found if len(p.follow_ups) >= turns - 1]
    if cfg_data.get("per_category") is not None:
        found = by_category_in_turns(found, int(cfg_data.per_category))
    samples = cfg_data.get("samples")
    return in_groups(found[:n], 1 if samples is None else int(samples))


def _source_prompts(cfg_data: DictConfig, n: int) -> list[Prompt]:
    name = str(cfg_data.get("source") or cfg_data.name)
    if name == "humaneval":
        found = humaneval_prompts()
    elif name == "stdlib_heldout":
        found = stdlib_heldout_prompts(n, int(cfg_data.num_lines))
    elif name == "code_edit":
        found = code_edit_prompts(n, int(cfg_data.num_lines))
    elif name == "mt_bench":
        found = mt_bench_prompts(data_path(cfg_data))
    elif name in ("spec_bench", "spec_bench_text"):  # the same questions, chat or plain text
        found = spec_bench_prompts(data_path(cfg_data))
    elif name == "auto":
        raise ValueError("data=auto chooses by the target and only eval/generate.py takes it: "
                         "choose data=mt_bench or data=humaneval")
    else:
        raise ValueError(
            f"unknown prompt set {name!r}: choose humaneval, stdlib_heldout, code_edit, "
            f"mt_bench, spec_bench or spec_bench_text"
        )
    return found


def _turns(cfg_data: DictConfig) -> int:
    """data.turns: which user turn of each conversation is measured (1: the first)."""
    turns = cfg_data.get("turns", 1)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"data.turns must be an integer >= 1, got {turns!r}")
    return turns


def load_prompts(cfg_data: DictConfig, tokenizer) -> list[EncodedPrompt]:
    """The data config's prompts as token ids of `tokenizer` (a `transformers` tokenizer)."""
    return encode_prompt_texts(cfg_data, prompts(cfg_data), tokenizer)


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
    cfg_data: DictConfig, texts: list[Prompt], tokenizer, target: Transformer | None = None
) -> list[EncodedPrompt]:
    """The prompts as token ids. With data.turns = t > 1, each is its conversation up to its
    t-th user turn, the answers before it the target's own (plain greedy decoding, at most
    data.answer_tokens each, to its end of turn): the turn measured, which edits or repeats
    them, follows what this target said."""
    max_tokens, turns = int(cfg_data.max_prompt_tokens), _turns(cfg_data)
    if turns == 1:
        return encode_prompts(texts, tokenizer, max_tokens, bool(cfg_data.chat))
    if target is None:
        raise ValueError(f"data {cfg_data.name!r} measures turn {turns} of each conversation, "
                         f"after the target's own answers: this command cannot generate them; "
                         f"use eval/sweep.py, eval/lossless.py or eval/replay.py")
    stops = _end_of_turn(target, tokenizer)
    encoded = []
    for prompt in texts:
        answers: list[str] = []
        for _ in range(turns - 1):
            ids = encode_conversation(prompt, answers, tokenizer, max_tokens)
            new = generate(target, ids, max_new_tokens=int(cfg_data.answer_tokens),
                           eos_token_id=stops).tokens
            answers.append(tokenizer.decode([t for t in new if t not in stops],
                                            skip_special_tokens=True))
        encoded.append(EncodedPrompt(prompt, encode_conversation(prompt, answers, tokenizer,
                                                                 max_tokens)))
    return encoded


def _end_of_turn(target: Transformer, tokenizer) -> tuple[int, ...]:
    if target.config.eos_token_ids:
        return tuple(target.config.eos_token_ids)
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def stop_ids(cfg: DictConfig, target: Transformer, tokenizer) -> tuple[int, ...]:
    """EOS ids ending a generation (cfg.stop_at_eos), else () for fixed-length generations."""
    return _end_of_turn(target, tokenizer) if cfg.get("stop_at_eos", True) else ()
