"""Write a head in the folder layout a serving engine or the reference code loads, with the
launch command (`scripts/export_heads.py`; the layouts are `selfspec.heads.published`).

| head | vllm | sglang | medusa (reference) | eagle (reference) | dflash (reference) | speculators |
|---|---|---|---|---|---|---|
| Medusa | yes: top-1 chains | no | yes | no | no | no |
| EAGLE-1 | fc bias folded into attention biases | yes | no | yes | no | no |
| EAGLE-3 | yes | yes | no | default fused layers only | no | yes |
| P-EAGLE | no | no | no | no | no | yes (mask feature before fc) |
| DFlash | q/k norms, draft vocab | q/k norms, target's LM head | no | no | as SGLang | q/k norms |

speculators (its `SpeculatorModel.from_pretrained`) needs the target: its embedding is written
into the folder (and, for a full-vocabulary DFlash head, its LM head).

Every config.json written carries RoPE in both conventions: transformers v5's `rope_parameters`
and v4's `rope_theta` / `rope_scaling` (a v4 reader without them silently takes theta 10000).

What an engine cannot serve is refused with the reason and the fix, before anything is written.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from selfspec.heads.dflash import DFlashHead
from selfspec.heads.eagle import EagleHead, default_target_layers
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.published import (
    mask_hidden_before_fc,
    medusa_blocks_are_shared,
    medusa_reference_state,
    medusa_vllm_state,
)

ENGINES = ("vllm", "sglang", "medusa", "eagle", "dflash", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the release whose from_pretrained the layout is proven with
SERVING_FILE = "SERVING.md"
BASE_PLACEHOLDER = "<base-model>"


class ExportRefused(ValueError):
    """The engine cannot serve this head as it is; the message says why and what to do."""


@dataclass(frozen=True)
class Exported:
    """What was written: the folder, the launch command and what the engine does with it."""

    folder: Path
    command: str
    notes: tuple[str, ...]


def export_head(
    head: nn.Module, to: str, out: str | Path, *, base_model: str | None = None,
    target_layers_count: int | None = None, target_lm_head: torch.Tensor | None = None,
    target_embedding: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> Exported:
    """Write `head` for engine `to` into `out` (config.json, weights, SERVING.md).

    base_model: the target's name or folder (the launch command's model; Medusa's reference
    config records it); target_layers_count: the target's layer count (EAGLE-3 to the
    reference code, which fuses its default layers); target_lm_head: the target's LM head
    weight (Medusa heads sharing it, for vLLM); target_embedding: the target's embedding
    weight (EAGLE-3 to the reference code, which reads it from the head); dtype: of the
    written weights (None: as is).
    """
    if to not in ENGINES:
        raise ExportRefused(f"--to must be one of {', '.join(ENGINES)}, got {to!r}")
    if to == "speculators" and isinstance(head, (EagleHead, DFlashHead)):
        config, state, files, command, notes = _speculators(head, base_model, target_embedding,
                                                            target_lm_head)
    elif isinstance(head, MedusaHeads):
        config, state, files, command, notes = _medusa(head, to, base_model, target_lm_head)
    elif isinstance(head, EagleHead):
        config, state, files, command, notes = _eagle(head, to, base_model, target_layers_count,
                                                      target_embedding)
    elif isinstance(head, DFlashHead):
        config, state, files, command, notes = _dflash(head, to, base_model, target_layers_count)
    else:
        raise ExportRefused(f"no engine loads a {type(head).__name__} from a head folder: vLLM "
                            f"and SGLang serve Medusa, EAGLE and DFlash heads (early exits run "
                            f"in selfspec only)")
    if getattr(getattr(head, "config", None), "confidence_head", False):  # no layout has one
        state = {k: v for k, v in state.items() if not k.startswith("confidence.")}
        notes = [*notes, "the confidence head is left out (these layouts have none): the engine "
                         "proposes whole blocks"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
             .detach().cpu().contiguous() for k, v in state.items()}
    floating = next(v.dtype for v in state.values() if v.is_floating_point())
    config = config | {"torch_dtype": str(floating).removeprefix("torch.")}
    _write_weights(out / files, state)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    exported = Exported(out, command.replace("{OUT}", str(out)), tuple(notes))
    (out / SERVING_FILE).write_text(serving_text(head, to, exported))
    return exported


def serving_text(head: nn.Module, to: str, exported: Exported) -> str:
    kind = (f"EAGLE-{head.config.version}" if isinstance(head, EagleHead)
            else "DFlash" if isinstance(head, DFlashHead) else type(head).__name__)
    lines = [f"# Serving this {kind} head with {to}", "", "```bash", exported.command, "```", ""]
    lines += [f"- {note}" for note in exported.notes]
    return "\n".join(lines) + "\n"


# ---- Medusa ----------------------------------------------------------------------------------


def _medusa(heads: MedusaHeads, to: str, base_model: str | None,
            target_lm_head: torch.Tensor | None):
    c = heads.config
    base = base_model or BASE_PLACEHOLDER
    if to in ("sglang", "eagle", "dflash", "speculators"):
        who = {"sglang": "SGLang serves EAGLE and DFlash", "eagle": "the EAGLE code serves EAGLE",
               "dflash": "the DFlash code serves DFlash",
               "speculators": "speculators loads EAGLE-3 and DFlash"}[to]
        raise ExportRefused(f"{who} heads, not Medusa heads: export with --to vllm or --to "
                            f"medusa")
    if to == "medusa":
        if heads.draft_vocab is not None:
            raise ExportRefused("the reference Medusa code scores the whole vocabulary and has no "
                                "draft vocabulary (d2t): export with --to vllm (token_map), or "
                                "train with medusa.draft_vocab_size=null")
        if c.num_layers > 1 and not medusa_blocks_are_shared(heads):
            raise ExportRefused(f"the reference Medusa code applies one ResBlock "
                                f"{c.num_layers} times per head; these heads have "
                                f"{c.num_layers} different blocks: export with --to vllm, "
                                f"whose heads stack distinct blocks")
        config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
                  "base_model_name_or_path": base, "hidden_size": c.hidden_size,
                  "vocab_size": c.vocab_size}
        notes = [f"{c.num_heads} heads x {c.num_layers} ResBlock; the reference code decodes "
                 f"with its Medusa trees (medusa_choices)"]
        if c.shared_lm_head:  # the legacy trainer's layout: no LM heads, the target's is used
            config["version"] = "2"
            notes.append("the heads use the target's LM head (config version 2, as the legacy "
                         "trainer saves them)")
            files = "medusa_lm_head.safetensors"
        else:
            files = "medusa_lm_head.pt"
        command = f"python -m medusa.inference.cli --model {{OUT}}  # base: {base}"
        return config, medusa_reference_state(heads), files, command, notes
    state = medusa_vllm_state(heads, target_lm_head)
    vocab = heads.config.output_size
    if heads.draft_vocab is not None and not c.shared_lm_head:
        state, vocab = _medusa_full_rows(heads, state), c.vocab_size
    config = {"model_type": "medusa", "architectures": ["MedusaModel"],
              "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
              "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "truncated_vocab_size": vocab, "medusa_fc_bias": True,
              "original_lm_head": c.shared_lm_head}
    notes = ["vLLM proposes top-1 chains only: the heads are served as a chain of their top-1 "
             "tokens, not as a Medusa tree",
             f"num_speculative_tokens may not exceed the {c.num_heads} heads the folder holds"]
    if heads.draft_vocab is not None and c.shared_lm_head:
        notes.append(f"the heads score {vocab} of {c.vocab_size} tokens (token_map)")
    elif heads.draft_vocab is not None:
        notes.append(f"the heads' {c.output_size}-token draft vocabulary is written as rows "
                     f"over all {c.vocab_size} tokens (vLLM builds each head's LM head over the "
                     f"whole vocabulary): every other token's row is the mean of the draft rows, "
                     f"so its logit never reaches the top one and the top-1 chain is the same")
    spec = {"method": "medusa", "model": "{OUT}", "num_speculative_tokens": c.num_heads}
    return config, state, "model.safetensors", _vllm(base, spec), notes


def _medusa_full_rows(heads: MedusaHeads, state: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """Each head's draft-vocabulary LM head [K, h] as rows over the whole vocabulary [V, h],
    without `token_map`: vLLM 0.32 builds each head's own LM head over `vocab_size` rows and
    refuses a token map's K. A token outside the draft vocabulary gets the mean of the K draft
    rows: its logit is the mean of the draft logits, below their maximum whatever the feature
    (equal only when all K are equal), so the argmax, the one token vLLM's Medusa proposes per
    head, is the draft vocabulary's. (A top-k with k > 1 could take such a token.)"""
    ids = heads.draft_vocab.target_ids  # [K] target id of each draft row
    state = {k: v for k, v in state.items() if k != "token_map"}
    for i in range(heads.config.num_heads):
        rows = state[f"lm_heads.{i}.weight"]  # [K, h]
        full = rows.double().mean(0).to(rows.dtype).repeat(heads.config.vocab_size, 1)  # [V, h]
        full[ids.to(rows.device)] = rows
        state[f"lm_heads.{i}.weight"] = full
    return state


