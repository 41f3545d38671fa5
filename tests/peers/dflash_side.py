"""z-lab's dflash side of tests/peers/test_dflash.py: run with the python of dflash's own venv
(scripts/peers.sh dflash), never imported by the suite (selfspec is not installed there);
tests/peers/specforge_side.py reuses its functions for SpecForge's DFlash draft, whose forward
is called the same way. Every tensor travels in safetensors files; the draft model is the
peer's own class, made and saved with its own save_pretrained, or loaded with its own
from_pretrained, and run by its own forward on the target's residual streams, which it picks
itself (its `target_layer_ids` through its own `extract_context_feature`).

    python dflash_side.py save INPUTS OUT_DIR   # a random draft, saved to OUT_DIR/dflash
    python dflash_side.py load INPUTS OUT_DIR   # OUT_DIR/dflash loaded and scored

INPUTS (safetensors): `input_ids` [T], `anchors` [A] (block roots); its metadata holds
`target` (the target's transformers folder) and, for `save`, `sizes` (JSON). Each run writes
OUT_DIR/logits.safetensors: `dflash` [A * block, V], each anchor a's block [token a, mask x
(block - 1)] at positions a..a + block - 1 over the context of positions < a, scored with the
target's LM head; its metadata `read` (JSON, by kind) says what the peer read from the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_inputs(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, norms around 1 (an initialised draft's norms are all ones, which
    would hide a norm read from the wrong tensor)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2)


def draft_config(sizes: dict):
    """A DFlash draft's config as the published drafts have it: a Qwen3 config of the draft
    layers, with `dflash_config` (block, mask token, fused layer ids)."""
    from transformers import Qwen3Config

    layers = sizes["num_layers"]
    config = Qwen3Config(
        vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_key_value_heads"], head_dim=sizes["head_dim"],
        rms_norm_eps=sizes["rms_norm_eps"], max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": sizes["rope_theta"]},
        layer_types=["full_attention"] * layers, tie_word_embeddings=False,
        architectures=["DFlashDraftModel"])
    config.block_size = sizes["block_size"]  # SpecForge reads it here, z-lab in dflash_config
    config.num_target_layers = sizes["num_target_layers"]
    config.dflash_config = {"block_size": sizes["block_size"],
                            "mask_token_id": sizes["mask_token_id"],
                            "target_layer_ids": sizes["target_layer_ids"]}
    config._attn_implementation = "sdpa"
    return config


def load_target(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def block_logits(module, model, target, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[A * block, V]: the draft's own forward, as its spec_generate calls it, one anchor at a
    time: the context features of positions < a and the block's noise embeddings at
    positions 0..a + block - 1; the target's LM head scores the block's slots."""
    ids = t["input_ids"][None]  # [1, T]
    block, mask = model.block_size, model.mask_token_id
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = module.extract_context_feature(hidden, model.target_layer_ids)  # [1, T, n h]
        rows = []
        for a in t["anchors"].tolist():
            noise = torch.full((1, block), mask)
            noise[0, 0] = ids[0, a]
            out = model(position_ids=torch.arange(a + block)[None],
                        noise_embedding=target.get_input_embeddings()(noise),
                        target_hidden=context[:, :a])  # [1, block, h]
            rows.append(target.lm_head(out)[0])
    return torch.cat(rows)


def what_was_read(model) -> dict:
    rope = getattr(model.config, "rope_parameters", None) or {}
    return {"target_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
            "mask_token_id": model.mask_token_id, "rope_theta": rope.get("rope_theta"),
            "inv_freq_1": float(model.rotary_emb.inv_freq[1])}


def main(mode: str, inputs: str, out: str) -> None:
    from dflash import model as module

    torch.set_num_threads(1)
    t, meta = read_inputs(inputs)
    folder = Path(out) / "dflash"
    if mode == "save":
        draft = module.DFlashDraftModel(draft_config(json.loads(meta["sizes"])))
        randomize(draft, json.loads(meta["sizes"])["seed"])
        draft.save_pretrained(folder)
    model = module.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    logits = block_logits(module, model, load_target(meta["target"]), t)
    save_file({"dflash": logits.contiguous()}, str(Path(out) / "logits.safetensors"),
              metadata={"read": json.dumps({"dflash": what_was_read(model)})})


if __name__ == "__main__":
    main(*sys.argv[1:])
