"""`python train/dflash.py` end to end on a toy target: the head it exports drafts in a sweep
by name; and its dry run for a 70B target."""

import json
from functools import partial

import pytest
from helpers import run_trainer, sharegpt_file, toy
from hydra import compose, initialize_config_dir

from selfspec import generate
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import drafter_and_target
from selfspec.heads import DFlashConfig, DFlashHead, load_head
from selfspec.model import Transformer
from selfspec.tracking import read_metrics

run_entry = partial(run_trainer, "dflash")


@pytest.mark.slow
def test_train_dflash_runs_exports_a_head_a_sweep_loads_and_reports_tau(tmp_path, quick_build):
    done = run_entry(
        "model=local", f"model.path={quick_build / 'target'}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "dflash.block_size=5", "dflash.target_layers=[0,1,1]",
        "dflash.tree_nodes=6", "wandb.enabled=false", f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "blocks of 5, drafting a best-first tree of 6 nodes" in done.stdout
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lossless"] is True
    assert f"tau {summary['tau']:.2f}, speedup x{summary['speedup']:.2f}" in done.stdout  # its file
    assert any("eval/dflash/slot4_top1" in r for r in read_metrics(run_dir))
    export = run_dir / "checkpoints/step_0000004/export"
    target = Transformer.from_pretrained(quick_build / "target")
    head = load_head(export, DFlashHead, DFlashConfig, target=target)
    assert head.config.target_layers == (0, 1, 1) and head.config.block_size == 5
    # eval/sweep.py, eval/generate.py and the rest take it by name
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("generate", overrides=[*toy(quick_build)[:3], "drafter=dflash",
                                             f"dflash_head={export}", "num_draft_tokens=4"])
    drafter, _ = drafter_and_target(cfg, target)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert generate(target, prompt, drafter=drafter, max_new_tokens=12).tokens == \
        generate(target, prompt, max_new_tokens=12).tokens


@pytest.mark.slow
def test_train_dflash_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # fc (3 streams x 8192 -> 8192), one layer (q, o: h x h; k, v: h x 1024; MLP 3 x h x 28672;
    # two norms; q/k norms of 128), hidden_norm and the final norm
    h = 8192
    count = 3 * h * h + 2 * h * h + 2 * h * 1024 + 3 * h * 28672 + 2 * h + 2 * 128 + 2 * h
    assert f"trainable head (DFlashHead): {count:,} parameters" in done.stdout
