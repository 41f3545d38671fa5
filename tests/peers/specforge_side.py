"""SpecForge's side of tests/peers/test_specforge.py: run with the python of SpecForge's own
venv (scripts/peers.sh specforge), never imported by the suite (selfspec is not installed
there). Every tensor travels in safetensors files. The drafts are SpecForge's own classes,
built as its trainer builds them (`AutoDraftModelConfig.from_file` of a draft config.json,
`AutoDraftModel.from_config`), written as its exporters write them (`save_pretrained`, then
its `apply_legacy_rope_scaling`), and read back as it reads them: DFlash and P-EAGLE with
`AutoDraftModel.from_pretrained`, EAGLE-3 as its exporters materialise one (`load_eagle3`).

    python specforge_side.py save INPUTS OUT_DIR   # random DFlash, EAGLE-3, P-EAGLE drafts, saved
    python specforge_side.py load INPUTS OUT_DIR   # OUT_DIR/{dflash,eagle3,peagle} loaded, scored

INPUTS (safetensors): `input_ids` [T], `anchors` [A] (DFlash block roots), `eagle3_hidden`
[T, 3h] (EAGLE-3's fused streams); metadata `target` (the target's transformers folder) and,
for `save`, `sizes` (JSON). Writes OUT_DIR/logits.safetensors, for each folder present:
`dflash` [A * block, V] (as dflash_side.py scores it, with SpecForge's
`extract_context_feature`) and `dflash_training` (the same rows from its DFlash training
forward); `eagle3` [T, draft V] (the draft's
backbone and logits as SpecForge's EAGLE-3 trainer runs them, one step: row t reads token t
and the fused streams at t); `peagle` [rows, draft V] (its P-EAGLE training forward,
`OnlinePEagleModel`, up to the logits, with its sampled rows fixed to the inputs'
`peagle_anchor` and `peagle_depth`, over the same fused streams); metadata `read` (JSON, by
kind). P-EAGLE's sizes add `mask_token_id` and `parallel` (its `num_depths`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from dflash_side import block_logits, draft_config, load_target, randomize, read_inputs
from dflash_side import what_was_read as dflash_read
from safetensors.torch import save_file
from specforge.modeling.draft.dflash import extract_context_feature as extract_context


def build(config_json: dict, folder: Path):
    """A draft as SpecForge's trainer builds one from its draft config file."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "draft_config.json").write_text(json.dumps(config_json))
    return AutoDraftModel.from_config(AutoDraftModelConfig.from_file(folder / "draft_config.json"))


def save(model, folder: Path) -> None:
    """As SpecForge's exporters write a draft (`specforge.export.to_hf`)."""
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling

    model.save_pretrained(folder)
    apply_legacy_rope_scaling(str(folder))


def new_dflash(sizes: dict, folder: Path):
    config = draft_config(sizes).to_dict() | {"architectures": ["DFlashDraftModel"]}
    model = build(config, folder)
    randomize(model, sizes["seed"])
    return model


def new_eagle3(sizes: dict, target: str, folder: Path):
    """A random EAGLE-3 draft fusing sizes' `eagle3_layer_ids` (SpecForge's numbering, the
    output of each layer: `eagle_config`), with a draft vocabulary of every other id first and
    the target's embedding (as its trainer loads it)."""
    model = build(eagle3_config(sizes), folder)
    randomize(model, sizes["seed"] + 1)
    with_draft_vocabulary(model, sizes)
    model.load_embedding(target, embedding_key="model.embed_tokens.weight")
    return model


def eagle3_config(sizes: dict) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "vocab_size": sizes["vocab_size"], "hidden_size": sizes["hidden_size"],
              "intermediate_size": sizes["intermediate_size"], "num_hidden_layers": 1,
              "num_attention_heads": sizes["num_attention_heads"],
              "num_key_value_heads": sizes["num_key_value_heads"],
              "head_dim": sizes["head_dim"], "rms_norm_eps": sizes["rms_norm_eps"],
              "max_position_embeddings": 64, "hidden_act": "silu",
              "rope_parameters": {"rope_type": "default", "rope_theta": sizes["rope_theta"]},
              "draft_vocab_size": sizes["draft_vocab_size"],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": sizes["eagle3_layer_ids"]}}


