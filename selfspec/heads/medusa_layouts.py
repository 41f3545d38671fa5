"""Medusa heads' published layouts, read (`read_medusa`, for `selfspec.heads.published`) and
written (`MEDUSA_LAYOUTS`, for `selfspec.heads.export`).

- The reference layout (FasterDecoding): `medusa_lm_head.pt` or `.safetensors` + config.json
  (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`). Head i is one ResBlock
  applied num_layers times (one module, so the keys `{i}.{j}.linear.*` repeat one tensor), then
  its LM head `{i}.{num_layers}.weight`; the legacy trainer's heads (config "version": "2")
  have no LM head and use the target's. The head count comes from the weights.
- vLLM's: config `model_type: medusa`; `blocks.{i}.layers.{j}.weight|bias`,
  `lm_heads.{i}.weight` (one, `lm_heads.0`, with `original_lm_head`), `token_map` for a
  truncated vocabulary; served as top-1 chains.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from selfspec.heads.layouts import (
    WEIGHT_FILES,
    ExportRefused,
    ExportRequest,
    HeadFolder,
    HeadLayouts,
    PublishedHead,
    TargetNeeded,
    Written,
    adopt,
    read_weights,
    vllm_command,
)
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.model import ModelConfig

MEDUSA_FILES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")
LAYOUT_NAMES = {"medusa": "Medusa (reference layout)", "medusa-vllm": "Medusa (vLLM layout)"}


def read_medusa(found: HeadFolder) -> PublishedHead | None:
    """The Medusa heads in a folder (reference or vLLM layout), or None when it holds neither."""
    if any((found.path / name).is_file() for name in MEDUSA_FILES):
        return _read_reference_medusa(found.path, found.config, found.target)
    if found.config.get("model_type") == "medusa":
        return _read_vllm_medusa(found.path, found.config, found.target_lm_head)
    return None


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
    state = read_weights(folder, MEDUSA_FILES)
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
        warnings.warn(f"{folder}: {message}", stacklevel=4)
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
    state = read_weights(folder, WEIGHT_FILES)
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



# ---- writing ----------------------------------------------------------------------------------


def write_medusa(heads: MedusaHeads, request: ExportRequest) -> Written:
    """Medusa heads for the reference code (`--to medusa`) or for vLLM."""
    c, to, base = heads.config, request.to, request.base
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
    state = medusa_vllm_state(heads, request.target_lm_head)
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
    return config, state, "model.safetensors", vllm_command(base, spec), notes


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


MEDUSA_LAYOUTS = HeadLayouts(write=write_medusa, name=lambda heads: type(heads).__name__)
