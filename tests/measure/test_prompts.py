"""Prompt loaders: HumanEval, held-out stdlib, MT-bench / Spec-Bench files, and encoding."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from selfspec.corpus import stdlib_files, stdlib_root
from selfspec.measure.prompts import (
    CODE_EDITS,
    Prompt,
    by_category_in_turns,
    code_edit_prompts,
    encode_conversation,
    encode_prompts,
    humaneval_prompts,
    mt_bench_prompts,
    question_file_prompts,
    spec_bench_prompts,
    stdlib_heldout_prompts,
    with_instruction,
)

SHIPPED = Path(str(resources.files("selfspec") / "assets" / "prompts"))  # package data


def test_humaneval_has_164_problems_with_their_ids():
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert len({p.id for p in prompts}) == 164
    assert all(p.category == "humaneval" and "def " in p.text for p in prompts)


def test_stdlib_heldout_prompts_are_deterministic_heldout_file_heads():
    prompts = stdlib_heldout_prompts(5, num_lines=3)
    assert prompts == stdlib_heldout_prompts(5, num_lines=3) and len(prompts) == 5
    heldout = {p.relative_to(stdlib_root()).as_posix() for p in stdlib_files("heldout")}
    assert all(p.id in heldout and p.category == "stdlib" for p in prompts)
    assert all(p.text.strip() and len(p.text.splitlines()) <= 3 for p in prompts)
    with pytest.raises(ValueError, match="num_lines >= 1"):
        stdlib_heldout_prompts(5, num_lines=0)


def test_mt_bench_first_turns_with_ids():
    prompts = mt_bench_prompts(SHIPPED / "mt_bench_question.jsonl")
    assert len(prompts) == 80 and prompts[0].id == "81" and prompts[0].category == "writing"
    assert prompts[0].text.startswith("Compose an engaging travel blog post")
    assert len({p.id for p in prompts}) == 80


def test_spec_bench_first_turns_with_ids():
    prompts = spec_bench_prompts(SHIPPED / "spec_bench_question.jsonl")
    assert len(prompts) == 480 and len({p.id for p in prompts}) == 480
    assert len({p.category for p in prompts}) > 1 and all(p.text for p in prompts)


def test_per_category_takes_every_category_in_turns():
    prompts = spec_bench_prompts(SHIPPED / "spec_bench_question.jsonl")
    categories = list(dict.fromkeys(p.category for p in prompts))  # 13, in file order
    balanced = by_category_in_turns(prompts, 2)
    assert len(balanced) == 2 * len(categories)
    assert [p.category for p in balanced] == categories * 2
    firsts = {p.category: p for p in reversed(prompts)}  # each category's first question
    assert balanced[: len(categories)] == [firsts[c] for c in categories]
    assert len({p.id for p in balanced}) == len(balanced)
    toy = [Prompt(str(i), "q", c) for i, c in enumerate("aab")]
    assert [p.id for p in by_category_in_turns(toy, 5)] == ["0", "2", "1"]  # b has only one
    with pytest.raises(ValueError, match="data.per_category must be >= 1"):
        by_category_in_turns(prompts, 0)


def test_missing_question_file_names_the_path(tmp_path):
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match="MT-bench file not found: .*absent.jsonl"):
        mt_bench_prompts(missing)


def test_empty_question_file_names_the_path(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="Spec-Bench file .*empty.jsonl holds no questions"):
        spec_bench_prompts(empty)


def test_bad_question_line_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        question_file_prompts(bad)
    bad.write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="line 1: `turns` must be a non-empty list"):
        question_file_prompts(bad)


class StubTokenizer:
    """One token per character (ids = code points), BOS 1, optionally a chat template."""

    bos_token_id = 1

    def __init__(self, chat_template: str | None = None):
        self.chat_template = chat_template

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        """[1], then per message its role's mark (user 2, assistant 4), its text, and 3."""
        assert add_generation_prompt and tokenize and not return_dict
        return [1, *(i for m in messages for i in (2 if m["role"] == "user" else 4,
                                                     *map(ord, m["content"]), 3))]


def test_encode_adds_bos_and_keeps_the_end_of_long_prompts():
    prompt = Prompt("x", "abcdef", "test")
    (short,) = encode_prompts([prompt], StubTokenizer(), max_tokens=100)
    assert short.prompt == prompt and short.ids == [1, *map(ord, "abcdef")]
    (cut,) = encode_prompts([prompt], StubTokenizer(), max_tokens=3)
    assert cut.ids == [1, ord("e"), ord("f")]


def test_encode_uses_the_chat_template_only_for_chat_data():
    prompt = Prompt("x", "hi", "test")
    tokenizer = StubTokenizer(chat_template="{{ messages }}")
    assert encode_prompts([prompt], tokenizer, 100, chat=True)[0].ids == [1, 2, 104, 105, 3]
    assert encode_prompts([prompt], tokenizer, 100, chat=False)[0].ids == [1, 104, 105]
    assert encode_prompts([prompt], StubTokenizer(), 100, chat=True)[0].ids == [1, 104, 105]


def test_question_files_keep_their_later_turns_as_follow_ups(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text('{"question_id": 1, "turns": ["hi", "again"]}\n'
                    '{"question_id": 2, "turns": ["once"]}\n')
    assert [p.follow_ups for p in question_file_prompts(path)] == [("again",), ()]
    path.write_text('{"question_id": 1, "turns": ["hi", 2]}\n')
    with pytest.raises(ValueError, match="line 1: every turn must be a string"):
        question_file_prompts(path)
    assert all(p.follow_ups for p in mt_bench_prompts(SHIPPED / "mt_bench_question.jsonl"))


def test_a_conversation_carries_each_answer_before_the_follow_up_it_prompts():
    prompt = Prompt("x", "hi", "test", follow_ups=("ok?", "and?"))
    tokenizer = StubTokenizer(chat_template="{{ messages }}")
    ids = encode_conversation(prompt, ["yo"], tokenizer, max_tokens=100)
    assert ids == [1, 2, *map(ord, "hi"), 3, 4, *map(ord, "yo"), 3, 2, *map(ord, "ok?"), 3]
    assert encode_conversation(prompt, [], tokenizer, 100) == [1, 2, 104, 105, 3]
    assert encode_conversation(prompt, ["yo"], tokenizer, max_tokens=4) == [1, *map(ord, "k?"), 3]
    with pytest.raises(ValueError, match="3 answers but only 2 follow-up turns"):
        encode_conversation(prompt, ["a", "b", "c"], tokenizer, 100)
    with pytest.raises(ValueError, match="needs a chat model"):
        encode_conversation(prompt, ["yo"], StubTokenizer(), 100)


def test_code_edits_ask_for_the_whole_file_back_with_one_edit_each_in_turns():
    edits = code_edit_prompts(5, 12)
    heads = stdlib_heldout_prompts(5, 12)
    assert [p.id for p in edits] == [p.id for p in heads]
    for i, (edit, head) in enumerate(zip(edits, heads, strict=True)):
        assert f"```python\n{head.text}```" in edit.text
        assert CODE_EDITS[i % len(CODE_EDITS)] in edit.text and edit.category == "code_edit"
    (told,) = with_instruction(edits[:1], "Be brief.")
    assert told.text == edits[0].text + "\n\nBe brief." and told.id == edits[0].id
