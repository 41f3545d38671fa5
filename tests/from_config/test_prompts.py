"""Prompt configs (from_config/prompts.py): every data config composes, question files resolve,
a chat target is asked chat questions by default."""

import pytest
from helpers import group_options

from selfspec.from_config.prompts import data_path, load_prompts, prompt_set, prompts


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