def with_draft_vocabulary(model, sizes: dict) -> None:
    """A draft vocabulary of every other id first (d2t, t2d)."""
    vocab, draft = sizes["vocab_size"], sizes["draft_vocab_size"]
    ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])[:draft].sort().values
    with torch.no_grad():
        model.t2d.zero_()
        model.t2d[ids] = True
        model.d2t.copy_(ids - torch.arange(draft))


def new_peagle(sizes: dict, target: str, folder: Path):
    """A random one-layer P-EAGLE draft (`PEagleDraftModel`) of EAGLE-3's sizes, its mask
    token and depths written into its draft config (SpecForge's trainer takes both from its
    training config; a draft folder has to name them to be read elsewhere)."""
    config = eagle3_config(sizes) | {"architectures": ["PEagleDraftModel"],
                                     "mask_token_id": sizes["mask_token_id"],
                                     "num_depths": sizes["parallel"]}
    model = build(config, folder)
    randomize(model, sizes["seed"] + 2)
    with_draft_vocabulary(model, sizes)
    model.load_embedding(target, embedding_key="model.embed_tokens.weight")
    return model


def load(folder: Path):
    from specforge.modeling.auto import AutoDraftModel

    return AutoDraftModel.from_pretrained(folder, dtype=torch.float32).eval()


def load_eagle3(folder: Path):
    """SpecForge's EAGLE-3 draft as its exporters materialise one (`materialize_draft`): built
    from the folder's config, the weights loaded into it. Its `from_pretrained` (transformers
    5.8.1) leaves the RoPE tables of its own rotary class (`inv_freq`, `cos_cached`,
    `sin_cached`: buffers outside the state dict) as uninitialised memory, so the logits it
    gives are garbage or NaN (docs/peers.md, findings)."""
    from safetensors.torch import load_file
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(folder / "config.json"))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")),
                                                strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight"}, (missing, unexpected)
    return model.float().eval()


