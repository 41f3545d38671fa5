"""EAGLE heads' published layouts, read (`read_eagle`, `read_speculators_eagle`, for
`selfspec.heads.published`) and written (`EAGLE_LAYOUTS`, for `selfspec.heads.export`).

- EAGLE-1/2: a one-layer Llama config.json; `fc.weight` [h, 2h] (+ `fc.bias`), `layers.0.*`
  without `layers.0.input_layernorm`, maybe a copy of `embed_tokens` (the target's is used).
  vLLM builds its fc without a bias: a bias is folded into the attention's (`fold_fc_bias`).
- EAGLE-3: `fc.weight` [h, 3h], `midlayer.*` (or `layers.0.*`), `norm`, `lm_head` [draft, h],
  `d2t`, `t2d`; the fused layers in `eagle_aux_hidden_state_layer_ids` (vLLM, top level, the
  input of that layer: ours) or `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang, one
  less than ours), else the default (2, L//2, L-3) of the target.
- speculators' EAGLE-3 and P-EAGLE parts (inside the envelope `selfspec.heads.export` writes
  and `selfspec.heads.published` reads): `layers.0.*` names, `d2t`/`t2d` only with a draft
  vocabulary; P-EAGLE adds `mask_token_id`, its tokens a forward as the greedy proposal's
  `speculative_tokens`, and `mask_hidden` [1, 1, 3h]: the mask pairs' feature *before* `fc`
  (ours is [h], after it; `mask_hidden_through_fc` / `mask_hidden_before_fc` convert).
- SpecForge's P-EAGLE (`PEagleDraftModel`, written by `--to sglang`): SGLang's EAGLE-3 config
  (`eagle_config` ids) with that architecture, `layers.0.*` names, the same [1, 1, 3h]
  `mask_hidden`, and `mask_token_id` and `num_depths` (K), which SpecForge keeps in its training
  config, not the draft's: selfspec writes them and reads them back (`dflash_config`'s
  `mask_token_id`, where SpecForge's trainer looks, is read too).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from selfspec.heads.eagle import EagleConfig, EagleHead, default_target_layers
from selfspec.heads.layouts import (
    ExportRefused,
    ExportRequest,
    HeadFolder,
    HeadLayouts,
    PublishedHead,
    SpeculatorsPart,
    TargetNeeded,
    Written,
    adopt,
    agreed_layers,
    refuse_flags,
    vllm_command,
    with_v4_rope,
)
from selfspec.model import ModelConfig

LAYOUT_NAMES = {"eagle": "EAGLE-1", "eagle3": "EAGLE-3",
                "speculators-eagle3": "EAGLE-3 (speculators layout)",
                "speculators-peagle": "P-EAGLE (speculators layout)",
                "specforge-peagle": "P-EAGLE (SpecForge's PEagleDraftModel)"}
SPECFORGE_PEAGLE = "PEagleDraftModel"


# ---- reading ---------------------------------------------------------------------------------


def read_eagle(found: HeadFolder) -> PublishedHead | None:
    """The EAGLE-1 or EAGLE-3 head in a folder, or None when its weights hold no fc."""
    state = found.state()
    if "fc.weight" not in state:
        return None
    if found.config.get("architectures") == [SPECFORGE_PEAGLE]:
        return _read_specforge_peagle(found.path, found.config, state, found.target_num_layers)
    return _read_eagle(found.path, found.config, state, found.target_num_layers)


def _read_specforge_peagle(folder: Path, config: dict, state: dict,
                           target_num_layers: int | None) -> PublishedHead:
    """SpecForge's P-EAGLE draft: one layer of EAGLE-3's shape, its mask feature converted
    through fc; its embedding (SpecForge trains it by default) must be the target's."""
    if config.get("norm_before_residual") or int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"load_head: {folder}: selfspec's P-EAGLE head is one EAGLE-3 layer "
                         f"keeping the raw feature as its residual; this SpecForge draft has "
                         f"{config.get('num_hidden_layers')} layer(s), norm_before_residual "
                         f"{bool(config.get('norm_before_residual'))}: train it with "
                         f"num_hidden_layers 1 and norm_before_residual false")
    mask = config.get("mask_token_id", (config.get("dflash_config") or {}).get("mask_token_id"))
    parallel = config.get("num_depths")
    if mask is None or parallel is None or "mask_hidden" not in state:
        raise ValueError(f"load_head: {folder} holds a SpecForge P-EAGLE draft without "
                         f"mask_token_id, num_depths or mask_hidden: add to its config.json the "
                         f"mask token and the depths (tokens a forward) it was trained with")
    embedding = state.get("embed_tokens.weight")
    state = state | {"mask_hidden": mask_hidden_through_fc(state["fc.weight"],
                                                           state["mask_hidden"])}
    found = _read_eagle(folder, config, state, target_num_layers, parallel=int(parallel),
                        mask_token_id=int(mask))
    found.layout = "specforge-peagle"
    found.target_copies = {} if embedding is None else {"embed_tokens": embedding}
    return found


