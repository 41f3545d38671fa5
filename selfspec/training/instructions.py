"""Chat training prompts made offline (from the standard library's docstrings, and from task
templates crossed with everyday topics), and their answers written by the target itself.

Instruction-tuned targets need chat rows to train drafters on, and no chat data can be
downloaded here. The training side of the stdlib split (`selfspec.corpus`) documents
thousands of functions and classes in plain English; each documented name becomes one user
turn (explain it, show an example, summarise its documentation, ...). Docstring questions are
all of one register, so general prompts (write, advise, role-play, explain a topic) join
them: the answers a drafter meets on MT-bench are of that kind. No prompt shares a passage with an
evaluation file (MT-bench, Spec-Bench, HumanEval or the held-out stdlib files), which a test
checks.

The answers are the target's own (self-distillation: drafters learn what they will be asked to
predict), generated in left-padded batches by transformers' `generate` on the same weights,
appended to a JSON-lines cache batch by batch so that an interrupted run resumes where it
stopped.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from selfspec.corpus import read_source, stdlib_files, stdlib_root

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


# General chat prompts: task templates in the spirit of MT-bench's categories (writing,
# roleplay, reasoning, math, coding, extraction, STEM, humanities), written for this project,
# crossed with everyday topics. A chat target answers them in the register it answers MT-bench
# in, which docstring questions alone do not cover.
GENERAL_TEMPLATES = (
    "Write a short blog post about {topic} for readers who know nothing about it.",
    "Give me five practical tips related to {topic}, with one sentence on each.",
    "Compose a friendly email to a colleague suggesting a team activity around {topic}.",
    "Pretend you are a tour guide who loves {topic}. Greet a group of visitors and tell them "
    "what they will see today.",
    "Explain {topic} to a ten-year-old in a few short paragraphs.",
    "What are the main advantages and disadvantages of {topic}? Answer in a short list.",
    "Write a four-line poem about {topic}.",
    "Describe the history of {topic} in about one hundred words.",
    "Imagine you are interviewing an expert on {topic}. Write three questions and their "
    "answers.",
    "Summarize the most common misconceptions about {topic} and correct each of them.",
    "Write a Python function that could help someone who works with {topic}, and explain it.",
    "A friend says {topic} is overrated. Write a polite reply that argues the other side.",
    "Create a one-day plan for a student who wants to learn about {topic}.",
    "Write the opening paragraph of a short story in which {topic} plays a central role.",
    "How has {topic} changed over the last fifty years, and what might come next?",
    "List the key terms a beginner should know about {topic}, with a short definition each.",
    # the second wave (see FIRST_WAVE)
    "Write a short persuasive paragraph that encourages people to try {topic}.",
    "Describe a typical day for someone whose job involves {topic}.",
    "What are three surprising facts about {topic}? Explain why each one matters.",
    "Write a short dialogue between two friends who disagree about {topic}.",
    "Give step-by-step instructions for a beginner's first weekend project involving {topic}.",
    "What questions do people most often ask about {topic}? Answer the three most common ones.",
    "Write a product description for an imaginary gadget that has to do with {topic}.",
    "Outline a five-minute presentation on {topic}: a title and three main points.",
)
# Asked of every (template, topic) pair again, one wave per style, after the plain prompts: the
# same tasks answered in another shape, so that the general prompts reach tens of thousands.
STYLES = (
    "Keep the answer short: three sentences at most.",
    "Answer as a numbered list.",
    "Write for a reader who already knows the subject well.",
)
TOPICS_FILE = "topics.txt"  # in selfspec/assets/prompts/: one topic a line, `#` comments


@functools.cache
def topics() -> tuple[str, ...]:
    """The chat topics of the general prompts, in their file's order (which fixes the prompts,
    and so the answers that ship)."""
    text = (resources.files("selfspec") / "assets" / "prompts" / TOPICS_FILE).read_text()
    return tuple(line for line in text.splitlines() if line and not line.startswith("#"))


# The lists grew in two waves: the first 16 templates x 101 topics, then the rest. The first
# wave's pairs keep their place at the head of general_instructions' list.
FIRST_WAVE = (16, 101)


@dataclass(frozen=True)
class Documented:
    """One public function or class of the stdlib with its docstring."""

    module: str
    name: str
    doc: str


def stdlib_instructions(count: int) -> list[str]:
    """`count` distinct user prompts (or all there are, if fewer: up to len(TEMPLATES) per
    documented name), deterministic: the documented names of the training stdlib files in a
    fixed shuffled order, each asked in one of TEMPLATES in turn; past the last name the list
    starts again with each name in the next template. A prompt met before (two names with
    one docstring) is skipped. A larger count extends a smaller one's list, so cached
    answers stay useful."""
    import random

    if count < 1:
        raise ValueError(f"stdlib_instructions: count must be >= 1, got {count}")
    found = list(documented_names())
    random.Random(0).shuffle(found)
    n = len(found)
    every = (_instruction(found[i % n], i % n + i // n) for i in range(n * len(TEMPLATES)))
    return list(dict.fromkeys(every))[:count]



def general_instructions(count: int) -> list[str]:
    """`count` general chat prompts (at most len(GENERAL_TEMPLATES) x len(topics()) x
    (1 + len(STYLES))), deterministic: every (template, topic) pair in a fixed shuffled order,
    so that templates and topics both vary along the list, then every pair again with each of
    STYLES appended, a wave per style in its own order; a longer list extends a shorter one.
    The first wave's pairs (FIRST_WAVE) come first, in the order they had before the second
    wave was added, so answers cached for them stay the first ones used."""
    import random

    if count < 0:
        raise ValueError(f"general_instructions: count must be >= 0, got {count}")
    first_templates, first_topics = FIRST_WAVE
    first = [(t, topic) for t in GENERAL_TEMPLATES[:first_templates]
             for topic in topics()[:first_topics]]
    random.Random(0).shuffle(first)
    taken = set(first)
    second = [(t, topic) for t in GENERAL_TEMPLATES for topic in topics()
              if (t, topic) not in taken]
    random.Random(1).shuffle(second)
    plain = [template.format(topic=topic) for template, topic in first + second]
    prompts = plain[:count]
    for wave, style in enumerate(STYLES, start=2):
        if len(prompts) >= count:
            break
        styled = [f"{prompt} {style}" for prompt in plain]
        random.Random(wave).shuffle(styled)
        prompts += styled[: count - len(prompts)]
    return prompts


@functools.cache
def documented_names() -> tuple[Documented, ...]:
    """Public top-level functions and classes with a docstring of at least 8 words, from the
    training side of the stdlib split; parsed once a process (seconds of the stdlib's
    source)."""
    return tuple(_documented())


def _documented() -> Iterator[Documented]:
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
    batch_size: int, cache_file: str | Path | None, shipped_file: Path | None = None,
) -> list[list[dict]]:
    """[user, assistant] conversations whose assistant turn is the model's greedy answer to
    the user turn through its chat template. Answers in shipped_file (written once by the same
    weights and shipped with selfspec: `shipped_answers`) and batches already in cache_file are
    read back; new ones are appended to cache_file as they finish (an interrupted run loses at
    most one batch). load_model: returns the `transformers` model that answers, called only if
    some prompt has no answer yet."""
    from tqdm.auto import tqdm

    done = {**read_answers(shipped_file), **read_answers(cache_file)}
    todo = [p for p in prompts if p not in done]
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    hf_model = load_model() if batches else None
    cached = len(prompts) - len(todo)
    for batch in tqdm(batches, desc=f"self-distill (chat, {cached} answers cached)"):
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


def shipped_answers(name: str) -> Path | None:
    """The answers file that selfspec ships for the cache `name` (`cache_name`: the same
    weights, answer length and templates), gzipped in selfspec/assets/answers/; None when
    none ships. The real target's answers ship, so that its trainers and n-gram lookup need
    no hour of generation first."""
    path = Path(str(resources.files("selfspec") / "assets" / "answers" / f"{name}.gz"))
    return path if path.is_file() else None


def cached_answers(cache_file: str | Path) -> list[str]:
    """The answers of a self-distillation cache file (JSON lines {"prompt", "answer"}; gzipped
    when its name ends in .gz), in the order written: the text the target wrote, e.g. for
    n-gram lookup's corpus."""
    path = Path(cache_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no answers file at {path}: give a JSON-lines file of "
                                f'{{"prompt": ..., "answer": ...}} records, e.g. the cache '
                                f"chat-distill-*.jsonl a trainer wrote under train_data.cache_dir")
    answers = [a for a in read_answers(path).values() if a]
    if not answers:
        raise ValueError(f"{path} holds no answers: each line must be a JSON object with an "
                         f'"answer" (and a "prompt")')
    return answers


def read_answers(cache_file: str | Path | None) -> dict[str, str]:
    """{prompt: answer} of an answers file (JSON lines; gzipped when its name ends in .gz);
    empty when there is none."""
    if cache_file is None or not Path(cache_file).is_file():
        return {}
    done = {}
    for line in _read_text(Path(cache_file)).splitlines():
        try:  # a line cut short by an interruption is dropped and answered again
            record = json.loads(line)
            done[record["prompt"]] = record["answer"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _read_text(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


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
