"""DFlash heads' published layouts, read (`read_dflash`, `read_speculators_dflash`, for
`selfspec.heads.published`) and written (`DFLASH_LAYOUTS`, for `selfspec.heads.export`).

- z-lab's `DFlashDraftModel` (read by SGLang and vLLM): a Qwen3 config.json of the draft's
  layers with `dflash_config` {block_size, mask_token_id, target_layer_ids (the output of that
  layer: ours - 1)}; `layers.{i}.*` with q/k norms, `norm`, `fc`, `hidden_norm`, and (vLLM)
  `lm_head` + `d2t` for a draft vocabulary. z-lab's dflash 0.1.0 also reads, from
  `dflash_config` or the top level, settings selfspec's head does not compute
  (`ZLAB_EXTRAS`: a scale on the block's embeddings and on the logits, logit soft-capping,
  causal or sliding-window draft layers, DFlash 2's convolutions and candidate selector): a
  folder that sets one is refused (`refuse_zlab_extras`) rather than drafted differently.
- speculators' DFlash part (inside the envelope `selfspec.heads.export` writes and
  `selfspec.heads.published` reads): the layers as Qwen3's, the fused layers in
  `aux_hidden_state_layer_ids` (HF's `hidden_states[l]`: ours), `lm_head` only with a draft
  vocabulary (a full-vocabulary head's folder holds the target's).
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from pathlib import Path

import torch

from selfspec.heads.base import AttentionShape
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.dflash import default_target_layers as dflash_layers
from selfspec.heads.layouts import (
    ExportRefused,
    ExportRequest,
    HeadFolder,
    HeadLayouts,
    PublishedHead,
    SpeculatorsPart,
    Written,
    adopt,
    agreed_layers,
    refuse_flags,
    vllm_command,
    with_v4_rope,
)
from selfspec.model import ModelConfig

LAYOUT_NAMES = {"dflash": "DFlash", "speculators-dflash": "DFlash (speculators layout)"}


# ---- reading ---------------------------------------------------------------------------------


def read_dflash(found: HeadFolder) -> PublishedHead | None:
    """The DFlash head in a folder, or None when its config.json is not DFlash's."""
    config = found.config
    if "dflash_config" not in config and \
            "DFlashDraftModel" not in config.get("architectures", ()):
        return None
    return _read_dflash(found.path, config, found.state())


def read_speculators_dflash(folder: Path, config: dict, flat: dict, layer: dict, state: dict,
                            embedding: torch.Tensor | None, target_num_layers: int | None
                            ) -> tuple[PublishedHead, dict[str, torch.Tensor | None]]:
    """A speculators DFlash head (`flat`: its layer config flattened, `layer` the full one;
    `state` without the target's weights): the head and the target's weights it scores with
    (the folder's LM head, for a full-vocabulary head)."""
    refuse_flags(folder, config, ("sample_from_anchor",),
                 "slot 0 (the root) also scores a token, which selfspec's blocks do not")
    full = int(config.get("draft_vocab_size") or layer["vocab_size"]) == layer["vocab_size"]
    copies = {"lm_head": state.pop("lm_head.weight", None) if full else None}
    found = _read_dflash(folder, flat | {
        "dflash_config": {"block_size": config.get("block_size", 8),
                          "mask_token_id": config.get("mask_token_id")},
        "eagle_aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids")}, state)
    return found, copies


# z-lab's settings (dflash 0.1.0's `_draft_value` names) and the value under which selfspec's
# head computes the same function (None: unset)
ZLAB_EXTRAS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
               "final_logit_softcapping": None, "conv_kernel_size": None,
               "conv_group_size": None, "selector_rank": None, "selector_top_k": None}


def refuse_zlab_extras(folder: Path, config: dict) -> None:
    """Refuse a DFlash draft whose config sets what z-lab's DFlashDraftModel or
    DFlash2DraftModel computes and selfspec's DFlashHead does not."""
    d = config.get("dflash_config") or {}
    settings = {name: d.get(name, config.get(name)) for name in ZLAB_EXTRAS}
    found = [f"{name} {value}" for name, value in settings.items()
             if _sets(name, value, ZLAB_EXTRAS[name])]
    if "DFlash2DraftModel" in (config.get("architectures") or ()):
        found.append("architecture DFlash2DraftModel")
    if any(t != "full_attention" for t in config.get("layer_types") or ()):
        found.append(f"layer_types {config['layer_types']}")
    if config.get("is_causal"):
        found.append("is_causal true")
    if found:
        raise ValueError(f"load_head: {folder}: a DFlash draft with {', '.join(found)}, which "
                         f"selfspec's DFlash head does not compute (its layers attend the whole "
                         f"block, unscaled, with no soft-capping): serve it with z-lab's dflash")


