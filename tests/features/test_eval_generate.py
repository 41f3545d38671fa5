"""eval/generate.py as a program: a 70B dry run prints its plan; no weights fail cleanly."""

import subprocess
import sys

from selfspec import from_config
from selfspec.from_config import REPO_ROOT


def test_dry_run_prints_the_plan_of_a_70b_model(tmp_path):
    script = REPO_ROOT / "eval/generate.py"
    run = subprocess.run(
        [sys.executable, str(script), "model=llama2-70b", "dry_run=true", "num_gpus=8",
         f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "68,976,648,192" in run.stdout and "68.98 B" in run.stdout
    assert "8 GPUs" in run.stdout


def test_generate_without_weights_fails_cleanly(tmp_path):
    script = from_config.REPO_ROOT / "eval/generate.py"
    run = subprocess.run(
        [sys.executable, str(script), "model=llama2-7b", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert "meta-llama/Llama-2-7b-hf" in run.stderr and "model.path=" in run.stderr
    assert "Traceback" not in run.stderr
