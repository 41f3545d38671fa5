"""eval/replay.py on the toy target: it prints the tau that decoding measures."""

import json

import pytest
from helpers import load_entry, toy

from selfspec import generate
from selfspec.drafters import NgramDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import load_target, load_tokenizer
from selfspec.from_config.prompts import encode_prompt_texts, stop_ids
from selfspec.from_config.sweeps import plan_sweep
from selfspec.metrics import TauEstimate


def test_eval_replay_prints_the_tau_that_decoding_measures(tmp_path, quick_build):
    from hydra import compose, initialize_config_dir

    overrides = [*toy(quick_build)[:3], "methods=[ngram]", "num_draft_tokens=[2]",
                 "num_prompts=2", "max_new_tokens=40", f"run_dir={tmp_path}",
                 f"record={tmp_path / 'greedy.json'}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("replay", overrides=overrides)
    entry = load_entry("replay")
    (row,) = entry.run(cfg)
    target = load_target(cfg)
    tokenizer = load_tokenizer(target.source)
    texts = plan_sweep(cfg, 2, greedy_only=True).prompts
    prompts = encode_prompt_texts(cfg.data, texts, tokenizer)
    stops = stop_ids(cfg, target, tokenizer)
    live = [generate(target, p.ids, drafter=NgramDrafter(2), max_new_tokens=40,
                     eos_token_id=list(stops)).stats for p in prompts]
    steps = sum(s.steps for s in live)
    assert row["tau"] == pytest.approx((sum(s.accepted for s in live) + steps) / steps)
    assert row["tau_standard_error"] == pytest.approx(TauEstimate.of(live).standard_error)
    # The toy target's code repeats itself: lookup keeps many drafts (1.83 measured)
    assert row["tau"] > 1.5
    assert json.loads((tmp_path / "replay.json").read_text())["rows"] == [row]
    recording = (tmp_path / "greedy.json").read_text()
    assert entry.run(cfg) == [row] and (tmp_path / "greedy.json").read_text() == recording