def read_speculators_eagle(folder: Path, config: dict, flat: dict, layer: dict, state: dict,
                           embedding: torch.Tensor | None, target_num_layers: int | None
                           ) -> tuple[PublishedHead, dict[str, torch.Tensor | None]]:
    """A speculators EAGLE-3 or P-EAGLE head (`flat`: its layer config flattened, `layer` the
    full one; `state` without the target's weights): the head and the target's weights it
    embeds with (the folder's embedding)."""
    kind = config["speculators_model_type"]
    parallel = _peagle_settings(folder, config, state) if kind == "peagle" else {}
    found = _read_eagle(folder, _speculators_eagle3(folder, config, flat, state),
                        _full_vocab_maps(state, config, layer), target_num_layers, **parallel)
    return found, {"embed_tokens": embedding}


def eagle_layer_config(config: dict, q_rows: int) -> ModelConfig:
    """The head layer's architecture from a published one-layer config.json: a Llama layer
    whatever model_type the config names (heads for Qwen3 targets may say qwen3), head_dim
    from its q_proj's rows (q_rows): hidden / heads for the reference code's heads, the
    config's head_dim for heads the engines serve (Qwen3-0.6B's: 128 of a 1024 hidden)."""
    hf = {**config, "model_type": "llama", "num_hidden_layers": 1}
    hf["head_dim"] = q_rows // hf["num_attention_heads"]
    return ModelConfig.from_hf(hf)


