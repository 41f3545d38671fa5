"""Chat training prompts made from stdlib docstrings and from general task templates:
disjoint from every evaluation prompt, deterministic, and answered once (the answer cache
resumes an interrupted run)."""

import gzip
import json
import re

import pytest
from omegaconf import OmegaConf

from selfspec.from_config import prompts
from selfspec.from_config.common import CONF_DIR
from selfspec.measure.prompts import humaneval_prompts, stdlib_heldout_prompts
from selfspec.training import instructions
from selfspec.training.instructions import (
    FIRST_WAVE,
    GENERAL_TEMPLATES,
    STYLES,
    general_instructions,
    self_distilled_conversations,
    stdlib_instructions,
    topics,
)

WINDOW = 8  # words: a shared passage this long would mean a prompt leaked across


def shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z]\w*", text.lower())  # words, not runs of digits
    return {tuple(words[i : i + WINDOW]) for i in range(len(words) - WINDOW + 1)}


def data_config(name: str):
    return OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml")


def evaluation_texts() -> list[str]:
    texts = [p.text for p in humaneval_prompts()] + [p.text for p in stdlib_heldout_prompts(40, 60)]
    for name in ("mt_bench", "spec_bench"):
        texts += [p.text for p in prompts.prompts(data_config(name))]
    return texts


@pytest.mark.slow  # 5-10 s: every training prompt's shingles against every evaluation set's
def test_training_prompts_share_no_passage_with_any_evaluation_prompt():
    training = stdlib_instructions(100_000)  # every documented name in every template
    assert len(training) > 6000
    training += general_instructions(100_000)  # every template with every topic and style
    evaluation = set().union(*map(shingles, evaluation_texts()))
    assert len(evaluation) > 50_000  # the evaluation files were really read
    leaked = [p for p in training if shingles(p) & evaluation]
    assert not leaked, leaked[:3]


def test_the_check_finds_a_leaked_prompt():
    question = prompts.prompts(data_config("mt_bench"))[7].text
    assert shingles(f"Explain this: {question}") & shingles(question)


def test_prompts_are_deterministic_and_a_longer_list_extends_a_shorter_one():
    short, long = stdlib_instructions(12), stdlib_instructions(40)
    assert short == long[:12] and len(set(long)) == 40
    assert len({p.split()[0] for p in long}) >= 4  # the templates take turns


def test_general_prompts_cross_every_template_with_every_topic_in_a_fixed_mixed_order():
    pairs = len(GENERAL_TEMPLATES) * len(topics())
    every = general_instructions(pairs)
    assert len(every) == len(set(every)) == pairs
    assert general_instructions(30) == every[:30] and general_instructions(0) == []
    first = every[:len(GENERAL_TEMPLATES)]  # both vary from the start of the list
    assert len({next(t for t in topics() if t in p) for p in first}) > len(first) // 2
    assert len({p.split()[0] for p in first}) > 4
    with pytest.raises(ValueError, match="count must be >= 0"):
        general_instructions(-1)


def test_each_style_asks_every_pair_again_after_the_plain_prompts():
    pairs = len(GENERAL_TEMPLATES) * len(topics())
    every = general_instructions(10**6)
    assert len(every) == len(set(every)) == pairs * (1 + len(STYLES))
    assert every[:pairs] == general_instructions(pairs)  # the plain prompts keep their place
    for wave, style in enumerate(STYLES, start=1):
        styled = every[wave * pairs : (wave + 1) * pairs]
        assert all(p.endswith(f" {style}") for p in styled)
        assert {p.removesuffix(f" {style}") for p in styled} == set(every[:pairs])
        assert styled[:5] != [f"{p} {style}" for p in every[:5]]  # an order of its own
    assert general_instructions(pairs + 7) == every[: pairs + 7]


