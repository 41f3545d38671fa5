"""Prompt configs (from_config/prompts.py): every data config composes, question files resolve,
a chat target is asked chat questions by default."""

import pytest
from helpers import group_options, tiny_llama

from selfspec.decode import generate
from selfspec.from_config.prompts import (
    data_path,
    encode_prompt_texts,
    load_prompts,
    prompt_set,
    prompts,
)
from selfspec.model import Transformer


@pytest.mark.parametrize("name", group_options("data"))
def test_every_data_config_composes(cfg_of, name):
    data = cfg_of("generate", f"data={name}").data
    assert data.name == name and data.num_prompts >= 1 and data.max_prompt_tokens >= 1


def test_question_files_ship_with_the_package_and_data_path_overrides(cfg_of, tmp_path):
    shipped = data_path(cfg_of("generate", "data=mt_bench").data)
    assert shipped.parent.parts[-3:] == ("selfspec", "assets", "prompts")
    assert shipped.name == "mt_bench_question.jsonl" and shipped.is_file()
    assert data_path(cfg_of("generate", "data=spec_bench").data).is_file()
    assert len(prompts(cfg_of("generate", "data=mt_bench",
                              "data.num_prompts=80").data)) == 80
    data = cfg_of("generate", "data=spec_bench", f"data.path={tmp_path}/mine.jsonl").data
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/mine.jsonl; set data.path="):
        load_prompts(data, tokenizer=None)
    (tmp_path / "mine.jsonl").write_text('{"question_id": 7, "turns": ["hi"]}\n')
    assert data_path(data) == tmp_path / "mine.jsonl"
    (loaded,) = load_prompts(data, tokenizer=lambda text: {"input_ids": [len(text)]})
    assert loaded.prompt.id == "7" and loaded.ids == [2]
    with pytest.raises(ValueError, match="names no question file"):
        data_path(cfg_of("generate", "data=mt_bench", "data.asset=null").data)


def test_a_chat_target_is_asked_mt_bench_questions_unless_data_says_otherwise(cfg_of):
    chat = prompt_set(cfg_of("generate", "model=smollm2-135m", "data.num_prompts=3"))
    assert (chat.name, chat.chat, chat.num_prompts) == ("mt_bench", True, 3)
    assert prompts(chat)[0].id == "81"  # MT-bench's first question
    code = prompt_set(cfg_of("generate", "model=tiny"))
    assert (code.name, code.chat, code.num_prompts) == ("humaneval", False, 2)
    chosen = prompt_set(cfg_of("generate", "model=smollm2-135m", "data=humaneval"))
    assert chosen.name == "humaneval"
    with pytest.raises(ValueError, match="only eval/generate.py takes it"):
        prompts(cfg_of("train_medusa", "data=auto", "run_dir=/tmp/unused").data)


def test_long_answer_workloads_narrow_their_source_and_say_how_to_answer(cfg_of):
    math = prompts(cfg_of("sweep", "data=long_math").data)
    assert len(math) == 80 and {p.category for p in math} == {"math_reasoning"}
    assert all(p.text.endswith("state the final answer at the end.") for p in math)
    code = prompts(cfg_of("sweep", "data=long_code", "data.num_prompts=3").data)
    assert [p.id for p in code] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all("write ten test cases" in p.text for p in code)
    with pytest.raises(ValueError, match="no prompt of 'long_math' is in them"):
        prompts(cfg_of("sweep", "data=long_math", "data.categories=[poetry]").data)


def test_rollouts_sample_each_prompt_in_a_group_of_its_own_copies(cfg_of):
    data = cfg_of("sweep", "data=rollouts", "data.num_prompts=2").data
    groups = prompts(data)
    math = prompts(cfg_of("sweep", "data=rollouts", "data.num_prompts=2", "data.samples=1").data)
    assert len(math) == 2 and len(groups) == 2 * data.samples == 16
    assert [p.id for p in groups[:9]] == [f"{math[0].id}#{j}" for j in range(1, 9)] + [
        f"{math[1].id}#1"]
    assert {p.text for p in groups[:8]} == {math[0].text} and groups[8].text == math[1].text
    assert all(p.category == "math_reasoning" for p in groups)
    with pytest.raises(ValueError, match="data.samples must be >= 1, got 0"):
        prompts(cfg_of("sweep", "data=rollouts", "data.samples=0").data)


def test_a_multi_turn_workload_measures_the_turn_after_the_targets_own_answer(cfg_of, tmp_path):
    shipped = prompts(cfg_of("sweep", "data=multi_turn").data)
    assert len(shipped) == 80 and all(len(p.follow_ups) == 1 for p in shipped)
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["hi there", "again"]}\n'
                                      '{"question_id": 2, "turns": ["one turn only"]}\n'
                                      '{"question_id": 3, "turns": ["tell me", "shorter"]}\n')
    data = cfg_of("sweep", "data=multi_turn", f"data.path={tmp_path}/q.jsonl",
                  "data.answer_tokens=6").data
    texts = prompts(data)
    assert [p.id for p in texts] == ["1", "3"]  # those with a second turn
    target = Transformer.from_hf(tiny_llama(0))
    tokenizer = CharTokenizer()
    encoded = encode_prompt_texts(data, texts, tokenizer, target)
    for prompt, got in zip(texts, encoded, strict=True):
        first = tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
        answer = generate(target, first, max_new_tokens=6).tokens  # its plain greedy answer
        said = tokenizer.decode(answer)
        assert got.ids == tokenizer.encode_chat([
            {"role": "user", "content": prompt.text}, {"role": "assistant", "content": said},
            {"role": "user", "content": prompt.follow_ups[0]}])
    with pytest.raises(ValueError, match="cannot generate them"):
        encode_prompt_texts(data, texts, tokenizer)
    with pytest.raises(ValueError, match="data.turns must be an integer >= 1"):
        prompts(cfg_of("sweep", "data=multi_turn", "data.turns=0").data)


class CharTokenizer:
    """Characters as ids 4-63 (the tiny target's vocabulary), a chat template of role marks."""

    bos_token_id, eos_token_id, chat_template = 1, None, "marks"

    def __call__(self, text: str) -> dict:
        return {"input_ids": [4 + ord(c) % 60 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - 4 + 32) for i in ids if i >= 4)

    def encode_chat(self, messages) -> list[int]:
        return self.apply_chat_template(messages, True, True, False)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        ids = [1]
        for message in messages:
            ids += [2 if message["role"] == "user" else 3,
                    *self(message["content"])["input_ids"]]
        return ids + [3]
