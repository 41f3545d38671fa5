"""speculators' side of tests/peers/test_speculators_training.py, run with the python of its
venv: the logits of a head its own trainer saved, loaded and scored by speculators' own code
(speculators_side.py's loader, its one-pass EAGLE-3 forward and its DFlash training forward).

Its trainer saves every float in bf16 (its checkpointer's default, whatever
--hidden-states-dtype) and writes bf16 as the folder's dtype, so its `from_pretrained` builds
the head in bf16 and rounds the target weights it takes from the verifier (the embedding, a
full-vocabulary DFlash head's LM head) to bf16 too; and an EAGLE-3 folder holds a bf16 copy
of the frozen embedding. The heads trained with the target's own weights in fp32, and
selfspec drafts with them, so here the head is built in fp32 and an EAGLE-3 head's
embedding is taken back from the verifier (speculators' own `_load_verifier_weights`, told to
overwrite the copy) before scoring.

    python speculators_trained_side.py KIND INPUTS HEAD_FOLDER OUT   # OUT/logits.safetensors
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators_side import ATTN, dflash_logits, eagle3_logits, read_inputs


def load_fp32(folder: Path):
    """speculators' own loader, the head built in fp32 rather than the folder's bf16."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = ATTN
    return SpeculatorModel.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def main(kind: str, inputs: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    tensors, _ = read_inputs(inputs)
    model = load_fp32(Path(folder))
    if kind == "eagle3":
        model._load_verifier_weights(overwrite_embed_tokens=True)  # not the bf16 copy
        logits = eagle3_logits(model, tensors)
    else:
        logits = dflash_logits(model, tensors)
    save_file({kind: logits.contiguous()}, str(Path(out) / "logits.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
