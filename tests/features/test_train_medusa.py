"""`python train/medusa.py` end to end on a toy target, and its dry run for a 70B target."""

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import (
    HAS_WANDB,
    LEARNS,
    assert_the_loss_falls,
    run_trainer,
    sharegpt_file,
    suite_threads,
)

from selfspec.heads import MedusaConfig, MedusaHeads, load_head
from selfspec.heads.draft_vocab import COUNTS_FILE, load_token_counts, most_frequent
from selfspec.model import Transformer
from selfspec.model.lora import merge_adapter
from selfspec.tracking import read_metrics

run_entry = partial(run_trainer, "medusa")
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

@pytest.mark.slow
def test_train_medusa_runs_saves_heads_and_reports_tau(tmp_path, quick_build):
    run_dir = tmp_path / "run"
    done = run_entry(
        "model=local", f"model.path={quick_build / 'target'}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=8",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", f"trainer.threads={suite_threads()}", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "medusa.draft_vocab_size=256",
        "medusa.cache_features=true", *LEARNS,
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tau" in done.stdout and "speedup" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lossless"] is True
    assert f"tau {summary['tau']:.2f}, speedup x{summary['speedup']:.2f}" in done.stdout  # its file
    assert [r["step"] for r in read_metrics(run_dir) if "eval/loss" in r] == [4, 8]
    assert_the_loss_falls(run_dir, 0.1, 0.03)  # measured: -15% and -6.7%
    assert bool(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == HAS_WANDB
    target = Transformer.from_pretrained(quick_build / "target")
    heads = load_head(run_dir / "checkpoints/step_0000008/export", MedusaHeads, MedusaConfig,
                      target=target)
    assert heads.config.num_heads == 4 and heads.config.draft_vocab_size == 256
    assert heads.heads[0].lm_head.weight.shape == (256, target.config.hidden_size)
    assert heads.draft_vocab.t2d.sum() == 256 and heads.d2t.abs().sum() > 0  # not the default
    # the training tokens' counts beside them chose their vocabulary, and narrow it to ship
    counts = load_token_counts(run_dir / "checkpoints/step_0000008/export")
    assert torch.equal(heads.draft_vocab.t2d, most_frequent(counts, 256).t2d)
    # and scripts/token_counts.py rebuilds them from the run's recorded config alone
    for export in run_dir.glob("checkpoints/*/export"):
        (export / COUNTS_FILE).unlink()
    rebuilt = subprocess.run([sys.executable, str(SCRIPTS / "token_counts.py"), str(run_dir)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    for export in run_dir.glob("checkpoints/*/export"):
        assert torch.equal(load_token_counts(export), counts)


@pytest.mark.slow
def test_train_medusa_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "68,976,648,192" in done.stdout
    assert "trainable head (MedusaHeads): 1,317,044,224 parameters" in done.stdout


@pytest.mark.slow
def test_train_medusa2_exports_heads_and_adapter_and_reports_its_drift(tmp_path, quick_build):
    run_dir = tmp_path / "run"
    done = run_entry(
        "model=local", f"model.path={quick_build / 'target'}", "medusa.version=2",
        "medusa.lora.rank=4", "tree=top_k_products", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", f"trainer.threads={suite_threads()}", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "wandb.enabled=false", *LEARNS,
        f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Medusa-2: verified against the LoRA-adapted target" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lossless"] is True
    assert f"tau {summary['tau']:.2f}, speedup x{summary['speedup']:.2f}" in done.stdout  # its file
    assert 0.0 <= summary["greedy_agreement_with_original"] <= 1.0
    assert summary["eval_kl_to_original"] > 0.0  # the trained adapter moved the target
    export = run_dir / "checkpoints/step_0000004/export"
    target = Transformer.from_pretrained(quick_build / "target")
    load_head(export, MedusaHeads, MedusaConfig, target=target)
    merged = merge_adapter(target, export / "adapter")  # peft's format, merged into our model
    assert isinstance(merged, Transformer)
    assert any("lm_kl" in key for row in read_metrics(run_dir) for key in row)
    assert_the_loss_falls(run_dir, 0.015)  # measured: -3.2%


@pytest.mark.slow
def test_train_medusa2_dry_run_plans_the_adapters(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", "medusa.version=2",
                     f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 8 on q, k, v, o, gate, up, down: 8 * (2 * 16384 + 2 * 9216 + 3 * 36864) per layer
    assert "LoRA adapters on the target (rank 8): 103,546,880 parameters" in done.stdout


@pytest.mark.slow  # tests/features/test_entry_points.py checks the same refusals in-process
def test_a_bad_medusa_version_or_tree_is_refused_with_its_fix(tmp_path, quick_build):
    done = run_entry("medusa.version=3", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 2 and "medusa.version must be 1" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_entry("model=local", f"model.path={quick_build / 'target'}", "medusa.num_heads=2",
                     "tree=medusa_63", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 2 and "only 2 Medusa heads" in done.stderr
