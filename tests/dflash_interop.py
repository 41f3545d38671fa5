"""What tests/peers/test_dflash.py and test_specforge.py share: selfspec's side of the DFlash
comparison with a peer's own `DFlashDraftModel` (z-lab's dflash, SpecForge), which runs in the
peer's venv through tests/peers/dflash_side.py.

The target is a random 8-layer Llama of hidden size 32, saved as a transformers folder; both
sides take the fused streams from their own forward of it (selfspec's `return_hidden`, the
peer's `extract_context_feature` over transformers' hidden states), so a fused layer numbered
one off on either side shows in the logits. RoPE theta is 500000, not any reader's default.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import torch
from helpers import random_dflash_head, tiny_llama
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from selfspec import Transformer
from selfspec.heads import DFlashConfig, DFlashHead
from selfspec.heads.dflash import PrefixKeys

ROOT = Path(__file__).resolve().parents[1]
V, H, LAYERS, T = 64, 32, 8, 12
BLOCK, MASK, DRAFT_LAYERS = 4, V - 1, 2
STREAMS = (2, 4, 6)  # selfspec's numbering: hidden l = after l layers (the peers': l - 1)
ANCHORS = [3, 5, 7]  # block roots; every block ends inside the T positions
ROPE_THETA = 500000.0
TOLERANCE = 1e-4


def peer_python(peer: str) -> Path:
    return ROOT / ".peers" / peer / "venv" / "bin" / "python"


def make_target(folder: Path) -> Transformer:
    """The target saved as a transformers folder (the peers read it) and loaded by selfspec."""
    tiny_llama(0, vocab=V, layers=LAYERS, hidden=H).save_pretrained(folder)
    return Transformer.from_pretrained(folder).eval()


def make_inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {"input_ids": torch.randint(0, V - 1, (T,)), "anchors": torch.tensor(ANCHORS)}


def random_head(target: Transformer, seed: int) -> DFlashHead:
    config = DFlashConfig.for_target(target.config, mask_token_id=MASK, num_layers=DRAFT_LAYERS,
                                     block_size=BLOCK, target_layers=STREAMS)
    return random_dflash_head(replace(config, rope_theta=ROPE_THETA), seed=seed)


def peer_sizes(target: Transformer, seed: int) -> dict:
    """The sizes of a random draft a peer makes, fusing the same streams (in its numbering)."""
    c = target.config
    return {"vocab_size": V, "hidden_size": H, "intermediate_size": 48,
            "num_layers": DRAFT_LAYERS, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": 1e-6, "rope_theta": ROPE_THETA, "block_size": BLOCK,
            "mask_token_id": MASK, "num_target_layers": LAYERS,
            "target_layer_ids": [s - 1 for s in STREAMS], "seed": seed}


def run_side(peer: str, mode: str, out: Path, inputs: dict, target_folder: Path,
             sizes: dict | None = None, **more: str) -> tuple[dict[str, torch.Tensor], dict]:
    """tests/peers/<peer>_side.py in the peer's venv: its logits by kind (`dflash`
    [A * block, V], ...) and what it read from each folder (JSON, by kind). more: further
    metadata the side reads (paths)."""
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"target": str(target_folder)} | ({"sizes": json.dumps(sizes)} if sizes else {})
    metadata |= more
    save_file(inputs, str(out / "inputs.safetensors"), metadata=metadata)
    side = ROOT / "tests" / "peers" / f"{peer}_side.py"
    done = subprocess.run([str(peer_python(peer)), str(side), mode,
                           str(out / "inputs.safetensors"), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with safe_open(str(out / "logits.safetensors"), "pt") as f:
        read = json.loads(f.metadata()["read"])
    return load_file(str(out / "logits.safetensors")), read


def block_logits(head: DFlashHead, target: Transformer, inputs: dict) -> torch.Tensor:
    """[A * B, V], selfspec's: the streams from its own forward of the target, scored by
    `streams_block_logits`."""
    ids = inputs["input_ids"]
    with torch.no_grad():
        streams = target(ids[None], torch.arange(len(ids)),
                         return_hidden=head.config.target_layers).hidden
    return streams_block_logits(head, target, ids, streams, inputs["anchors"].tolist())


def streams_block_logits(head: DFlashHead, target: Transformer, ids: torch.Tensor,
                         streams: tuple[torch.Tensor, ...], anchors: list[int]) -> torch.Tensor:
    """[A * B, V], selfspec's: each anchor a's block [token a, mask x B - 1] (the head's block
    size B and mask token) at positions a..a + B - 1 over the context the fused `streams`
    (each [1, T, h]) give positions < a, scored by the target's LM head."""
    positions = torch.arange(len(ids))
    size, mask = head.config.block_size, head.config.mask_token_id
    out = []
    with torch.no_grad():
        context = head.context(streams)  # [1, T, h]
        for a in anchors:
            keys = head.context_keys(context[:, :a], positions[:a])
            block = torch.cat([ids[a:a + 1], torch.full((size - 1,), mask)])
            hidden = head(target.embed_tokens(block[None]), positions[a:a + size],
                          PrefixKeys(keys))
            out.append(head.logits(hidden, lm_head=target.lm_head)[0])
    return torch.cat(out)


def max_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape and torch.isfinite(theirs).all()
    return (ours - theirs).abs().max().item()


def expected_inv_freq_1(head_dim: int) -> float:
    """RoPE's second frequency at ROPE_THETA: a reader that fell back to theta 10000 differs."""
    return ROPE_THETA ** (-2 / head_dim)