def test_stdlib_prompts_ask_each_name_in_every_template_once_the_names_run_out():
    names = len(instructions.documented_names())
    every = stdlib_instructions(10**6)
    assert len(every) == len(set(every)) > 0.99 * names * len(instructions.TEMPLATES)
    assert every[:names] == stdlib_instructions(names)
    asked = {name: {p for p in every if f"`{name}`" in p or f".{name}`" in p}
             for name in ("urlopen", "dedent")}  # every template but the summary names it
    assert all(len(prompts) == len(instructions.TEMPLATES) - 1 for prompts in asked.values())


def test_the_first_waves_prompts_keep_their_place_at_the_head_of_the_list():
    templates, first_topics = FIRST_WAVE
    first_wave = {t.format(topic=topic) for t in GENERAL_TEMPLATES[:templates]
                  for topic in topics()[:first_topics]}
    every = general_instructions(len(GENERAL_TEMPLATES) * len(topics()))
    assert set(every[:len(first_wave)]) == first_wave
    assert len(every) > len(first_wave)  # the second wave follows


def test_answers_are_cached_and_an_interrupted_run_resumes(tmp_path, monkeypatch):
    asked = []

    def answer(prompts, hf_model, tokenizer, max_new_tokens):
        asked.append(list(prompts))
        return [f"answer to {p}" for p in prompts]

    loads = []

    def load():
        loads.append(1)
        return "model"

    monkeypatch.setattr(instructions, "greedy_chat_answers", answer)
    cache = tmp_path / "answers.jsonl"
    first = self_distilled_conversations(["a", "b", "c"], load, None, max_new_tokens=4,
                                         batch_size=2, cache_file=cache)
    assert asked == [["a", "b"], ["c"]]
    assert first[2] == [{"role": "user", "content": "c"},
                        {"role": "assistant", "content": "answer to c"}]
    with open(cache, "a") as out:
        out.write('{"prompt": "d", "answ')  # a line cut short by an interruption
    asked.clear()
    again = self_distilled_conversations(["a", "b", "c", "d", "e"], load, None,
                                         max_new_tokens=4, batch_size=2, cache_file=cache)
    assert asked == [["d", "e"]] and again[:3] == first
    assert len(loads) == 2
    self_distilled_conversations(["e", "a"], load, None, max_new_tokens=4, batch_size=2,
                                 cache_file=cache)
    assert len(loads) == 2  # every answer cached: the model is never loaded
    lines = cache.read_text().splitlines()
    assert [json.loads(line)["prompt"] for line in lines[-2:]] == ["d", "e"]


def test_shipped_answers_are_read_first_and_the_cache_adds_to_them(tmp_path, monkeypatch):
    def answer(prompts, hf_model, tokenizer, max_new_tokens):
        asked.append(list(prompts))
        return [f"new answer to {p}" for p in prompts]

    asked: list[list[str]] = []
    monkeypatch.setattr(instructions, "greedy_chat_answers", answer)
    shipped = tmp_path / "shipped.jsonl.gz"
    with gzip.open(shipped, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps({"prompt": p, "answer": f"shipped {p}"}) + "\n" for p in "ab")
    cache = tmp_path / "answers.jsonl"
    cache.write_text(json.dumps({"prompt": "b", "answer": "cached b"}) + "\n")
    answers = [c[1]["content"] for c in self_distilled_conversations(
        ["a", "b", "c"], lambda: "model", None, max_new_tokens=4, batch_size=2,
        cache_file=cache, shipped_file=shipped)]
    assert answers == ["shipped a", "cached b", "new answer to c"] and asked == [["c"]]
    assert [json.loads(line)["prompt"] for line in cache.read_text().splitlines()] == ["b", "c"]
    assert instructions.cached_answers(shipped) == ["shipped a", "shipped b"]  # gzipped


def test_only_answers_that_ship_are_found():
    assert instructions.shipped_answers("chat-distill-0000000000000000.jsonl") is None
    name = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml").answers
    assert instructions.shipped_answers(name).is_file()


def test_a_count_below_one_is_refused():
    with pytest.raises(ValueError, match="count must be >= 1"):
        stdlib_instructions(0)