def dflash_training_logits(model, target, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[A * block, V]: SpecForge's DFlash training forward (`OnlineDFlashModel`, sdpa masks)
    over the whole row at once, every anchor's block beside the others, its random choice of
    anchors fixed to the inputs' `anchors`; the target's LM head scores the blocks."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel

    ids = t["input_ids"][None]  # [1, T]
    anchors = t["anchors"][None]
    trainer = OnlineDFlashModel(model, target.lm_head, target.get_input_embeddings(),
                                model.mask_token_id, block_size=model.block_size,
                                attention_backend="sdpa", num_anchors=anchors.shape[1])
    trainer._sample_anchor_positions = lambda *_: (anchors, torch.ones_like(anchors).bool())
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        context = extract_context(hidden, model.target_layer_ids)  # [1, T, n h]
        _, _, out = trainer._forward_draft_blocks(ids, context, torch.ones_like(ids))
        return target.lm_head(out)[0]


def eagle3_logits(model, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[T, draft V]: the steps of SpecForge's EAGLE-3 training forward (sdpa backend), one
    test-time-training step, the tokens fed unshifted (as selfspec's side feeds them)."""
    hidden = t["eagle3_hidden"][None]  # [1, T, 3h]
    ids = t["input_ids"][None]
    with torch.no_grad():
        projected = model.project_hidden_states(hidden)
        mask = model.prepare_decoder_attention_mask(
            torch.ones_like(ids, dtype=torch.bool), projected, 1, ids.shape[1], 0)
        out = model.backbone(input_embeds=model.embed_input_ids(ids), hidden_states=projected,
                             cache_hidden=[[], []], attention_mask=mask,
                             position_ids=torch.arange(ids.shape[1])[None], use_cache=True)
        return model.compute_logits(out)[0]


def peagle_logits(model, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, draft V]: SpecForge's P-EAGLE training forward up to the logits, its COD
    sampling replaced by the inputs' rows (anchor, depth) and its loss by a capture of the
    logits. Its flex attention runs eagerly (its compiled kernel options are GPU tuning), and
    its loss module, which imports Triton at import time, is stood in for: only the logits
    are compared."""
    import types

    sys.modules["specforge.core.loss"] = types.ModuleType("specforge.core.loss")
    sys.modules["specforge.core.loss"].LogSoftmaxLoss = None
    from specforge.algorithms.peagle import model as peagle
    from specforge.modeling.draft import peagle as layers
    from torch.nn.attention.flex_attention import flex_attention

    layers.compile_friendly_flex_attention = (
        lambda query, key, value, block_mask, enable_gqa, kernel_options:
        flex_attention(query, key, value, block_mask=block_mask, enable_gqa=enable_gqa))
    rows = (t["peagle_anchor"], t["peagle_depth"])
    peagle.generate_cod_sample_indices = lambda **_: rows
    captured = {}

    def capture(logits, **_):
        captured["logits"] = logits
        return logits.sum(), {}

    peagle.compute_peagle_metrics = capture
    ids = t["input_ids"][None]  # [1, T]
    trainer = peagle.OnlinePEagleModel(model, model.config.mask_token_id,
                                       num_depths=model.config.num_depths)
    with torch.no_grad():
        trainer(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids),
                target=torch.zeros(1, ids.shape[1], model.vocab_size),
                hidden_states=t["eagle3_hidden"][None])
    return captured["logits"][0]


def eagle3_read(model) -> dict:
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    return {"eagle_config": getattr(c, "eagle_config", None), "rope_theta": rope.get("rope_theta"),
            "draft_vocab_size": model.draft_vocab_size,
            "inv_freq_1": float(model.midlayer.self_attn.rotary_emb.inv_freq[1])}


def main(mode: str, inputs: str, out: str) -> None:
    from specforge.modeling.draft import dflash as module

    torch.set_num_threads(1)
    t, meta = read_inputs(inputs)
    out_dir = Path(out)
    if mode == "save":
        sizes = json.loads(meta["sizes"])
        save(new_dflash(sizes, out_dir / "built_dflash"), out_dir / "dflash")
        save(new_eagle3(sizes, meta["target"], out_dir / "built_eagle3"), out_dir / "eagle3")
        save(new_peagle(sizes, meta["target"], out_dir / "built_peagle"), out_dir / "peagle")
    target = load_target(meta["target"])
    logits, read = {}, {}
    if (out_dir / "dflash").is_dir():
        dflash = load(out_dir / "dflash")
        logits["dflash"] = block_logits(module, dflash, target, t)
        logits["dflash_training"] = dflash_training_logits(dflash, target, t)
        read["dflash"] = dflash_read(dflash)
    if (out_dir / "eagle3").is_dir():
        eagle3 = load_eagle3(out_dir / "eagle3")
        # SpecForge embeds with the target's frozen embedding, which it loads from the target
        # whether or not the draft folder holds one (an SGLang-layout folder does not)
        eagle3.load_embedding(meta["target"], embedding_key="model.embed_tokens.weight")
        logits["eagle3"] = eagle3_logits(eagle3, t)
        read["eagle3"] = eagle3_read(eagle3)
    if (out_dir / "peagle").is_dir():
        peagle = load(out_dir / "peagle")
        # a folder selfspec writes holds no embedding: SpecForge's builder loads the target's
        peagle.load_embedding(meta["target"], embedding_key="model.embed_tokens.weight")
        logits["peagle"] = peagle_logits(peagle, t)
        read["peagle"] = {"mask_token_id": peagle.config.mask_token_id,
                          "num_depths": peagle.config.num_depths,
                          "layers": len(peagle.layers),
                          "mask_hidden": list(peagle.mask_hidden.shape),
                          "inv_freq_1": float(peagle.rotary_emb.inv_freq[1])}
    save_file({k: v.contiguous() for k, v in logits.items()}, str(out_dir / "logits.safetensors"),
              metadata={"read": json.dumps(read)})


if __name__ == "__main__":
    main(*sys.argv[1:])
