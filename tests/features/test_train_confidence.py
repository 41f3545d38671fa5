"""`python train/dflash.py dflash.confidence_head=true dflash.confidence_threshold=0.5` and
P-EAGLE's `train/eagle.py ... eagle.confidence_head=true` end to end on a toy target: the
confidence is trained beside the block (its held-out loss below a chance of 1/2), exported
with the head, and the report's drafts cut by it stay lossless."""

import json
import math

import pytest
from helpers import LEARNS, run_trainer, sharegpt_file

from selfspec.tracking import read_metrics


@pytest.mark.slow
def test_a_dflash_head_trains_its_confidence_and_drafts_cut_chains_end_to_end(tmp_path,
                                                                             quick_build):
    run_dir = tmp_path / "run"
    done = run_trainer(
        "dflash", "model=local", f"model.path={quick_build / 'target'}",
        "train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
        "dflash.block_size=5", "dflash.target_layers=[0,1]", "dflash.confidence_head=true",
        "dflash.confidence_threshold=0.5", "trainer.max_steps=20", "trainer.micro_batch_size=4",
        "trainer.seq_len=32", "trainer.save_every=20", "trainer.eval_every=20",
        "trainer.threads=1", "final_eval.num_prompts=2", "final_eval.max_new_tokens=12",
        "wandb.enabled=false", *LEARNS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["lossless"] is True
    records = read_metrics(run_dir)
    assert sum("dflash/confidence_loss" in r for r in records) >= 20
    heldout = [r["eval/dflash/confidence_loss"] for r in records
               if "eval/dflash/confidence_loss" in r]
    assert heldout and heldout[-1] < 0.9 * math.log(2), heldout  # below a chance of 1/2
    config = json.loads((run_dir / "checkpoints/step_0000020/export/head_config.json")
                        .read_text())["config"]
    assert config["confidence_head"] is True


@pytest.mark.slow
def test_a_p_eagle_head_trains_its_confidence_and_drafts_cut_chains_end_to_end(tmp_path,
                                                                              quick_build):
    run_dir = tmp_path / "run"
    done = run_trainer(
        "eagle", "model=local", f"model.path={quick_build / 'target'}",
        "train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
        "eagle.version=3", "eagle.draft_vocab_size=64", "eagle.target_layers=[0,1,1]",
        "eagle.parallel=3", "eagle.parallel_keep=1.0", "eagle.confidence_head=true",
        "eagle.confidence_threshold=0.5", "trainer.max_steps=20", "trainer.micro_batch_size=4",
        "trainer.seq_len=32", "trainer.save_every=20", "trainer.eval_every=20",
        "trainer.threads=1", "final_eval.num_prompts=2", "final_eval.max_new_tokens=12",
        "wandb.enabled=false", *LEARNS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["lossless"] is True
    records = read_metrics(run_dir)
    heldout = [r["eval/peagle/confidence_loss"] for r in records
               if "eval/peagle/confidence_loss" in r]
    assert heldout and heldout[-1] < 0.9 * math.log(2), heldout  # below a chance of 1/2
    config = json.loads((run_dir / "checkpoints/step_0000020/export/head_config.json")
                        .read_text())["config"]
    assert config["confidence_head"] is True and config["parallel"] == 3
