"""The published head layouts, read into selfspec's head classes (and written back by
`selfspec.heads.export`). Each head type's layouts are its own module's, which also documents
them (`heads/medusa_layouts.py`: FasterDecoding's reference layout and vLLM's;
`heads/eagle_layouts.py`: EAGLE-1/2 and EAGLE-3 as the reference code, vLLM and SGLang save
them; `heads/dflash_layouts.py`: z-lab's DFlash, read by SGLang and vLLM); this module tries
their readers in turn (`READERS`) and opens speculators' envelope around them.

- speculators (vLLM's training library; `speculators_model_type` eagle3, peagle or dflash):
  the draft layers' config nested under `transformer_layer_config`; `layers.{i}.*` names,
  `embed_tokens` (the target's; EAGLE-3 saves it, DFlash does not), `lm_head` (DFlash: only
  with a draft vocabulary), `d2t`/`t2d` only with a draft vocabulary. The fused layers
  (`eagle_aux_hidden_state_layer_ids`, DFlash's `aux_hidden_state_layer_ids`) are HF's
  `hidden_states[l]`, the input of layer l: ours. The head type's part is read by its own
  module (`SPECULATORS_READERS`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from selfspec.heads import dflash_layouts, eagle_layouts, medusa_layouts
from selfspec.heads.dflash_layouts import read_dflash, read_speculators_dflash
from selfspec.heads.eagle_layouts import read_eagle, read_speculators_eagle
from selfspec.heads.layouts import HeadFolder, PublishedHead, read_json
from selfspec.heads.medusa_layouts import MEDUSA_FILES, read_medusa
from selfspec.model import ModelConfig

LAYOUTS = (medusa_layouts.LAYOUT_NAMES | eagle_layouts.LAYOUT_NAMES
           | dflash_layouts.LAYOUT_NAMES)
# Weights a speculators folder may hold that are the target's, not the head's.
SPECULATORS_TARGET_WEIGHTS = ("embed_tokens.weight", "verifier_lm_head.weight",
                              "verifier_norm.weight")
# speculators_model_type: the reader of that head type's part
SPECULATORS_READERS = {"eagle3": read_speculators_eagle, "peagle": read_speculators_eagle,
                       "dflash": read_speculators_dflash}


def is_published(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (*MEDUSA_FILES, "config.json"))


def describe(found: PublishedHead, folder: Path) -> str:
    """One line naming the layout found in `folder`, with the reader's notes."""
    extra = f" ({'; '.join(found.notes)})" if found.notes else ""
    return f"{folder}: found a {LAYOUTS[found.layout]} head{extra}"


def read_published(folder: Path, target: ModelConfig | None = None,
                   target_lm_head: torch.Tensor | None = None) -> PublishedHead:
    """Read the head in `folder`, recognising its layout. target: the target's architecture
    (EAGLE-3 heads without fused layer ids use its default triple; Medusa heads without an LM
    head score its vocabulary); target_lm_head: its LM head weight (a vLLM Medusa head with
    `original_lm_head` holding exactly it is read as heads sharing the target's LM head)."""
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    found = HeadFolder(folder, config, target, target_lm_head)
    for reader in READERS:
        if (head := reader(found)) is not None:
            return head
    raise ValueError(
        f"load_head: no head checkpoint recognised in {folder}: expected head_config.json "
        f"(selfspec), medusa_lm_head.pt/.safetensors (Medusa), a config.json with model_type "
        f"medusa (vLLM Medusa), or config.json + model.safetensors/pytorch_model.bin holding "
        f"fc.weight (EAGLE-1/EAGLE-3) or with dflash_config (DFlash)")


# ---- speculators ----------------------------------------------------------------------------


def read_speculators(found: HeadFolder) -> PublishedHead | None:
    """A head speculators saved (None: the folder's config.json is not speculators'): its
    nested layer config flattened into the engines' one-level config, its target-owned
    weights dropped, then read by its head type's module."""
    folder, config = found.path, found.config
    if "speculators_model_type" not in config:
        return None
    state = found.state()
    kind = config["speculators_model_type"]
    if kind not in SPECULATORS_READERS:
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
    head, copies = SPECULATORS_READERS[kind](folder, config, flat, layer, state, embedding,
                                             found.target_num_layers)
    head.layout = f"speculators-{kind}"
    head.target_copies = {k: v for k, v in copies.items() if v is not None}
    return head


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


# Tried in turn: the first that recognises the folder reads it (speculators' before DFlash's
# and EAGLE's, whose layouts its envelope holds).
READERS = (read_medusa, read_speculators, read_dflash, read_eagle)
