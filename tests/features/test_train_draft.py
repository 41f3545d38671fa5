"""`python train/draft.py` end to end on a toy 3-layer target, refusals, and a 70B dry run."""

import json
from functools import partial

import pytest
import torch
from helpers import (
    LEARNS,
    assert_the_loss_falls,
    run_script,
    run_trainer,
    sharegpt_file,
    three_layer_target,
)

from selfspec.heads.draft_vocab import load_draft_vocab
from selfspec.model import Transformer

run_entry = partial(run_trainer, "draft")


@pytest.mark.slow
def test_train_draft_exports_a_model_both_libraries_load_and_reports(tmp_path, quick_build):
    from transformers import AutoModelForCausalLM

    model = three_layer_target(quick_build, tmp_path / "model")
    done = run_entry(
        "model=local", f"model.path={model}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=12",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=6",
        "trainer.eval_every=6", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "draft_model.num_layers=1",
        "draft_model.draft_vocab=40", *LEARNS,
        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "draft vocabulary: 40" in done.stdout and "lossless=True" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lossless"] is True
    assert f"tau {summary['tau']:.2f}, speedup x{summary['speedup']:.2f}" in done.stdout  # its file
    assert_the_loss_falls(tmp_path / "run", 0.02, 0.005)  # measured: -4.4% and -1.0%
    export = tmp_path / "run/checkpoints/step_0000012/export"
    target = Transformer.from_pretrained(model)
    draft = Transformer.from_pretrained(export)
    assert draft.config.num_layers == 1
    # Frozen, so the target's own; the layer trained, so not the target's.
    torch.testing.assert_close(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert not torch.equal(draft.layers[0].mlp.up_proj.weight, target.layers[0].mlp.up_proj.weight)
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 1
    assert len(load_draft_vocab(export, 40).target_ids) == 40
    assert (export / "tokenizer.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("draft_model.num_layers=8", "a draft must be shallower than the target"),
    ("draft_model.num_layers=0", "draft_model.num_layers must be an integer >= 1"),
    ("draft_model.draft_vocab=5000", "draft_model.draft_vocab must be null or 1..vocab_size"),
])
def test_train_draft_refuses_impossible_settings_before_loading(tmp_path, monkeypatch, capsys,
                                                               override, message):
    code, _, err = run_script("train/draft.py", [override, f"hydra.run.dir={tmp_path}",
                                                 "wandb.enabled=false"], monkeypatch, capsys)
    assert code == 2 and message in err, err[-2000:]


@pytest.mark.slow
def test_train_draft_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    h, kv, ffn = 8192, 1024, 28672  # Llama-2-70B
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert f"first 2 layers and final norm): {2 * layer + h:,} parameters" in done.stdout


@pytest.mark.slow
def test_train_draft_trains_a_parallel_draft_a_sweep_drafts_with(tmp_path, quick_build):
    from helpers import toy
    from hydra import compose, initialize_config_dir

    from selfspec import generate
    from selfspec.from_config.common import CONF_DIR
    from selfspec.from_config.generation import drafter_and_target
    from selfspec.from_config.models import load_target

    model = three_layer_target(quick_build, tmp_path / "model")
    done = run_entry(
        "model=local", f"model.path={model}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "draft_model.num_layers=1", "draft_model.parallel=3",
        "draft_model.num_draft_tokens=3", "wandb.enabled=false",
        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PARD, up to 3 tokens a forward" in done.stdout and "lossless=True" in done.stdout
    export = tmp_path / "run/checkpoints/step_0000004/export"
    assert json.loads((export / "pard.json").read_text())["parallel"] == 3
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("generate", overrides=[
            *toy(quick_build)[:2], f"model.path={model}", f"model.draft.path={export}",
            "drafter=small_model", "small_model.parallel=[true]", "num_draft_tokens=3"])
    target = load_target(cfg)
    drafter, _ = drafter_and_target(cfg, target)
    assert drafter.mask_token_id is not None
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert generate(target, prompt, drafter=drafter, max_new_tokens=12).tokens == \
        generate(target, prompt, max_new_tokens=12).tokens