# ---- EAGLE -----------------------------------------------------------------------------------


def _eagle(head: EagleHead, to: str, base_model: str | None, target_layers_count: int | None,
           target_embedding: torch.Tensor | None):
    c = head.config
    base = base_model or BASE_PLACEHOLDER
    if to in ("medusa", "dflash"):
        raise ExportRefused(f"an EAGLE head is not a {to.capitalize()} head: export with --to "
                            f"vllm, sglang or eagle")
    if c.parallel > 1:
        raise ExportRefused(f"a P-EAGLE head (parallel={c.parallel}) has no layout in the "
                            f"engines' EAGLE-3 formats (its mask_hidden would be lost): export it "
                            f"with --to speculators (speculators' P-EAGLE layout), or serve "
                            f"its selfspec export folder with selfspec")
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
            notes.append(_reference_embedding(config, state, target_embedding))
    method = "eagle" if c.version == 1 else "eagle3"
    if to == "vllm":
        command = _vllm(base, {"method": method, "model": "{OUT}", "num_speculative_tokens": 5})
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


# ---- DFlash ----------------------------------------------------------------------------------


def _dflash(head: DFlashHead, to: str, base_model: str | None, target_layers_count: int | None):
    """The published DFlash layout (z-lab's `DFlashDraftModel`, which SGLang and vLLM read): a
    Qwen3 config of the draft's layers, `dflash_config` with the block size, the mask token and
    the fused layers numbered by the layer whose output each is (ours - 1); our tensor names."""
    c = head.config
    base = base_model or BASE_PLACEHOLDER
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
        return config, state, "model.safetensors", _vllm(base, spec), notes
    if to == "sglang":
        command = (f"python -m sglang.launch_server --model-path {shlex.quote(base)} "
                   f"--speculative-algorithm DFLASH --speculative-draft-model-path {{OUT}}")
    else:
        command = ("python -c \"from dflash.model import DFlashDraftModel; "
                   "DFlashDraftModel.from_pretrained('{OUT}')\"  # then its spec_generate(target, "
                   f"...); target: {base}")
    return config, state, "model.safetensors", command, notes


