"""eval/generate.py as a program: a 70B dry run prints its plan; no weights fail cleanly; every
speedup it prints carries the answers' repetition."""

import re

from helpers import load_entry, run_script

from selfspec import generate
from selfspec.from_config.models import load_target, load_tokenizer, resolve_model_path
from selfspec.from_config.prompts import encode_prompt_texts, prompt_set, prompts
from selfspec.measure.passes import repeated_ngram_share


def test_dry_run_prints_the_plan_of_a_70b_model(cfg_of, capsys):
    cfg = cfg_of("generate", "model=llama2-70b", "dry_run=true", "num_gpus=8")
    load_entry("generate").main.__wrapped__(cfg)
    out = capsys.readouterr().out
    assert "68,976,648,192" in out and "68.98 B" in out and "8 GPUs" in out


def test_generate_without_weights_fails_cleanly(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_script("eval/generate.py", ["model=llama2-7b", f"hydra.run.dir={tmp_path}"],
                              monkeypatch, capsys)
    assert code == 2
    assert "meta-llama/Llama-2-7b-hf" in err and "model.path=" in err
    assert "Traceback" not in err


def test_every_printed_speedup_carries_the_repetition_of_the_answers(cfg_of, capsys):
    cfg = cfg_of("generate", "drafter=ngram", "max_new_tokens=24", "data.num_prompts=2")
    load_entry("generate").main.__wrapped__(cfg)
    out = capsys.readouterr().out
    assert out.startswith("2 humaneval prompts, 24 new tokens each")
    shares = [float(s) for s in re.findall(r"over plain decoding\), repeated 4-grams ([\d.]+)",
                                           out)]
    assert len(shares) == 3  # each prompt, then all of them
    target = load_target(cfg)
    data = prompt_set(cfg)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model))
    encoded = encode_prompt_texts(data, prompts(data), tokenizer)
    answers = [generate(target, e.ids, max_new_tokens=24, eos_token_id=0).tokens
               for e in encoded]
    expected = [repeated_ngram_share([a]) for a in answers] + [repeated_ngram_share(answers)]
    assert shares == [round(share, 2) for share in expected]
    assert max(expected) > 0  # greedy code from the tiny target repeats itself