def _read_eagle(folder: Path, config: dict, state: dict, target_num_layers: int | None,
                **eagle3: Any) -> PublishedHead:
    """eagle3: further EagleConfig settings of an EAGLE-3 head (P-EAGLE's parallel and
    mask_token_id)."""
    if not config:
        raise ValueError(f"load_head: {folder} holds EAGLE weights but no config.json (the "
                         f"head's one-layer Llama config)")
    state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}  # the target's
    if config.get("bias") is False and "fc.bias" in state and not state["fc.bias"].any():
        del state["fc.bias"]  # SGLang's zero fc bias on a bias-free head: dropping it is exact
    state = {re.sub(r"^layers\.0\.", "midlayer.", k) if "d2t" in state else k: v
             for k, v in state.items()}
    h, in_features = state["fc.weight"].shape
    version = 1 if in_features == 2 * h else 3
    prefix = "layers.0" if version == 1 else "midlayer"
    layer = eagle_layer_config(config, state[f"{prefix}.self_attn.q_proj.weight"].shape[0])
    has = {name: f"{prefix}.{name}" in state for name in
           ("self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.gate_proj.bias")}
    shared = {f.name: getattr(layer, f.name) for f in fields(EagleConfig)
              if hasattr(layer, f.name) and f.name not in ("version", "draft_vocab_size",
                                                          "target_layers", "fc_bias")}
    shared |= {"attention_bias": has["self_attn.q_proj.bias"],
               "attention_out_bias": has["self_attn.o_proj.bias"],
               "mlp_bias": has["mlp.gate_proj.bias"]}
    notes = []
    if version == 1:
        eagle = EagleConfig(version=1, fc_bias="fc.bias" in state, **shared)
    else:
        layers = _fused_layers(config, target_num_layers, folder)
        eagle = EagleConfig(version=3, draft_vocab_size=int(state["lm_head.weight"].shape[0]),
                            target_layers=layers, fc_bias="fc.bias" in state,
                            **(shared | {"target_hidden_size": in_features // 3}), **eagle3)
        notes.append(f"fused target layers {list(layers)}, a draft vocabulary of "
                     f"{eagle.draft_vocab_size} tokens")
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    module = adopt(EagleHead, eagle, state, "EAGLE")
    return PublishedHead("eagle" if version == 1 else "eagle3", module, eagle,
                         config.get("base_model_name_or_path"), state["fc.weight"].dtype, notes)


def _fused_layers(config: dict, target_num_layers: int | None, folder: Path) -> tuple[int, ...]:
    """EAGLE-3's fused layers in our numbering (the input of layer l), from whichever engine's
    key the config holds, else the target's default."""
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    found = agreed_layers(folder, {
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "eagle_config's, which counts one less": sglang and [i + 1 for i in sglang]})
    if found:
        return found
    if target_num_layers is None:
        raise TargetNeeded(folder, "holds an EAGLE-3 head that does not name its fused layers "
                                   "(it fuses its target's default layers 2, L//2, L-3)")
    layers = default_target_layers(target_num_layers)
    if len(set(layers)) < 3:
        raise ValueError(f"load_head: the default EAGLE-3 layers (2, L//2, L-3) of a "
                         f"{target_num_layers}-layer target are {list(layers)}, not three distinct "
                         f"layers; this head needs a deeper target or explicit layer ids in "
                         f"config.json (eagle_aux_hidden_state_layer_ids)")
    return layers


def _speculators_eagle3(folder: Path, config: dict, flat: dict, state: dict) -> dict:
    if config["speculators_model_type"] == "eagle3":  # P-EAGLE's flag is on by default: there
        # the folder's embedding decides (it must be the target's, `target_copies`)
        refuse_flags(folder, config, ("embed_requires_grad",),
                      "a trained embedding of the head's own; selfspec's heads embed with the "
                      "target's")
    refuse_flags(folder, config, ("norm_before_residual", "norm_before_fc", "fc_norm",
                                   "norm_output"),
                  "selfspec's EAGLE-3 layer keeps the raw feature as its residual, with no norm "
                  "before fc and no norm of its output")
    if "layers.0.self_attn.q_norm.weight" in state or \
            int(flat.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"load_head: {folder}: selfspec's EAGLE-3 head is one Llama layer "
                         f"without q/k norms; this one has {flat.get('num_hidden_layers')} "
                         f"{flat.get('model_type')} layer(s)")
    return flat | {"eagle_aux_hidden_state_layer_ids":
                   config.get("eagle_aux_hidden_state_layer_ids")}


def _peagle_settings(folder: Path, config: dict, state: dict) -> dict[str, Any]:
    """A speculators P-EAGLE head's parallel settings (its tokens a forward, from the greedy
    proposal's speculative_tokens; its mask token), its [1, 1, 3h] mask_hidden in `state`
    replaced by ours, the same vector through fc."""
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    parallel, mask = proposals[0].get("speculative_tokens"), config.get("mask_token_id")
    if parallel is None or mask is None or "mask_hidden" not in state:
        raise ValueError(f"load_head: {folder} holds a speculators P-EAGLE head without its "
                         f"speculative_tokens, mask_token_id or mask_hidden: save it with "
                         f"speculators' own save_pretrained")
    state["mask_hidden"] = mask_hidden_through_fc(state["fc.weight"], state["mask_hidden"])
    return {"parallel": int(parallel), "mask_token_id": int(mask)}


def mask_hidden_through_fc(fc_weight: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """speculators' P-EAGLE mask feature (any shape ending in 3h, before fc) as ours [h]:
    fc's product, computed in float64 and rounded once (fc has no bias in EAGLE-3)."""
    return (fc_weight.double() @ before.reshape(-1).double()).to(fc_weight.dtype)


def mask_hidden_before_fc(fc_weight: torch.Tensor, after: torch.Tensor,
                          tolerance: float = 1e-5) -> torch.Tensor:
    """Our P-EAGLE mask feature [h] (after fc) as speculators' [3h] (before it): the shortest
    m with fc_weight m = after (the pseudo-inverse's solution), exact whenever fc_weight [h, 3h]
    has full row rank, as a trained one has. Refused when fc, at the stored precision, misses
    `after` by more than tolerance x its largest entry (a rank-deficient fc)."""
    weight, target = fc_weight.double(), after.reshape(-1).double()
    before = (torch.linalg.pinv(weight) @ target).to(fc_weight.dtype)  # [3h]
    miss = (weight @ before.double() - target).abs().max().item()
    scale = max(target.abs().max().item(), torch.finfo(torch.float32).tiny)
    if miss > tolerance * scale:
        raise ValueError(f"P-EAGLE's mask_hidden is read after fc here and before fc in "
                         f"speculators, and no vector before this head's fc gives it (fc's "
                         f"weight has rank {int(torch.linalg.matrix_rank(weight))} of "
                         f"{weight.shape[0]}; the nearest misses by {miss:.1e}): retrain the "
                         f"head, or serve its selfspec export folder with selfspec")
    return before


def _full_vocab_maps(state: dict, config: dict, layer: dict) -> dict:
    """speculators saves no d2t/t2d when the draft vocabulary is the target's: ours are the
    identity (d2t zeros, t2d all true)."""
    if "d2t" in state:
        return state
    vocab = int(layer["vocab_size"])
    draft = int(config.get("draft_vocab_size") or vocab)
    if draft != vocab:
        raise ValueError(f"speculators head: a draft vocabulary of {draft} of {vocab} tokens "
                         f"without d2t/t2d")
    return state | {"d2t": torch.zeros(vocab, dtype=torch.long),
                    "t2d": torch.ones(vocab, dtype=torch.bool)}


# ---- writing ---------------------------------------------------------------------------------


def write_eagle(head: EagleHead, request: ExportRequest) -> Written:
    """An EAGLE-1 or EAGLE-3 head for vLLM, SGLang or the reference code (`--to eagle`)."""
    c, to, base = head.config, request.to, request.base
    target_layers_count = request.target_layers_count
    if to in ("medusa", "dflash"):
        raise ExportRefused(f"an EAGLE head is not a {to.capitalize()} head: export with --to "
                            f"vllm, sglang or eagle")
    if c.parallel > 1 and to != "sglang":
        raise ExportRefused(f"a P-EAGLE head (parallel={c.parallel}) has no layout in {to}'s "
                            f"EAGLE-3 format (its mask_hidden would be lost): export it with "
                            f"--to speculators (speculators' P-EAGLE layout) or --to sglang "
                            f"(SpecForge's), or serve its selfspec export folder with selfspec")
    _check_llama_layer(c, to)
    state = {k: v for k, v in head.state_dict().items()}
    llama = c.layer_config().to_hf()
    config = with_v4_rope(llama, c) | {"num_hidden_layers": 1,
                                       "attention_bias": c.attention_bias}
    fc_bias = state.get("fc.bias")
    has_bias = fc_bias is not None and bool(fc_bias.any())
    notes = []
    if c.version == 1:
        config["architectures"] = ["LlamaForCausalLMEagle" if to == "sglang"
                                   else "LlamaForCausalLM"]
        if to == "eagle":
            config["bias"] = fc_bias is not None  # the reference reads `bias` as fc's
        else:  # vLLM and SGLang read `bias` as the attention's
            config["bias"] = c.attention_bias
        if to == "vllm":
            if has_bias:
                state = fold_fc_bias(state)
                config["bias"] = config["attention_bias"] = True
                notes.append("vLLM builds EAGLE-1's fc without a bias: this head's fc.bias is "
                             "carried by the layer's attention biases (q, k, v: W b; o: b), "
                             "the same function")
            state.pop("fc.bias", None)
        if to == "sglang" and fc_bias is None:
            state["fc.bias"] = torch.zeros_like(state["fc.weight"][:, 0])
            notes.append("SGLang's EAGLE fc always has a bias: a zero one is written")
    else:
        if fc_bias is not None:
            raise ExportRefused("EAGLE-3's fc has no bias in the reference code, vLLM or SGLang: "
                                "train the head with eagle.fc_bias=null")
        layers = list(c.target_layers)
        config |= {"architectures": ["LlamaForCausalLMEagle3"],
                   "draft_vocab_size": c.draft_vocab_size,
                   "target_hidden_size": c.target_hidden_size or c.hidden_size}
        if to == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = layers  # the input of each layer
        elif to == "sglang":
            if 0 in layers:
                raise ExportRefused("SGLang numbers a fused layer by the layer whose output it "
                                    "is, so it cannot name the embeddings (layer input 0): "
                                    "train with target_layers >= 1 or serve with --to vllm")
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}
        elif target_layers_count is None or \
                tuple(layers) != default_target_layers(target_layers_count):
            raise ExportRefused(f"the reference EAGLE-3 code fuses the default layers (2, L//2, "
                                f"L-3) of its target; this head fuses {layers}"
                                f"{'' if target_layers_count else ' of a target of unknown depth'}"
                                f": export with --to vllm or --to sglang, which read the ids")
        notes.append(f"fused target layers {layers} (selfspec's numbering: the input of layer "
                     f"l); a draft vocabulary of {c.draft_vocab_size} tokens (d2t, t2d)")
        if to == "eagle":
            notes.append(_reference_embedding(config, state, request.target_embedding))
    if c.parallel > 1:
        return _specforge_peagle(head, config, state, notes)
    method = "eagle" if c.version == 1 else "eagle3"
    if to == "vllm":
        command = vllm_command(base, {"method": method, "model": "{OUT}",
                                      "num_speculative_tokens": 5})
    elif to == "sglang":
        command = (f"python -m sglang.launch_server --model-path {shlex.quote(base)} "
                   f"--speculative-algorithm {method.upper()} --speculative-draft-model-path "
                   f"{{OUT}} --speculative-num-steps 3 --speculative-eagle-topk 4 "
                   f"--speculative-num-draft-tokens 16")
    else:
        command = (f"python -c \"from eagle.model.ea_model import EaModel; EaModel.from_pretrained("
                   f"base_model_path='{base}', ea_model_path='{{OUT}}', total_token=-1)\"")
    return config, state, "model.safetensors", command, notes


def fold_fc_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-1's layer with fc's bias b moved into its attention: the layer reads x + b, where
    x = fc's product without b. Its only reads of the input are q, k, v (each W (x + b) =
    W x + W b, before RoPE) and the residual (x + b + attention(...)), so q/k/v biases W b and
    an o bias b give the same function for an engine whose fc has no bias. The biases are
    computed and kept in float32 (rounded to a half-precision head's dtype they would move
    the function)."""
    state = dict(state)
    bias = state.pop("fc.bias").double()  # [h]
    prefix = "layers.0.self_attn."
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = state[f"{prefix}{name}.weight"].double()  # [out, h]
        old = state.get(f"{prefix}{name}.bias")
        folded = weight @ bias + (0 if old is None else old.double())  # [out]
        state[f"{prefix}{name}.bias"] = folded.float()
    old = state.get(f"{prefix}o_proj.bias")
    state[f"{prefix}o_proj.bias"] = (bias + (0 if old is None else old.double())).float()
    return state


def _reference_embedding(config: dict, state: dict, embedding: torch.Tensor | None) -> str:
    """What the reference EAGLE-3 code embeds tokens with: it loads the base model's
    embedding only for a config without `target_hidden_size`, and otherwise takes the head's
    own `embed_tokens.weight` (loading without strict checks: one missing stays random). So
    the target's embedding is written into the head, or, without it, target_hidden_size is
    left out where it equals hidden_size (its default there)."""
    expected = (config["vocab_size"], config["hidden_size"])
    if embedding is not None:
        if tuple(embedding.shape) != expected:
            raise ExportRefused(f"the target's embedding is {list(embedding.shape)}, the head "
                                f"expects {list(expected)}: pass the head's own target")
        state["embed_tokens.weight"] = embedding
        return ("the target's embedding is written into the head: the reference code reads it "
                "there when config.json names target_hidden_size")
    if config["target_hidden_size"] != config["hidden_size"]:
        raise ExportRefused("the reference EAGLE-3 code embeds with the head's own embedding "
                            "when target_hidden_size differs from hidden_size: pass the target "
                            "(--target MODEL_FOLDER) so that its embedding is written")
    del config["target_hidden_size"]
    return ("no target_hidden_size in config.json: the reference code loads the embedding "
            "from the base model's checkpoint (through its index file)")


def _check_llama_layer(c, to: str) -> None:
    """The engines build the head's layer from a Llama config: one attention_bias for q, k, v
    and o; the reference code also computes head_dim as hidden / heads (vLLM and SGLang read
    the config's head_dim)."""
    if to == "eagle" and c.head_dim * c.num_heads != c.hidden_size:
        raise ExportRefused(f"the reference EAGLE code computes head_dim as hidden / heads "
                            f"({c.hidden_size} / {c.num_heads}); this head's is {c.head_dim} "
                            f"(its target's): export with --to vllm or --to sglang, which read "
                            f"head_dim from config.json")
    if c.attention_bias != c.attention_out_bias:
        raise ExportRefused("a Llama config has one attention_bias for q, k, v and o; this head "
                            "has a bias on q, k, v only (Qwen2 style), which the engines' Llama "
                            "EAGLE heads do not build")


def speculators_eagle(head: EagleHead, state: dict[str, torch.Tensor], layer: dict,
                      request: ExportRequest) -> SpeculatorsPart:
    """An EAGLE-3 or P-EAGLE head's part of speculators' layout (`state`: its tensors with the
    target's embedding; `layer`: its layer's config)."""
    c = head.config
    if c.version != 3:
        raise ExportRefused("speculators' layouts here are EAGLE-3's and P-EAGLE's: export "
                            "EAGLE-1 heads with --to vllm, sglang or eagle")
    if state.get("fc.bias") is not None:
        raise ExportRefused("speculators' EAGLE-3 fc has no bias: train the head with "
                            "eagle.fc_bias=null")
    _check_llama_layer(c, "speculators")
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    if c.draft_vocab_size == c.vocab_size:  # speculators keeps no maps for the identity
        state.pop("d2t"), state.pop("t2d")
    kind, steps = "eagle3", 3
    config = {"architectures": ["Eagle3DraftModel"],
              "transformer_layer_config": layer | {"num_hidden_layers": 1},
              "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": False,
              "target_hidden_size": c.target_hidden_size or c.hidden_size,
              "eagle_aux_hidden_state_layer_ids": list(c.target_layers)}
    notes = []
    if c.parallel > 1:
        kind, steps, more = _speculators_peagle(head, state)
        config |= more
        width = state["mask_hidden"].shape[-1]
        notes.append(f"P-EAGLE: {steps} tokens a forward (speculative_tokens), mask token "
                     f"{c.mask_token_id}; mask_hidden written [1, 1, {width}], before fc, which "
                     f"maps it onto selfspec's (the export checks it)")
    return SpeculatorsPart(kind, steps, config, state, notes)


def _speculators_peagle(head: EagleHead, state: dict) -> tuple[str, int, dict]:
    """P-EAGLE in speculators' layout: its mask feature enters before fc ([1, 1, 3h]), ours
    after it ([h]): written as the vector fc maps onto ours (refused where none does); the
    embedding is the target's, frozen (speculators' P-EAGLE trains its own by default)."""
    try:
        before = mask_hidden_before_fc(head.fc.weight.detach(), head.mask_hidden.detach())
    except ValueError as exc:
        raise ExportRefused(str(exc)) from None
    state["mask_hidden"] = before.view(1, 1, -1)
    return "peagle", head.config.parallel, {
        "architectures": ["PEagleSpeculator"], "mask_token_id": head.config.mask_token_id,
        "embed_requires_grad": False}


def _specforge_peagle(head: EagleHead, config: dict, state: dict, notes: list[str]
                      ) -> Written:
    """SGLang's EAGLE-3 folder as SpecForge's P-EAGLE draft (`PEagleDraftModel`): `layers.0.*`,
    the mask feature before fc, and the two settings SpecForge keeps outside the draft's
    config (its mask token, its depths: K)."""
    c = head.config
    try:
        before = mask_hidden_before_fc(head.fc.weight.detach(), head.mask_hidden.detach())
    except ValueError as exc:
        raise ExportRefused(str(exc)) from None
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    state["mask_hidden"] = before.view(1, 1, -1)
    config |= {"architectures": [SPECFORGE_PEAGLE], "norm_before_residual": False,
               "mask_token_id": c.mask_token_id, "num_depths": c.parallel}
    notes.append(f"SpecForge's P-EAGLE: {c.parallel} tokens a forward (num_depths), mask token "
                 f"{c.mask_token_id}; mask_hidden written [1, 1, {before.numel()}], before fc, "
                 f"which maps it onto selfspec's (the export checks it)")
    command = ("python -c \"from specforge.modeling.auto import AutoDraftModel; "
               "AutoDraftModel.from_pretrained('{OUT}')\"")
    return config, state, "model.safetensors", command, notes


EAGLE_LAYOUTS = HeadLayouts(write=write_eagle, name=lambda head: f"EAGLE-{head.config.version}",
                            speculators=speculators_eagle)
