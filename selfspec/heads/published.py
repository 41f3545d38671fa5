"""The published head layouts, read into selfspec's head classes (and written back by
`selfspec.heads.export`): one place that knows each format's names, shapes and config keys.

- Medusa, reference (FasterDecoding): `medusa_lm_head.pt` or `.safetensors` + config.json
  (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`). Head i is one ResBlock
  applied num_layers times (one module, so the keys `{i}.{j}.linear.*` repeat one tensor), then
  its LM head `{i}.{num_layers}.weight`; the legacy trainer's heads (config "version": "2")
  have no LM head and use the target's. The head count comes from the weights.
- Medusa, vLLM: config `model_type: medusa`; `blocks.{i}.layers.{j}.weight|bias`,
  `lm_heads.{i}.weight` (one, `lm_heads.0`, with `original_lm_head`), `token_map` for a
  truncated vocabulary.
- EAGLE-1/2: a one-layer Llama config.json; `fc.weight` [h, 2h] (+ `fc.bias`), `layers.0.*`
  without `layers.0.input_layernorm`, maybe a copy of `embed_tokens` (the target's is used).
- EAGLE-3: `fc.weight` [h, 3h], `midlayer.*` (or `layers.0.*`), `norm`, `lm_head` [draft, h],
  `d2t`, `t2d`; the fused layers in `eagle_aux_hidden_state_layer_ids` (vLLM, top level, the
  input of that layer: ours) or `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang, one
  less than ours), else the default (2, L//2, L-3) of the target.
- DFlash (z-lab's `DFlashDraftModel`, read by SGLang and vLLM): a Qwen3 config.json of the
  draft's layers with `dflash_config` {block_size, mask_token_id, target_layer_ids (the output
  of that layer: ours - 1)}; `layers.{i}.*` with q/k norms, `norm`, `fc`, `hidden_norm`, and
  (vLLM) `lm_head` + `d2t` for a draft vocabulary.
- speculators (vLLM's training library; `speculators_model_type` eagle3, peagle or dflash):
  the draft layers' config nested under `transformer_layer_config`; `layers.{i}.*` names,
  `embed_tokens` (the target's; EAGLE-3 saves it, DFlash does not), `lm_head` (DFlash: only
  with a draft vocabulary), `d2t`/`t2d` only with a draft vocabulary. The fused layers
  (`eagle_aux_hidden_state_layer_ids`, DFlash's `aux_hidden_state_layer_ids`) are HF's
  `hidden_states[l]`, the input of layer l: ours. P-EAGLE is EAGLE-3's layout with
  `mask_token_id`, the drafted tokens a forward as the greedy proposal's `speculative_tokens`,
  and `mask_hidden` [1, 1, 3h]: the mask pairs' feature *before* `fc` (ours is [h], after it;
  `mask_hidden_through_fc` / `mask_hidden_before_fc` convert).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from selfspec.heads.base import AttentionShape
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.dflash import default_target_layers as dflash_layers
from selfspec.heads.eagle import EagleConfig, EagleHead, default_target_layers
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.model import ModelConfig, aligned

MEDUSA_FILES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYOUTS = {"medusa": "Medusa (reference layout)", "medusa-vllm": "Medusa (vLLM layout)",
           "eagle": "EAGLE-1", "eagle3": "EAGLE-3", "dflash": "DFlash",
           "speculators-eagle3": "EAGLE-3 (speculators layout)",
           "speculators-dflash": "DFlash (speculators layout)",
           "speculators-peagle": "P-EAGLE (speculators layout)"}
# Weights a speculators folder may hold that are the target's, not the head's.
SPECULATORS_TARGET_WEIGHTS = ("embed_tokens.weight", "verifier_lm_head.weight",
                              "verifier_norm.weight")


class TargetNeeded(ValueError):
    """A published head that cannot be read without its target's architecture. `what` says
    what the head takes from its target; `fix` how to pass it, worded by whoever reads."""

    def __init__(self, folder: Path, what: str,
                 fix: str = "load it with its target: load_head(folder, target=...)") -> None:
        self.folder, self.what = folder, what
        super().__init__(f"load_head: {folder} {what}: {fix}")


@dataclass
class PublishedHead:
    """A head read from a published layout: the selfspec module (CPU, stored dtype) and what
    the folder says of itself."""

    layout: str  # a key of LAYOUTS
    module: nn.Module
    config: Any  # MedusaConfig | EagleConfig
    base_model: str | None  # the recorded base model name, when the folder has one
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    # Copies of the target's weights the folder holds ("embed_tokens", "lm_head"), which the
    # head uses in place of the target's (speculators'): checked against the target on loading
    target_copies: dict[str, torch.Tensor] = field(default_factory=dict)

    def describe(self, folder: Path) -> str:
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{folder}: found a {LAYOUTS[self.layout]} head{extra}"


def is_published(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (*MEDUSA_FILES, "config.json"))


def read_published(folder: Path, target: ModelConfig | None = None,
                   target_lm_head: torch.Tensor | None = None) -> PublishedHead:
    """Read the head in `folder`, recognising its layout. target: the target's architecture
    (EAGLE-3 heads without fused layer ids use its default triple; Medusa heads without an LM
    head score its vocabulary); target_lm_head: its LM head weight (a vLLM Medusa head with
    `original_lm_head` holding exactly it is read as heads sharing the target's LM head)."""
    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if any((folder / name).is_file() for name in MEDUSA_FILES):
        return _read_reference_medusa(folder, config, target)
    if config.get("model_type") == "medusa":
        return _read_vllm_medusa(folder, config, target_lm_head)
    state = _read_weights(folder, WEIGHT_FILES)
    if "speculators_model_type" in config:
        return _read_speculators(folder, config, state, target and target.num_layers)
    if "dflash_config" in config or "DFlashDraftModel" in config.get("architectures", ()):
        return _read_dflash(folder, config, state)
    if "fc.weight" in state:
        return _read_eagle(folder, config, state, target and target.num_layers)
    raise ValueError(
        f"load_head: no head checkpoint recognised in {folder}: expected head_config.json "
        f"(selfspec), medusa_lm_head.pt/.safetensors (Medusa), a config.json with model_type "
        f"medusa (vLLM Medusa), or config.json + model.safetensors/pytorch_model.bin holding "
        f"fc.weight (EAGLE-1/EAGLE-3) or with dflash_config (DFlash)")


# ---- Medusa ----------------------------------------------------------------------------------


def medusa_reference_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """The reference layout's tensors: each head's one ResBlock under every `{i}.{j}` (the
    reference applies one module num_layers times), then `{i}.{num_layers}.weight`."""
    n = heads.config.num_layers
    state = {}
    for i, head in enumerate(heads.heads):
        for j in range(n):
            for name in ("weight", "bias"):
                state[f"{i}.{j}.linear.{name}"] = getattr(head.blocks[0].linear, name).detach()
        if head.lm_head is not None:
            state[f"{i}.{n}.weight"] = head.lm_head.weight.detach()
    return state


def medusa_blocks_are_shared(heads: MedusaHeads) -> bool:
    """Whether every head's blocks are equal (what the reference layout can express)."""
    return all(torch.equal(block.linear.weight, head.blocks[0].linear.weight)
               and torch.equal(block.linear.bias, head.blocks[0].linear.bias)
               for head in heads.heads for block in head.blocks)


def medusa_vllm_state(heads: MedusaHeads, target_lm_head: torch.Tensor | None = None
                      ) -> dict[str, torch.Tensor]:
    """vLLM's layout: blocks.{i}.layers.{j}, lm_heads.{i} (lm_heads.0 = the target's LM head for
    heads sharing it, served with `original_lm_head`), token_map for a draft vocabulary."""
    state = {}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head.blocks):
            state[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach()
            state[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach()
        if head.lm_head is not None:
            state[f"lm_heads.{i}.weight"] = head.lm_head.weight.detach()
    if heads.config.shared_lm_head:
        if target_lm_head is None:
            raise ValueError("these heads share the target's LM head, which vLLM reads from the "
                             "head folder (lm_heads.0 with original_lm_head): pass the target")
        state["lm_heads.0.weight"] = target_lm_head.detach()
    if heads.draft_vocab is not None:
        state["token_map"] = heads.draft_vocab.target_ids.detach()
    return state


def _read_reference_medusa(folder: Path, config: dict, target: ModelConfig | None
                           ) -> PublishedHead:
    state = _read_weights(folder, MEDUSA_FILES)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    keys = [re.fullmatch(r"(\d+)\.(\d+)\.(linear\.)?(weight|bias)", k) for k in state]
    if not all(keys):
        bad = [k for k, m in zip(state, keys, strict=True) if not m][:5]
        raise ValueError(f"load_head: {folder} is not a Medusa checkpoint: unexpected keys {bad} "
                         f"(expected {{head}}.{{layer}}.linear.weight|bias and the LM heads)")
    num_heads = 1 + max(int(m[1]) for m in keys)
    blocks = {int(m[2]) for m in keys if m[3]}
    num_layers = int(config.get("medusa_num_layers", len(blocks)))
    notes = []
    stated = config.get("medusa_num_heads")
    if stated is not None and stated != num_heads:
        message = (f"config.json says medusa_num_heads={stated}, the weights hold {num_heads} "
                   f"heads: using {num_heads}")
        warnings.warn(f"{folder}: {message}", stacklevel=3)
        notes.append(message)
    shared = f"0.{num_layers}.weight" not in state  # the legacy trainer's heads: no LM head
    first = state["0.0.linear.weight"] if num_layers else state["0.0.weight"]
    vocab = config.get("vocab_size") or (target and target.vocab_size) if shared else \
        state[f"0.{num_layers}.weight"].shape[0]
    if vocab is None:
        raise TargetNeeded(folder, "holds Medusa heads with no LM head of their own (they use "
                                   "the target's, and score its vocabulary)")
    ours = {}
    for i in range(num_heads):
        for j in range(num_layers):
            # Keys of a shared ResBlock may be saved once: every layer is then that block.
            src = j if f"{i}.{j}.linear.weight" in state else 0
            for name in ("weight", "bias"):
                ours[f"heads.{i}.blocks.{j}.linear.{name}"] = state[f"{i}.{src}.linear.{name}"]
        if not shared:
            ours[f"heads.{i}.lm_head.weight"] = state[f"{i}.{num_layers}.weight"]
    hidden = first.shape[1]
    notes.append(f"{num_heads} heads x {num_layers} ResBlock"
                 f"{', the target LM head' if shared else ''}")
    return PublishedHead("medusa", *_medusa_module(ours, hidden, vocab, num_heads, num_layers,
                                                   shared, None),
                         config.get("base_model_name_or_path"), first.dtype, notes)


def _read_vllm_medusa(folder: Path, config: dict, target_lm_head: torch.Tensor | None
                      ) -> PublishedHead:
    state = _read_weights(folder, WEIGHT_FILES)
    num_heads, num_layers = int(config["num_heads"]), int(config.get("num_hidden_layers", 1))
    token_map = state.get("token_map")
    lm = {i: state[f"lm_heads.{i}.weight"] for i in range(num_heads)
          if f"lm_heads.{i}.weight" in state}
    shared = bool(config.get("original_lm_head")) and target_lm_head is not None and \
        torch.equal(lm[0].to(target_lm_head), target_lm_head)
    ours = {}
    for i in range(num_heads):
        for j in range(num_layers):
            ours[f"heads.{i}.blocks.{j}.linear.weight"] = state[f"blocks.{i}.layers.{j}.weight"]
            bias = state.get(f"blocks.{i}.layers.{j}.bias")
            ours[f"heads.{i}.blocks.{j}.linear.bias"] = (
                torch.zeros_like(ours[f"heads.{i}.blocks.{j}.linear.weight"][:, 0])
                if bias is None else bias)
        if not shared:  # original_lm_head: one LM head for all (copied: exact)
            ours[f"heads.{i}.lm_head.weight"] = lm[i if not config.get("original_lm_head") else 0]
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    notes = [f"{num_heads} heads x {num_layers} ResBlock"]
    if token_map is not None:
        order = torch.argsort(token_map)  # our draft ids list target ids in increasing order
        token_map = token_map[order]
        for i in range(num_heads):
            ours[f"heads.{i}.lm_head.weight"] = ours[f"heads.{i}.lm_head.weight"][order]
        notes.append(f"a draft vocabulary of {len(token_map)} tokens")
    return PublishedHead("medusa-vllm", *_medusa_module(ours, hidden, vocab, num_heads,
                                                        num_layers, shared, token_map),
                         config.get("base_model_name_or_path"), ours[next(iter(ours))].dtype,
                         notes)


def _medusa_module(state: dict, hidden: int, vocab: int, num_heads: int, num_layers: int,
                   shared: bool, token_map: torch.Tensor | None
                   ) -> tuple[MedusaHeads, MedusaConfig]:
    config = MedusaConfig(hidden_size=hidden, vocab_size=int(vocab), num_heads=num_heads,
                          num_layers=num_layers, shared_lm_head=shared,
                          draft_vocab_size=None if token_map is None else len(token_map))
    if token_map is not None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[token_map] = True
        state |= {"d2t": token_map - torch.arange(len(token_map)), "t2d": t2d}
    return adopt(MedusaHeads, config, state, "Medusa"), config


# ---- EAGLE -----------------------------------------------------------------------------------


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


def _agreed_layers(folder: Path, lists: dict[str, list[int] | None]) -> tuple[int, ...] | None:
    """The fused layers, in our numbering, that a config's keys (name: its list, already
    renumbered) agree on; None when none is given, refused when two differ."""
    found = {tuple(ids) for ids in lists.values() if ids}
    if len(found) > 1:
        given = "; ".join(f"{name}: {ids}" for name, ids in lists.items() if ids)
        raise ValueError(f"load_head: {folder}/config.json gives two different fused layer lists "
                         f"(in our numbering, {given}): keep one")
    return found.pop() if found else None


def _fused_layers(config: dict, target_num_layers: int | None, folder: Path) -> tuple[int, ...]:
    """EAGLE-3's fused layers in our numbering (the input of layer l), from whichever engine's
    key the config holds, else the target's default."""
    sglang = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    found = _agreed_layers(folder, {
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


# ---- DFlash ----------------------------------------------------------------------------------


def _read_dflash(folder: Path, config: dict, state: dict) -> PublishedHead:
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
    ids = d.get("target_layer_ids")
    found = _agreed_layers(folder, {
        "dflash_config.target_layer_ids, which counts one less": ids and [i + 1 for i in ids],
        "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids")})
    if found:
        return found
    if config.get("num_target_layers") is None:
        raise ValueError(f"load_head: {folder}/config.json names neither the fused layers "
                         f"(dflash_config.target_layer_ids) nor num_target_layers")
    return dflash_layers(int(config["num_target_layers"]), draft_layers)


# ---- speculators ----------------------------------------------------------------------------


def _read_speculators(folder: Path, config: dict, state: dict, target_num_layers: int | None
                      ) -> PublishedHead:
    """A head speculators saved: its nested layer config flattened into the engines' one-level
    config, its target-owned weights dropped, then read as the EAGLE-3 or DFlash layout."""
    kind = config["speculators_model_type"]
    if kind not in ("eagle3", "peagle", "dflash"):
        raise ValueError(f"load_head: {folder} holds a speculators {kind!r} head; selfspec reads "
                         f"speculators' eagle3, peagle and dflash heads")
    layer = _layer_config(folder, config.get("transformer_layer_config"))
    if any(t != "full_attention" for t in layer.get("layer_types") or ()):
        raise ValueError(f"load_head: {folder}: sliding-window draft layers "
                         f"({layer['layer_types']}) have no selfspec head")
    embedding = state.get("embed_tokens.weight")
    state = {k: v for k, v in state.items() if k not in SPECULATORS_TARGET_WEIGHTS}
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    flat = layer | {"base_model_name_or_path": verifier.get("name_or_path")}
    if kind in ("eagle3", "peagle"):
        parallel = _speculators_peagle(folder, config, state) if kind == "peagle" else {}
        found = _read_eagle(folder, _speculators_eagle3(folder, config, flat, state),
                            _full_vocab_maps(state, config, layer), target_num_layers, **parallel)
        copies = {"embed_tokens": embedding}
    else:
        _refuse_flags(folder, config, ("sample_from_anchor",),
                      "slot 0 (the root) also scores a token, which selfspec's blocks do not")
        full = int(config.get("draft_vocab_size") or layer["vocab_size"]) == layer["vocab_size"]
        copies = {"lm_head": state.pop("lm_head.weight", None) if full else None}
        found = _read_dflash(folder, flat | {
            "dflash_config": {"block_size": config.get("block_size", 8),
                              "mask_token_id": config.get("mask_token_id")},
            "eagle_aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids")}, state)
    found.layout = f"speculators-{kind}"
    found.target_copies = {k: v for k, v in copies.items() if v is not None}
    return found


def _layer_config(folder: Path, saved: dict | None) -> dict:
    """The draft layers' full config: speculators saves only what differs from the defaults
    of the layer's transformers class (Qwen3's when it names no model_type), so they are
    filled in from that class, as speculators itself does when it loads."""
    if not saved:
        raise ValueError(f"load_head: {folder}/config.json has no transformer_layer_config (the "
                         f"draft layers' sizes)")
    from transformers import AutoConfig

    saved = dict(saved)
    return AutoConfig.for_model(saved.pop("model_type", "qwen3"), **saved).to_dict()


def _speculators_eagle3(folder: Path, config: dict, flat: dict, state: dict) -> dict:
    if config["speculators_model_type"] == "eagle3":  # P-EAGLE's flag is on by default: there
        # the folder's embedding decides (it must be the target's, `target_copies`)
        _refuse_flags(folder, config, ("embed_requires_grad",),
                      "a trained embedding of the head's own; selfspec's heads embed with the "
                      "target's")
    _refuse_flags(folder, config, ("norm_before_residual", "norm_before_fc", "fc_norm",
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


def _speculators_peagle(folder: Path, config: dict, state: dict) -> dict[str, Any]:
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


def _refuse_flags(folder: Path, config: dict, names: tuple[str, ...], why: str) -> None:
    on = [name for name in names if config.get(name)]
    if on:
        raise ValueError(f"load_head: {folder}: a speculators head with {', '.join(on)} true has "
                         f"no selfspec equivalent ({why})")


# ---- shared ----------------------------------------------------------------------------------


def adopt(cls: type, config: Any, state: dict[str, torch.Tensor], what: str) -> nn.Module:
    """cls(config) built on the meta device, adopting `state` (no copy); refuses a state that
    does not fill it exactly."""
    with torch.device("meta"):  # no random init of weights that are about to be replaced
        module = cls(config)
    state = {name: aligned(tensor) for name, tensor in state.items()}
    expected = {name: t.shape for name, t in module.state_dict().items()}
    wrong = [f"{k} {list(v.shape)} (expected {list(expected[k])})" for k, v in state.items()
             if k in expected and v.shape != expected[k]]
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if missing or unexpected or left or wrong:
        raise ValueError(
            f"load_head: the {what} weights do not match {cls.__name__}({config}): missing "
            f"{sorted(set(missing) | set(left))[:8]}, unexpected {unexpected[:8]}, shapes "
            f"{wrong[:4]}")
    return module


def _read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    for name in names:
        path = folder / name
        if path.is_file():
            if path.suffix == ".safetensors":
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"load_head: {folder} has none of {', '.join(names)}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_head: {path} is not valid JSON ({exc})") from None
