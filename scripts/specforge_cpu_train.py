"""SpecForge's own DFlash trainer on the CPU: run with the python of SpecForge's venv
(scripts/peers.sh specforge), by scripts/peer_train.py --peer specforge and the slow tests.

    python scripts/specforge_cpu_train.py SETTINGS.json

SETTINGS (JSON): `target` (the target's transformers folder), `features` (offline rows,
`selfspec.training.specforge_data`), `draft_config` (a DFlash draft's config.json: selfspec's
`--to dflash` layout, which SpecForge reads), `out`, and the training settings `steps`,
`batch`, `lr`, `warmup`, `anchors` (blocks a row), `gamma` (slot k weighs
exp(-(k - 1) / gamma); null: every slot alike), `seq_len`, `seed`, `max_grad_norm`.

`specforge train` runs in one process with what runs without an accelerator:
`training.fsdp_sharding: NO_SHARD`, `attention_backend: sdpa`, `model.torch_dtype:
float32`. Its last checkpoint is exported by its own `export_to_hf` to OUT/dflash; its logged
steps go to OUT/specforge_metrics.jsonl (one JSON object a step) and its output to
OUT/specforge.log.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

RUN_ID = "selfspec-rows"
STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$", re.MULTILINE)  # its per-step log line


def run_config(s: dict) -> dict:
    warmup_ratio = s["warmup"] / s["steps"] if s["steps"] else 0.0
    return {"model": {"target_model_path": s["target"], "draft_model_config": s["draft_config"],
                      "torch_dtype": "float32"},
            "data": {"hidden_states_path": s["features"], "max_length": s["seq_len"],
                     "dataloader_num_workers": 0},
            "training": {"strategy": "dflash", "max_steps": s["steps"], "batch_size": s["batch"],
                         "fsdp_sharding": "NO_SHARD", "attention_backend": "sdpa",
                         "learning_rate": s["lr"], "lr_scheduler": "cosine",
                         "warmup_ratio": warmup_ratio, "max_grad_norm": s["max_grad_norm"],
                         "num_anchors": s["anchors"], "loss_decay_gamma": s["gamma"],
                         "log_interval": 1, "save_interval": s["steps"], "seed": s["seed"]},
            "output_dir": str(Path(s["out"]) / "run"), "run_id": RUN_ID}


def train(s: dict) -> list[dict]:
    """Train, export, and return the logged steps."""
    from specforge.export.to_hf import export_to_hf

    out = Path(s["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run_config(s), indent=1))
    done = subprocess.run([str(Path(sys.executable).with_name("specforge")), "train",
                           "--config", str(out / "run.json")], capture_output=True, text=True)
    (out / "specforge.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"specforge train failed (exit {done.returncode}); its log: "
                           f"{out / 'specforge.log'}\n{done.stderr[-3000:]}")
    steps = [{"step": int(n), **ast.literal_eval(record)}
             for n, record in STEP_LINE.findall(done.stdout + done.stderr)]
    (out / "specforge_metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    export_to_hf(str(out / "run" / f"{RUN_ID}-step{s['steps']}"), s["draft_config"],
                 str(out / "dflash"))
    return steps


if __name__ == "__main__":
    train(json.loads(Path(sys.argv[1]).read_text()))
