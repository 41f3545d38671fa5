"""`python train/eagle.py` end to end on a toy target (EAGLE-2 and EAGLE-3), and its dry run
for a 70B target."""

import json
from functools import partial

import pytest
import torch
from helpers import HAS_WANDB, LEARNS, assert_the_loss_falls, run_trainer, sharegpt_file

from selfspec.heads import EagleConfig, EagleHead, load_head
from selfspec.heads.draft_vocab import load_draft_vocab
from selfspec.model import Transformer
from selfspec.tracking import read_metrics

run_entry = partial(run_trainer, "eagle")


def toy_run(quick_build, tmp_path, *extra: str) -> list[str]:
    return ["model=local", f"model.path={quick_build / 'target'}", "train_data.source=sharegpt",
            f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=8",
            "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
            "trainer.eval_every=4", "trainer.threads=1", "final_eval.num_prompts=2",
            "final_eval.max_new_tokens=12", *LEARNS,
            f"hydra.run.dir={tmp_path / 'run'}", *extra]


@pytest.mark.slow
def test_train_eagle2_runs_saves_the_head_and_reports_tau(tmp_path, quick_build):
    done = run_entry(*toy_run(quick_build, tmp_path, "eagle.version=2"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tau" in done.stdout and "speedup" in done.stdout and "draft time share" in done.stdout
    assert "EAGLE-2 dynamic tree" in done.stdout
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["lossless"] is True
    assert f"tau {summary['tau']:.2f}, speedup x{summary['speedup']:.2f}" in done.stdout  # its file
    assert 0.0 <= summary["draft_time_share"] < 1.0
    assert [r["step"] for r in read_metrics(run_dir) if "eval/loss" in r] == [4, 8]
    assert any("eval/eagle/top1" in r for r in read_metrics(run_dir))
    assert_the_loss_falls(run_dir, 0.08, 0.03)  # measured: -12% and -5.5%
    assert bool(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == HAS_WANDB
    target = Transformer.from_pretrained(quick_build / "target")
    head = load_head(run_dir / "checkpoints/step_0000008/export", EagleHead, EagleConfig,
                     target=target)
    assert head.config.version == 1 and "fc.bias" in head.state_dict()
    # the training tokens' counts, from which eagle.draft_vocab=K picks K when drafting
    vocab = load_draft_vocab(run_dir / "checkpoints/step_0000008/export", 16)
    assert len(vocab.t2d) == target.config.vocab_size and int(vocab.t2d.sum()) == 16


@pytest.mark.slow
def test_train_eagle3_exports_its_draft_vocabulary(tmp_path, quick_build):
    done = run_entry(*toy_run(quick_build, tmp_path, "eagle.version=3",
                              "eagle.draft_vocab_size=64", "eagle.target_layers=[0,1,1]",
                              "eagle.ttt_steps=3", "trainer.max_steps=4", "wandb.enabled=false"),
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EAGLE-3 head" in done.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["lossless"] is True
    assert any("eagle3/step2_loss" in key for r in read_metrics(tmp_path / "run") for key in r)
    target = Transformer.from_pretrained(quick_build / "target")
    head = load_head(tmp_path / "run/checkpoints/step_0000004/export", EagleHead, EagleConfig,
                     target=target)
    assert head.config.target_layers == (0, 1, 1) and head.config.draft_vocab_size == 64
    assert int(head.t2d.sum()) == 64
    assert torch.equal(head.draft_vocab.target_ids, head.t2d.nonzero().flatten())


@pytest.mark.slow
def test_train_eagle_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # fc (2h x h + h) + one layer (q, o: h x h; k, v: h x 1024; MLP 3 x h x 28672; one norm)
    assert "trainable head (EagleHead): 989,872,128 parameters" in done.stdout
    done = run_entry("model=llama2-70b", "dry_run=true", "eagle.version=3",
                     "eagle.draft_vocab_size=32000", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # fc 3h x h, q/k/v read 2h, three layer norms + the final norm, LM head 32000 x h
    assert "trainable head (EagleHead): 1,403,027,456 parameters" in done.stdout
