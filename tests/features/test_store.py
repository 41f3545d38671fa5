"""`python train/store.py` end to end: two ranks under torchrun write the store one rank
writes, and a trainer reading it gives the losses of online training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import sharegpt_file, suite_threads, three_layer_target
from safetensors.torch import load_file

from selfspec.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def store_command(model: Path, chat: Path, out: Path) -> list[str]:
    return [str(ROOT / "train" / "store.py"), "model=local", f"model.path={model}",
            "train_data.source=sharegpt", f"train_data.path={chat}", "trainer.seq_len=32",
            "trainer.eval_rows=4", "store.layers=[1,2]", "store.dtype=fp32",
            "store.batch_size=3", "store.rows_per_shard=8", f"store.out={out}",
            f"hydra.run.dir={out}"]


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "offline", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_two_ranks_write_the_store_one_rank_writes_and_training_reads_it(tmp_path,
                                                                          quick_build):
    model, chat = three_layer_target(quick_build, tmp_path / "model"), sharegpt_file(tmp_path)
    threads = str(max(1, suite_threads() // 2))
    one = run([sys.executable, *store_command(model, chat, tmp_path / "one")], tmp_path,
              OMP_NUM_THREADS=threads)
    assert "trainer.features=" in one.stdout
    two = run(["torchrun", "--standalone", "--nproc_per_node", "2",
               *store_command(model, chat, tmp_path / "two")], tmp_path, OMP_NUM_THREADS=threads)
    index_one, index_two = (json.loads((tmp_path / name / "index.json").read_text())
                            for name in ("one", "two"))
    assert index_one == index_two and len(index_one["shards"]) >= 4
    written = {rank: line.split(": shards ")[1].split(", ") for rank in (0, 1)
               for line in two.stdout.splitlines() if line.startswith(f"rank {rank} of 2")}
    assert written[0][:2] == ["train-00000000", "train-00000016"]  # every other shard
    assert written[1][0] == "train-00000008" and not set(written[0]) & set(written[1])
    assert sorted(written[0] + written[1]) == sorted(
        s["file"].removesuffix(".safetensors") for s in index_one["shards"])
    for shard in index_one["shards"]:
        a, b = (load_file(tmp_path / name / shard["file"]) for name in ("one", "two"))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)

    def losses(*extra: str) -> list[float]:
        run_dir = tmp_path / f"run{len(extra)}"
        run([sys.executable, str(ROOT / "train" / "medusa.py"), "model=local",
             f"model.path={model}", "train_data.source=sharegpt", f"train_data.path={chat}",
             "trainer.seq_len=32", "trainer.eval_rows=4", "trainer.max_steps=3",
             "trainer.micro_batch_size=4", "trainer.log_every=1", "trainer.tau_prompts=0",
             "trainer.keep_best=last", "final_eval.num_prompts=0", f"trainer.threads={threads}",
             "wandb.enabled=false", f"hydra.run.dir={run_dir}", *extra], tmp_path)
        return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]

    online, stored = losses(), losses(f"trainer.features={tmp_path / 'two'}")
    assert len(online) == 3 and stored == pytest.approx(online, rel=1e-5)
