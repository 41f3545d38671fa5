"""Every trainer trains its head on a Qwen3, a Gemma 3 and a gpt-oss target (random, with the
toy tokenizer; Gemma 3's window shorter than the training rows; gpt-oss a mixture of experts
with sinks), its final evaluation lossless,
and the EAGLE-3 head it exports serves in vLLM's layout with its target's head_dim (the
reference code, which computes hidden / heads, is refused for it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import family_target, run_trainer, sharegpt_file, suite_threads
from safetensors.torch import load_file

from selfspec.model import Transformer

pytestmark = pytest.mark.slow  # a subprocess per trainer and family: ~15 s each

TRAINERS = {
    "medusa": ["medusa.draft_vocab_size=256"],
    "eagle": ["eagle.version=3", "eagle.draft_vocab_size=64", "eagle.target_layers=[1,2,3]",
              "eagle.ttt_steps=2"],
    "early_exit": ["early_exit.exit_layers=[2]"],
    "draft": ["draft_model.num_layers=1"],
}
EXPORT = Path(__file__).resolve().parents[2] / "scripts" / "export_heads.py"


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "gpt_oss"])
def family_folder(request, tmp_path_factory, quick_build) -> Path:
    return family_target(quick_build, tmp_path_factory.mktemp(request.param) / "target",
                         request.param)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_trains_on_every_family(family_folder, trainer, tmp_path):
    run_dir = tmp_path / "run"
    done = run_trainer(
        trainer, "model=local", f"model.path={family_folder}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=4",
        "trainer.eval_every=4", f"trainer.threads={suite_threads()}",
        "final_eval.num_prompts=2", "final_eval.max_new_tokens=12", "wandb.enabled=false",
        *TRAINERS[trainer], f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lossless=True" in done.stdout or \
        json.loads((run_dir / "summary.json").read_text())["lossless"] is True
    if trainer == "eagle":
        assert_exports(run_dir / "checkpoints" / "step_0000004" / "export", family_folder,
                       tmp_path)


def assert_exports(head: Path, target_folder: Path, tmp_path: Path) -> None:
    """The EAGLE-3 head to vLLM and to the reference code: the reference reads a config with
    target_hidden_size as "the embedding is in the head's weights", so it must be there, and
    be the target's."""
    target = Transformer.from_pretrained(target_folder)
    for engine in ("vllm", "eagle"):
        out = tmp_path / engine
        done = subprocess.run([sys.executable, str(EXPORT), str(head), "--to", engine, str(out),
                               "--target", str(target_folder)], capture_output=True, text=True)
        if engine == "eagle" and target.config.head_dim * target.config.num_heads != \
                target.config.hidden_size:
            assert done.returncode == 2 and "head_dim" in done.stderr, done.stderr
            continue
        assert done.returncode == 0, done.stderr[-3000:]
        config = json.loads((out / "config.json").read_text())
        weights = load_file(str(out / "model.safetensors"))
        assert config["head_dim"] == target.config.head_dim
        if engine == "eagle":  # with target_hidden_size the reference reads the head's own
            assert weights["embed_tokens.weight"].equal(target.embed_tokens.weight.detach())