def _sets(name: str, value, neutral) -> bool:
    """Whether a z-lab setting changes the draft (soft-capping at 0 or below is off)."""
    if value is None:
        return False
    if name == "final_logit_softcapping":
        return float(value) > 0
    return value != neutral


def _read_dflash(folder: Path, config: dict, state: dict) -> PublishedHead:
    refuse_zlab_extras(folder, config)
    d = config.get("dflash_config") or {}
    mask = d.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise ValueError(f"load_head: {folder}/config.json names no dflash_config.mask_token_id "
                         f"(the token every mask slot carries)")
    layer = ModelConfig.from_hf({**config, "model_type": "llama"})
    layers = _dflash_layers(config, d, layer.num_layers, folder)
    state = dict(state)
    draft = state.get("lm_head.weight")
    if draft is not None and "t2d" not in state:  # vLLM's layout: d2t alone
        t2d = torch.zeros(layer.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(state["d2t"])) + state["d2t"]] = True
        state["t2d"] = t2d
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    dflash = DFlashConfig(
        **{f.name: getattr(layer, f.name) for f in fields(AttentionShape)},
        intermediate_size=layer.intermediate_size, mlp_bias=layer.mlp_bias,
        num_layers=layer.num_layers, block_size=int(d.get("block_size",
                                                          config.get("block_size", 16))),
        mask_token_id=int(mask), target_layers=layers,
        target_hidden_size=state["fc.weight"].shape[1] // len(layers),
        draft_vocab_size=None if draft is None else int(draft.shape[0]),
        qk_norm="layers.0.self_attn.q_norm.weight" in state)
    notes = [f"{dflash.num_layers} layers, blocks of {dflash.block_size}, fused target layers "
             f"{list(layers)}"]
    module = adopt(DFlashHead, dflash, state, "DFlash")
    return PublishedHead("dflash", module, dflash, config.get("base_model_name_or_path"),
                         state["fc.weight"].dtype, notes)


