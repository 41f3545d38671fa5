"""`python train/learning_curves.py` end to end: two methods on the toy target for the same
short budget, their curves, figure and table; run again, the finished runs are kept."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_script, sharegpt_file, three_layer_target

ENTRY = Path(__file__).resolve().parents[2] / "train" / "learning_curves.py"


@pytest.mark.slow
def test_two_methods_train_for_the_same_budget_and_draw_their_curves(tmp_path, quick_build):
    model = three_layer_target(quick_build, tmp_path / "model")
    run_dir = tmp_path / "run"
    extra = ["train_data.source=sharegpt",
             f"train_data.path={sharegpt_file(tmp_path)}", "trainer.micro_batch_size=4",
             "trainer.seq_len=32", "trainer.threads=1", "final_eval.num_prompts=2",
             "final_eval.max_new_tokens=12", "trainer.tau_new_tokens=16", "wandb.enabled=false"]
    command = [sys.executable, str(ENTRY), "model=local", f"model.path={model}", "minutes=0.05",
               "eval_every=3", "tau_prompts=2", f"hydra.run.dir={run_dir}",
               f"train_overrides=[{','.join(repr(o) for o in extra)}]"]
    done = subprocess.run([*command, "methods=[medusa,draft]"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    curves = json.loads((run_dir / "curves.json").read_text())
    assert set(curves) == {"medusa", "draft"}
    for name, result in curves.items():
        minutes = [p["minutes"] for p in result["curve"]]
        assert len(minutes) >= 2 and minutes == sorted(minutes), name
        assert minutes[-1] >= 0.05 > minutes[-2]  # the budget ended the run, evaluated
        assert f"{result['speedup']:>6.2f}x" in done.stdout  # the printed table is the file's
    assert (run_dir / "learning_curves.png").stat().st_size > 10_000
    assert "medusa" in done.stdout and "rising" in done.stdout

    # run again in the same folder: the finished run is kept, not trained again
    finished = (run_dir / "medusa" / "summary.json").stat().st_mtime_ns
    again = subprocess.run([*command, "methods=[medusa]"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "medusa: kept" in again.stdout
    assert (run_dir / "medusa" / "summary.json").stat().st_mtime_ns == finished
    assert json.loads((run_dir / "curves.json").read_text())["medusa"] == curves["medusa"]
    # with another setting the finished run is not silently kept
    other = subprocess.run([*command, "methods=[medusa]", "+method_overrides.medusa="
                            "['optim.lr=0.5']"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert other.returncode == 2
    assert "finished with another config (optim.lr:" in other.stderr.strip().splitlines()[-1]


def test_a_bad_method_list_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_script("train/learning_curves.py", ["methods=[medusa,eagle4]"],
                              monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: methods: give a list of "
                                                           "medusa, eagle1")