# ---- speculators ----------------------------------------------------------------------------


def _speculators(head: EagleHead | DFlashHead, base_model: str | None,
                 embedding: torch.Tensor | None, lm_head: torch.Tensor | None):
    """speculators' own saved layout (`Eagle3DraftModel` / `DFlashDraftModel`, which its
    `SpeculatorModel.from_pretrained` and vLLM load): the draft layers' config nested under
    `transformer_layer_config`, `layers.{i}.*` names, the fused layers as HF's
    `hidden_states[l]` (ours), and the target's embedding in the folder (without it speculators'
    from_pretrained leaves the embedding uninitialised); a DFlash head over the full vocabulary
    also gets the target's LM head."""
    c = head.config
    if embedding is None:
        raise ExportRefused("speculators reads the target's embedding from the head folder: "
                            "pass the target (--target MODEL_FOLDER)")
    if tuple(embedding.shape) != (c.vocab_size, c.hidden_size):
        raise ExportRefused(f"the target's embedding is {list(embedding.shape)}, the head "
                            f"expects {[c.vocab_size, c.hidden_size]}: pass the head's own target")
    state = dict(head.state_dict()) | {"embed_tokens.weight": embedding}
    layer = with_v4_rope(c.layer_config().to_hf(), c)
    verifier = {"name_or_path": base_model, "architectures": []}
    if isinstance(head, EagleHead):
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
        if c.parallel > 1:
            kind, steps, more = _speculators_peagle(head, state)
            config |= more
    else:
        if not c.qk_norm or c.attention_bias != c.attention_out_bias or c.mlp_bias:
            raise ExportRefused("speculators builds DFlash layers as Qwen3's (q/k norms, one "
                                "attention_bias, no MLP bias), which this head's differ from")
        if c.draft_vocab_size is None:
            if lm_head is None:
                raise ExportRefused("speculators scores a full-vocabulary DFlash draft with the "
                                    "target's LM head, read from the folder: pass the target")
            state["lm_head.weight"] = lm_head
        kind, steps = "dflash", c.block_size - 1
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
    config = {"speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION} | config
    config["speculators_config"] = {
        "algorithm": kind, "default_proposal_method": "greedy", "verifier": verifier,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps}]}
    notes = [f"fused target layers {list(c.target_layers)} (HF hidden_states[l], the input of "
             f"layer l, as speculators and vLLM number them)",
             "the folder holds the target's embedding (speculators' from_pretrained reads it "
             "there)"]
    if kind == "peagle":
        width = state["mask_hidden"].shape[-1]
        notes.append(f"P-EAGLE: {steps} tokens a forward (speculative_tokens), mask token "
                     f"{c.mask_token_id}; mask_hidden written [1, 1, {width}], before fc, which "
                     f"maps it onto selfspec's (the export checks it)")
    if base_model is None:
        notes.append("no verifier named (speculators_config.verifier.name_or_path is null): "
                     "speculators 0.9.0's EAGLE-3 from_pretrained looks its verifier up and "
                     "fails without one; export with --base-model or --target")
    command = ("python -c \"from speculators import SpeculatorModel; "
               "SpeculatorModel.from_pretrained('{OUT}')\"  # or: "
               + _vllm(base_model or BASE_PLACEHOLDER, {"model": "{OUT}",
                                                        "num_speculative_tokens": steps}))
    return config, state, "model.safetensors", command, notes


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


