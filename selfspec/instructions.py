"""Chat training prompts made offline from the standard library's docstrings, and their
answers written by the target itself.

Instruction-tuned targets need chat rows to train drafters on, and no chat data can be
downloaded here. The training side of the stdlib split (`selfspec.data`) documents thousands
of functions and classes in plain English; each documented name becomes one user turn (explain
it, show an example, summarise its documentation, ...). None of them comes from an evaluation
file (MT-bench, Spec-Bench, HumanEval or the held-out stdlib files), which a test checks.

The answers are the target's own (self-distillation: drafters learn what they will be asked to
predict), generated in left-padded batches by transformers' `generate` on the same weights,
appended to a JSON-lines cache batch by batch so that an interrupted run resumes where it
stopped.
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfspec.data import read_source, stdlib_files, stdlib_root

TEMPLATES = (
    "What does `{name}` in Python's `{module}` module do? Its documentation starts: "
    "\"{summary}\"",
    "Explain with a short example how to use `{module}.{name}` in Python.",
    "Summarize this Python documentation in two or three sentences:\n\n{doc}",
    "Write a small Python program that uses `{module}.{name}`, then explain how it works.",
    "Rewrite this documentation of `{module}.{name}` as a friendly paragraph for a beginner:"
    "\n\n{doc}",
    "When would a Python programmer reach for `{module}.{name}`, and what should they watch "
    "out for?",
)
MAX_DOC_CHARS = 600


@dataclass(frozen=True)
class Documented:
    """One public function or class of the stdlib with its docstring."""

    module: str
    name: str
    doc: str


def stdlib_instructions(count: int) -> list[str]:
    """`count` user prompts (or all there are, if fewer), deterministic: the documented names
    of the training stdlib files in a fixed shuffled order, each asked in one of TEMPLATES in
    turn. A larger count extends a smaller one's list, so cached answers stay useful."""
    import random

    if count < 1:
        raise ValueError(f"stdlib_instructions: count must be >= 1, got {count}")
    found = list(documented_names())
    random.Random(0).shuffle(found)
    return [_instruction(item, i) for i, item in enumerate(found[:count])]


def documented_names() -> Iterator[Documented]:
    """Public top-level functions and classes with a docstring of at least 8 words, from the
    training side of the stdlib split."""
    root = stdlib_root()
    for path in stdlib_files("train"):
        module = _module_name(path.relative_to(root).as_posix())
        if any(part.startswith("_") for part in module.split(".")):
            continue
        try:
            tree = ast.parse(read_source(path))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                if len(doc.split()) >= 8:
                    yield Documented(module, node.name, doc.strip()[:MAX_DOC_CHARS])


def _module_name(relative: str) -> str:
    name = relative.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _instruction(item: Documented, index: int) -> str:
    summary = item.doc.split("\n\n")[0].replace("\n", " ")
    template = TEMPLATES[index % len(TEMPLATES)]
    return template.format(module=item.module, name=item.name, summary=summary, doc=item.doc)


def self_distilled_conversations(
    prompts: list[str], load_model: Callable[[], Any], tokenizer, *, max_new_tokens: int,
    batch_size: int, cache_file: str | Path | None,
) -> list[list[dict]]:
    """[user, assistant] conversations whose assistant turn is the model's greedy answer to
    the user turn through its chat template. Batches already in cache_file are read back; new
    ones are appended as they finish (an interrupted run loses at most one batch).
    load_model: returns the `transformers` model that answers, called only if some prompt has
    no cached answer yet."""
    from tqdm.auto import tqdm

    done = _read_cache(cache_file)
    todo = [p for p in prompts if p not in done]
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    hf_model = load_model() if batches else None
    for batch in tqdm(batches, desc="self-distill (chat)", initial=len(done) // batch_size):
        answers = greedy_chat_answers(batch, hf_model, tokenizer, max_new_tokens)
        done.update(zip(batch, answers, strict=True))
        _append_cache(cache_file, zip(batch, answers, strict=True))
    return [[{"role": "user", "content": p}, {"role": "assistant", "content": done[p]}]
            for p in prompts]


def greedy_chat_answers(prompts: list[str], hf_model, tokenizer, max_new_tokens: int) -> list[str]:
    """The model's greedy replies to a batch of user turns, left-padded into one `generate`."""
    import torch

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    batch = batch.to(hf_model.device)
    with torch.inference_mode():
        out = hf_model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    replies = out[:, batch["input_ids"].shape[1] :]
    return [tokenizer.decode(r, skip_special_tokens=True).strip() for r in replies]


def cache_name(weights_key: str, max_new_tokens: int) -> str:
    """The cache file of the answers these weights write, whatever the prompts: every prompt
    answered once is reused by any later list that holds it."""
    text = json.dumps([weights_key, max_new_tokens, TEMPLATES])
    return f"chat-distill-{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"


def _read_cache(cache_file: str | Path | None) -> dict[str, str]:
    if cache_file is None or not Path(cache_file).is_file():
        return {}
    done = {}
    for line in Path(cache_file).read_text(encoding="utf-8").splitlines():
        try:  # a line cut short by an interruption is dropped and answered again
            record = json.loads(line)
            done[record["prompt"]] = record["answer"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _append_cache(cache_file: str | Path | None, pairs) -> None:
    if cache_file is None:
        return
    path = Path(cache_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    cut_short = path.is_file() and not path.read_bytes().endswith(b"\n")
    with open(path, "a", encoding="utf-8") as out:
        if cut_short:  # an interrupted write: start a fresh line after it
            out.write("\n")
        for prompt, answer in pairs:
            out.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
