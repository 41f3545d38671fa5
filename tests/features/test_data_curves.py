"""`python train/data_curves.py` end to end on the toy target: one feature store, two nested
answer sets, two epochs, tau with its standard error after each, the figure and the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sharegpt_file

ENTRY = Path(__file__).resolve().parents[2] / "train" / "data_curves.py"


@pytest.mark.slow
def test_nested_answer_sets_train_from_one_store_and_draw_tau_against_data(tmp_path,
                                                                            quick_build):
    run_dir = tmp_path / "run"
    rows = ["train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
            "trainer.seq_len=32", "trainer.eval_rows=4"]
    train = ["trainer.micro_batch_size=4", "final_eval.num_prompts=0",
             "trainer.tau_new_tokens=12", "wandb.enabled=false"]
    command = [sys.executable, str(ENTRY), "model=local", f"model.path={quick_build / 'target'}",
               "answers=[20,50]", "epochs=2", "tau_prompts=3", "methods=[medusa]", "threads=1",
               "store.layers=[]",
               f"rows=[{','.join(repr(o) for o in rows)}]",
               f"train_overrides=[{','.join(repr(o) for o in train)}]",
               f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    curves = json.loads((run_dir / "curves.json").read_text())
    assert set(curves["medusa"]) == {"20", "50"}
    for points in curves["medusa"].values():
        epochs = [p["epochs"] for p in points]  # a pass ends at its last step's batch
        assert [round(e) for e in epochs] == [1, 2] and epochs[-1] >= 2
        assert all(p["tau_se"] is not None and p["tau_seconds"] > 0 for p in points)  # judged
    store = json.loads((run_dir / "store" / "index.json").read_text())
    small, large = (json.loads((run_dir / "medusa" / n / "run_config.json").read_text())
                    for n in ("N20", "N50"))
    assert small["trainer"]["features"] == large["trainer"]["features"] == str(run_dir / "store")
    assert store["rows"] > 0 and (run_dir / "data_curves.png").stat().st_size > 10_000
    assert "+-" in done.stdout
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "== medusa" not in again.stdout  # finished runs are kept
    drawn = subprocess.run([*command, "answers=[20,50,80]", "draw_only=true"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0 and "== " not in drawn.stdout  # nothing trained, no store
    assert json.loads((run_dir / "curves.json").read_text()) == curves  # N=80 never ran
    elsewhere = tmp_path / "elsewhere.json"  # an earlier run's points, its folders gone
    elsewhere.write_text(json.dumps({"medusa": {"20": [], "80": curves["medusa"]["50"]},
                                     "eagle2": {"7": curves["medusa"]["20"]}}))
    merged = subprocess.run([*command, "draw_only=true", f"earlier=[{elsewhere}]"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr[-3000:]
    drawn_all = json.loads((run_dir / "curves.json").read_text())
    assert drawn_all["medusa"] == {**curves["medusa"], "80": curves["medusa"]["50"]}
    assert drawn_all["eagle2"] == {"7": curves["medusa"]["20"]}  # this run's N=20 wins
    assert "eagle2" in merged.stdout and "      80" in merged.stdout
    other = subprocess.run([*command, "+method_overrides.medusa=['optim.lr=0.5']"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2  # a finished run of other settings is refused, not kept
    assert "finished with another config (optim.lr:" in other.stderr.strip().splitlines()[-1]