def with_v4_rope(layer: dict, c) -> dict:
    """A layer's config.json dict with RoPE in both conventions: v5's `rope_parameters` (from
    `to_hf`) and v4's top-level `rope_theta` and `rope_scaling`, which a transformers 4 reader
    needs (without them it takes theta 10000)."""
    return layer | {"rope_theta": c.rope_theta,
                    "rope_scaling": dict(c.rope_scaling or {}) or None}


# ---- writing ---------------------------------------------------------------------------------


def _vllm(base: str, spec: dict) -> str:
    return (f"vllm serve {shlex.quote(base)} --speculative-config "
            f"'{json.dumps(spec)}'")


def _write_weights(path: Path, state: dict[str, torch.Tensor]) -> None:
    if path.suffix == ".pt":
        torch.save(state, path)
    else:  # safetensors keeps no shared storage: one copy per name
        save_file({k: v.clone() for k, v in state.items()}, str(path))


def export_merged_target(target_folder: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """A Medusa-2 export's target: `target_folder` with the LoRA adapter merged, written by
    transformers' save_pretrained (with the target's tokenizer) so any engine loads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.model import Transformer
    from selfspec.model.lora import merge_adapter
    from selfspec.quiet import import_transformers_models

    import_transformers_models()

    merged = merge_adapter(Transformer.from_pretrained(target_folder), adapter)
    hf = AutoModelForCausalLM.from_pretrained(str(target_folder), dtype=torch.float32)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v
             for k, v in merged.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq") and k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"the merged target does not fit {type(hf).__name__}: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    out = Path(out)
    hf.save_pretrained(out)
    if any(Path(target_folder).glob("tokenizer*")):
        AutoTokenizer.from_pretrained(str(target_folder)).save_pretrained(out)
    return out
