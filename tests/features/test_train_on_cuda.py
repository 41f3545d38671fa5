"""Every trainer on CUDA in bf16 (a bf16 target, bf16 autocast): a few steps on the toy target,
the held-out loss falling, and an export that loads. Skipped without CUDA; these ran on the
GPU machines of docs/gpu.md."""

import json
from pathlib import Path

import pytest
import torch
from helpers import run_trainer, sharegpt_file, three_layer_target

from selfspec.from_config.methods.early_exit import load_early_exit
from selfspec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, load_head
from selfspec.model import Transformer
from selfspec.tracking import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 12


def medusa_heads(export: Path, target: Transformer):
    return load_head(export, MedusaHeads, MedusaConfig, target=target)


def eagle_head(export: Path, target: Transformer):
    return load_head(export, EagleHead, EagleConfig, target=target)


def exit_adapter(export: Path, target: Transformer):
    return load_early_exit(export / "E1", target, exit_layer=1)


def draft_model(export: Path, target: Transformer):
    return Transformer.from_pretrained(export)


CASES = {
    "medusa1": ("medusa", ["medusa.version=1"], medusa_heads),
    "medusa2": ("medusa", ["medusa.version=2"], medusa_heads),
    "eagle1": ("eagle", ["eagle.version=2"], eagle_head),
    "eagle3": ("eagle", ["eagle.version=3", "eagle.target_layers=[0,1,2]", "eagle.ttt_steps=2",
                         "eagle.draft_vocab_size=64"], eagle_head),
    "early_exit": ("early_exit", ["early_exit.exit_layers=[1]"], exit_adapter),
    "draft": ("draft", ["draft_model.num_layers=1"], draft_model),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_trainer_runs_on_cuda_in_bf16(tmp_path, quick_build, case):
    trainer, settings, load = CASES[case]
    model = three_layer_target(quick_build, tmp_path / "model")
    run_dir = tmp_path / "run"
    done = run_trainer(
        trainer, "model=local", f"model.path={model}", "model.dtype=bf16", "device=cuda",
        "train_data.source=sharegpt", f"train_data.path={sharegpt_file(tmp_path)}",
        f"trainer.max_steps={STEPS}", "trainer.micro_batch_size=8", "trainer.seq_len=32",
        f"trainer.save_every={STEPS}", "trainer.eval_every=4", "trainer.tau_prompts=2",
        "trainer.tau_new_tokens=16", "final_eval.num_prompts=2", "final_eval.max_new_tokens=12",
        "wandb.enabled=false", f"hydra.run.dir={run_dir}", *settings, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["eval/loss"] for r in read_metrics(run_dir) if "eval/loss" in r]
    assert len(losses) == STEPS // 4 and losses[-1] < losses[0], losses
    assert any("eval/tau" in r for r in read_metrics(run_dir))
    assert json.loads((run_dir / "summary.json").read_text())  # the report ran
    target = Transformer.from_pretrained(model, dtype=torch.bfloat16, device="cuda")
    assert load(run_dir / f"checkpoints/step_{STEPS:07d}/export", target) is not None
