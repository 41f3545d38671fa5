"""speculators' side of tests/peers/test_speculators_training.py, run with the python of its
venv: the logits of a head its own trainer saved, loaded and scored by speculators'
own code (speculators_side.py's loader and one-pass EAGLE-3 forward).

Its trainer saves every float in bf16 (its checkpointer's default, whatever
--hidden-states-dtype), the frozen copy of the target's embedding included. The head trained
with the target's own embedding, and selfspec drafts with it, so the embedding is taken back
from the verifier here (speculators' own `_load_verifier_weights`, told to overwrite the
copy) before scoring.

    python speculators_trained_side.py INPUTS HEAD_FOLDER OUT   # OUT/logits.safetensors: eagle3
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators_side import eagle3_logits, load, read_inputs


def main(inputs: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    tensors, _ = read_inputs(inputs)
    model = load(Path(folder))
    model._load_verifier_weights(overwrite_embed_tokens=True)  # the target's, not the bf16 copy
    logits = eagle3_logits(model.float().eval(), tensors).contiguous()
    save_file({"eagle3": logits}, str(Path(out) / "logits.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