def _dflash_layers(config: dict, d: dict, draft_layers: int, folder: Path) -> tuple[int, ...]:
    """DFlash's fused streams in our numbering: dflash_config.target_layer_ids (the output of
    that layer: one less than ours) or vLLM's eagle_aux_hidden_state_layer_ids (ours), else
    the references' default for num_target_layers and as many streams as draft layers."""
    ids = d.get("target_layer_ids", config.get("target_layer_ids"))  # z-lab reads both
    found = agreed_layers(folder, {
        "dflash_config.target_layer_ids, which counts one less": ids and [i + 1 for i in ids],
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids")})
    if found:
        return found
    if config.get("num_target_layers") is None:
        raise ValueError(f"load_head: {folder}/config.json names neither the fused layers "
                         f"(dflash_config.target_layer_ids) nor num_target_layers")
    return dflash_layers(int(config["num_target_layers"]), draft_layers)


# ---- writing ---------------------------------------------------------------------------------


def write_dflash(head: DFlashHead, request: ExportRequest) -> Written:
    """The published DFlash layout (z-lab's `DFlashDraftModel`, which SGLang and vLLM read): a
    Qwen3 config of the draft's layers, `dflash_config` with the block size, the mask token and
    the fused layers numbered by the layer whose output each is (ours - 1); our tensor names."""
    c, to, base = head.config, request.to, request.base
    target_layers_count = request.target_layers_count
    if to in ("medusa", "eagle"):
        raise ExportRefused(f"a DFlash head is not {'a Medusa' if to == 'medusa' else 'an EAGLE'} "
                            f"head: export with --to vllm, sglang or dflash")
    if not c.qk_norm:
        raise ExportRefused("the engines and the reference code build DFlash layers as Qwen3's, "
                            "with per-head q/k RMSNorm, which this head's layers lack: train it "
                            "with dflash.qk_norm=true")
    if c.attention_bias != c.attention_out_bias or c.mlp_bias:
        raise ExportRefused("a Qwen3 config has one attention_bias for q, k, v and o and no MLP "
                            "bias; this head's layers differ (a Qwen2-style target's): train it "
                            "for a target without such biases")
    if 0 in c.target_layers:
        raise ExportRefused("DFlash configs number a fused stream by the layer whose output it "
                            "is, so they cannot name the embeddings (stream 0): train with "
                            "dflash.target_layers >= 1")
    if c.draft_vocab_size is not None and to != "vllm":
        raise ExportRefused(f"{'SGLang' if to == 'sglang' else 'the reference DFlash code'} "
                            f"scores a DFlash draft with the target's LM head, over the whole "
                            f"vocabulary: export with --to vllm (which reads d2t), or train with "
                            f"dflash.draft_vocab_size=null")
    outputs = [i - 1 for i in c.target_layers]
    layer = c.layer_config().to_hf()
    config = with_v4_rope(layer, c) | {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "num_hidden_layers": c.num_layers, "attention_bias": c.attention_bias,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * c.num_layers,
        "use_sliding_window": False, "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size or c.hidden_size,
        "dflash_config": {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
                          "target_layer_ids": outputs}}
    if target_layers_count is not None:
        config["num_target_layers"] = target_layers_count
    state = dict(head.state_dict())
    notes = [f"blocks of {c.block_size} slots: up to {c.block_size - 1} tokens a forward; mask "
             f"token {c.mask_token_id} (the target's embedding of it); fused target layers "
             f"{outputs} (the outputs of those layers; selfspec's streams {list(c.target_layers)})"]
    if to == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = list(c.target_layers)  # vLLM's numbering
        spec = {"method": "dflash", "model": "{OUT}", "num_speculative_tokens": c.block_size - 1}
        if c.draft_vocab_size is not None:
            config["draft_vocab_size"] = c.draft_vocab_size
            notes.append(f"a draft vocabulary of {c.draft_vocab_size} tokens (lm_head, d2t)")
        return config, state, "model.safetensors", vllm_command(base, spec), notes
    if to == "sglang":
        command = (f"python -m sglang.launch_server --model-path {shlex.quote(base)} "
                   f"--speculative-algorithm DFLASH --speculative-draft-model-path {{OUT}}")
    else:
        command = ("python -c \"from dflash.model import DFlashDraftModel; "
                   "DFlashDraftModel.from_pretrained('{OUT}')\"  # then its spec_generate(target, "
                   f"...); target: {base}")
    return config, state, "model.safetensors", command, notes


def speculators_dflash(head: DFlashHead, state: dict[str, torch.Tensor], layer: dict,
                       request: ExportRequest) -> SpeculatorsPart:
    """A DFlash head's part of speculators' layout (`state`: its tensors with the target's
    embedding; `layer`: its layers' config); a full-vocabulary head also gets the target's
    LM head."""
    c = head.config
    if not c.qk_norm or c.attention_bias != c.attention_out_bias or c.mlp_bias:
        raise ExportRefused("speculators builds DFlash layers as Qwen3's (q/k norms, one "
                            "attention_bias, no MLP bias), which this head's differ from")
    if c.draft_vocab_size is None:
        if request.target_lm_head is None:
            raise ExportRefused("speculators scores a full-vocabulary DFlash draft with the "
                                "target's LM head, read from the folder: pass the target")
        state["lm_head.weight"] = request.target_lm_head
    config = {"architectures": ["DFlashDraftModel"],
              "transformer_layer_config": layer | {
                  "model_type": "qwen3", "num_hidden_layers": c.num_layers,
                  "layer_types": ["full_attention"] * c.num_layers,
                  "use_sliding_window": False},
              "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
              "block_size": c.block_size, "mask_token_id": c.mask_token_id,
              "target_hidden_size": c.target_hidden_size or c.hidden_size,
              "aux_hidden_state_layer_ids": list(c.target_layers),
              "sample_from_anchor": False}
    return SpeculatorsPart("dflash", c.block_size - 1, config, state)


DFLASH_LAYOUTS = HeadLayouts(write=write_dflash, name=lambda head: "DFlash",
                             speculators=speculators_dflash)
