"""`python train/early_exit.py` end to end on a toy 3-layer target (two exit layers in one run),
and its dry run for a 70B target."""

import json
from functools import partial

import pytest
from helpers import LEARNS, assert_the_loss_falls, run_trainer, sharegpt_file, three_layer_target

from selfspec.from_config.methods.early_exit import load_early_exit
from selfspec.model import Transformer
from selfspec.tracking import read_metrics

run_entry = partial(run_trainer, "early_exit")

@pytest.mark.slow
def test_train_early_exit_trains_two_exits_and_reports_each(tmp_path, quick_build):
    model = three_layer_target(quick_build, tmp_path / "model")
    done = run_entry(
        "model=local", f"model.path={model}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=12",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=6",
        "trainer.eval_every=6", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "early_exit.exit_layers=[1,2]", *LEARNS,
        f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("E=1 norm", "E=1 adapter", "E=2 norm", "E=2 adapter"):
        assert line in done.stdout
    assert "tau" in done.stdout and "speedup" in done.stdout and "draft time share" in done.stdout
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    for e in (1, 2):
        for kind in ("norm", "adapter"):
            tau, speedup = summary[f"E{e}/{kind}/tau"], summary[f"E{e}/{kind}/speedup"]
            assert summary[f"E{e}/{kind}/lossless"] is True
            assert f"E={e} {kind:<7}: tau {tau:.2f}, speedup x{speedup:.2f}" in done.stdout
    assert [r["step"] for r in read_metrics(run_dir) if "eval/loss" in r] == [6, 12]
    assert any("eval/exit/E2_kl" in r for r in read_metrics(run_dir))
    assert_the_loss_falls(run_dir, 0.01, 0.002)  # measured: -1.9% and -0.5%
    target = Transformer.from_pretrained(model)
    export = run_dir / "checkpoints/step_0000012/export"
    assert load_early_exit(export / "E2", target, exit_layer=2).config.kind == "adapter"


@pytest.mark.slow
def test_train_early_exit_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # per exit: two norms (2 x 8192), q and o (8192 x 8192), k and v (8192 x 1024); 3 exits
    assert "ExitHead adapters at E=[2, 4, 6]): 453,033,984 parameters" in done.stdout
