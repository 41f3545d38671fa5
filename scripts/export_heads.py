"""Write trained (or published) heads in the folder layout a serving engine loads.

    python scripts/export_heads.py runs/medusa/checkpoints/step_0000200/export --to vllm out/
    python scripts/export_heads.py HEAD_FOLDER --to vllm|sglang|medusa|eagle OUT
    python scripts/export_heads.py HEAD_FOLDER --to speculators --target MODEL_FOLDER OUT
    python scripts/export_heads.py HEAD_FOLDER --to selfspec --dtype float16 OUT   # half the size
    python scripts/export_heads.py HEAD_FOLDER --to selfspec --dtype bfloat16 --draft-vocab 4096 OUT

HEAD_FOLDER: a selfspec head export or a published Medusa / EAGLE folder. The launch command
is printed and saved as OUT/SERVING.md. A Medusa-2 export's adapter is merged into its target,
written to OUT/target with transformers' save_pretrained (the model the engine must serve).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from selfspec.cli import exit_on_user_error
from selfspec.heads import MedusaHeads
from selfspec.heads.draft_vocab import COUNTS_FILE, load_token_counts
from selfspec.heads.export import ENGINES, export_head, export_merged_target
from selfspec.heads.io import read_head, recorded_target, save_head
from selfspec.heads.layouts import TargetNeeded
from selfspec.model import ModelConfig, Transformer, checkpoint
from selfspec.model.lora import ADAPTER_DIR

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SELFSPEC = "selfspec"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("head_folder", type=Path)
    parser.add_argument("--to", required=True, choices=(*ENGINES, SELFSPEC),
                        help=f"an engine's layout, or {SELFSPEC}'s own (e.g. in another dtype)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--target", type=Path, default=None,
                        help="the target's model folder (default: the one the head records); "
                             "needed for heads sharing its LM head and for Medusa-2 adapters")
    parser.add_argument("--base-model", default=None,
                        help="the target's name in the launch command (default: --target)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="of the written weights (default: as stored)")
    parser.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                        help="with --to selfspec: Medusa heads that score only the K tokens of "
                             "their vocabulary most frequent in their training data")
    args = parser.parse_args(argv)
    target_folder = args.target or recorded_target(args.head_folder)
    target = ModelConfig.from_folder(target_folder) if target_folder else None
    head, info = _read(args.head_folder, target)
    if args.to == SELFSPEC:
        return _rewrite(head, info, args)
    if args.draft_vocab is not None:
        raise ValueError("--draft-vocab narrows heads written --to selfspec; an engine's "
                         "layout keeps the head's own vocabulary")
    recorded = info.get("target", {})
    base = args.base_model or (str(target_folder) if target_folder else info["base_model"])
    adapter = args.head_folder / ADAPTER_DIR
    if adapter.is_dir():
        if target_folder is None:
            raise FileNotFoundError(f"{args.head_folder} is a Medusa-2 export: its adapter must "
                                    f"be merged into its target: pass --target MODEL_FOLDER")
        base = str(export_merged_target(target_folder, adapter, args.out / "target"))
        print(f"the target with the Medusa-2 adapter merged: {base}")
    exported = export_head(
        head, args.to, args.out, base_model=base,
        target_layers_count=target.num_layers if target else recorded.get("num_layers"),
        target_lm_head=_target_lm_head(head, target_folder, args.to),
        target_embedding=_target_embedding(head, args.to, target_folder),
        dtype=DTYPES[args.dtype] if args.dtype else None)
    print(f"wrote {exported.folder} for {args.to}; launch with:\n  {exported.command}")
    for note in exported.notes:
        print(f"  - {note}")


def _rewrite(head, info: dict, args: argparse.Namespace) -> None:
    """The head in selfspec's layout, where it loads as before: cast (a cast shrinks shipped
    heads), narrowed to its K most frequent tokens, with its training data's token counts."""
    counts = args.head_folder / COUNTS_FILE
    if args.draft_vocab is not None:
        if not isinstance(head, MedusaHeads):
            raise ValueError(f"--draft-vocab narrows Medusa heads, not {type(head).__name__}; "
                             f"an EAGLE-1/2 head takes eagle.draft_vocab=K when it is loaded")
        head = head.narrowed(load_token_counts(args.head_folder), args.draft_vocab)
    module = head.to(DTYPES[args.dtype]) if args.dtype else head
    folder = save_head(args.out, module, head.config, info.get("target", {}))
    if counts.is_file():
        shutil.copyfile(counts, folder / COUNTS_FILE)
    print(f"wrote {folder}")


def _read(folder: Path, target: ModelConfig | None):
    """read_head, its refusal for want of a target worded for this command line."""
    try:
        return read_head(folder, target)
    except TargetNeeded as needed:
        raise TargetNeeded(folder, needed.what, "pass --target MODEL_FOLDER") from None


def _target_embedding(head, to: str, target_folder: Path | None) -> torch.Tensor | None:
    """The target's embedding, read only for an EAGLE-3 head going to the reference code, or
    an EAGLE-3 or DFlash head going to speculators (both read it from the head's weights)."""
    config = getattr(head, "config", None)
    fused = getattr(config, "version", 3) == 3 and hasattr(config, "target_layers")
    if to not in ("eagle", "speculators") or not fused or target_folder is None:
        return None
    if to == "eagle" and getattr(config, "version", None) != 3:
        return None
    return checkpoint.read_tensor(Path(target_folder), "model.embed_tokens.weight")


def _target_lm_head(head, target_folder: Path | None, to: str = "") -> torch.Tensor | None:
    """The target's LM head, read only for heads that share it (Medusa's shared LM head; a
    full-vocabulary DFlash head going to speculators, which reads it from the folder)."""
    config = getattr(head, "config", None)
    dflash = to == "speculators" and hasattr(config, "block_size") and \
        getattr(config, "draft_vocab_size", 0) is None
    if not getattr(config, "shared_lm_head", False) and not dflash:
        return None
    if target_folder is None:
        raise FileNotFoundError("these heads share the target's LM head, which the export "
                                "writes: pass --target MODEL_FOLDER")
    return Transformer.from_pretrained(target_folder).lm_head.weight.detach()


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
