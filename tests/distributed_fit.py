"""Run by tests/training/test_loop.py under torchrun: a few Medusa training steps with `fit`.

    torchrun --nproc_per_node 2 tests/distributed_fit.py RUN_DIR MICRO_BATCH ZERO [VERSION]

ZERO is zero2, zero3 or none; VERSION the Medusa version (default 1; 2: LoRA adapters on the
target train too, and every checkpoint exports them). Every rank builds the same tiny target
and heads from fixed seeds and trains on the same random token rows; each rank writes the full
trained weights it holds (heads, and adapters for Medusa-2) to RUN_DIR/rank{RANK}.safetensors,
with its torch thread count. The processes share SELFSPEC_TEST_THREADS threads (default 1), so
that one process runs with as many threads as two processes together.
"""

import contextlib
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from helpers import suite_threads, tiny_llama  # noqa: E402

from selfspec.from_config.methods.medusa import Medusa2Objective, MedusaObjective  # noqa: E402
from selfspec.heads.medusa import MedusaConfig, MedusaHeads  # noqa: E402
from selfspec.model import Transformer  # noqa: E402
from selfspec.model.lora import LoraSettings, add_lora, save_adapter  # noqa: E402
from selfspec.tracking import Tracker  # noqa: E402
from selfspec.training.loop import TrainSettings, fit, make_accelerator  # noqa: E402
from selfspec.training.rows import TokenRows  # noqa: E402

ZERO = {
    "none": None,
    "zero2": {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True},
    "zero3": {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
              "zero_allow_untested_optimizer": True},
}


def settings(run_dir: str, micro_batch: int) -> TrainSettings:
    # Checkpoints at steps 3 and 4: the export of step 3 is a stale export that a test
    # shows the comparison with one process rejects.
    return TrainSettings(run_dir=run_dir, max_steps=4, micro_batch_size=micro_batch,
                         lr=3e-3, log_every=1, save_every=3, seed=0)


def objective(version: int) -> torch.nn.Module:
    """The Medusa objective on the tiny target; the same weights on every call."""
    target = Transformer.from_hf(tiny_llama(0))
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2))
    if version == 2:
        return Medusa2Objective(add_lora(target, LoraSettings(rank=4)), heads)
    return MedusaObjective(target, heads)


def threads_per_process() -> int:
    return max(1, suite_threads() // int(os.environ.get("WORLD_SIZE", "1")))


def main(run_dir: str, micro_batch: int, zero: str, version: int = 1) -> None:
    torch.set_num_threads(threads_per_process())
    run_settings = settings(run_dir, micro_batch)
    accelerator = make_accelerator(run_settings, ZERO[zero])
    model = objective(version)
    tokens = torch.randint(64, (32, 24), generator=torch.Generator().manual_seed(2))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    tracker = Tracker(run_dir, use_wandb=False) if accelerator.is_main_process else None

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        if version == 2:
            adapter = {k.removeprefix("target."): v for k, v in state.items()
                       if k.startswith("target.")}
            save_adapter(model.target, folder / "adapter", adapter)

    fit(model, rows, None, run_settings, accelerator=accelerator, tracker=tracker, export=export)
    save_trained(model, Path(run_dir, f"rank{accelerator.process_index}.safetensors"))


def save_trained(model: torch.nn.Module, path: Path) -> None:
    """The full trained weights this rank sees (ZeRO-3 partitions are gathered first)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    gathered = contextlib.nullcontext()
    if hasattr(named[0][1], "ds_id"):  # partitioned by ZeRO-3
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in named])
    with gathered:
        save_file({name: p.detach().clone().contiguous() for name, p in named}, str(path),
                  metadata={"torch_threads": str(torch.get_num_threads())})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1)
