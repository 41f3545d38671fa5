"""`python train/eagle.py trainer.objective=tv` end to end on a toy target: an EAGLE-3 head
fitted by total variation (every logged loss is its total variation to the target's law),
exported, and lossless in its report."""

import json

import pytest
from helpers import LEARNS, run_trainer, sharegpt_file

from selfspec.tracking import read_metrics


@pytest.mark.slow
def test_an_eagle3_head_trains_by_total_variation_end_to_end(tmp_path, quick_build):
    run_dir = tmp_path / "run"
    done = run_trainer(
        "eagle", "model=local", f"model.path={quick_build / 'target'}",
        "train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
        "eagle.version=3", "eagle.draft_vocab_size=64", "eagle.target_layers=[0,1,1]",
        "eagle.ttt_steps=2", "trainer.objective=tv", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "wandb.enabled=false", *LEARNS,
        f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["lossless"] is True
    # every logged step loss (training and held out) is the logged total variation, the
    # rejection rate (under kl they part)
    pairs = [(v, r[k.replace("_loss", "_tv")]) for r in read_metrics(run_dir)
             for k, v in r.items() if "eagle3/step" in k and k.endswith("_loss")]
    assert len(pairs) >= 8 and any(tv > 0.01 for _, tv in pairs)
    for loss, tv in pairs:
        assert loss == pytest.approx(tv, abs=1e-6)
    assert (run_dir / "checkpoints/step_0000004/export/head_config.json").is_file()
