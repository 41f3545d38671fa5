"""Write a head in the folder layout a serving engine or the reference code loads, with the
launch command (`scripts/export_heads.py`). Each head type's layouts are its own module's
(`heads/medusa_layouts.py`, `heads/eagle_layouts.py`, `heads/dflash_layouts.py`); this module
looks them up by the head's class (`WRITERS`) and writes what they return, inside speculators'
envelope for `--to speculators`.

| head | vllm | sglang | medusa (reference) | eagle (reference) | dflash (reference) | speculators |
|---|---|---|---|---|---|---|
| Medusa | yes: top-1 chains | no | yes | no | no | no |
| EAGLE-1 | fc bias folded into attention biases | yes | no | yes | no | no |
| EAGLE-3 | yes | yes | no | default fused layers only | no | yes |
| P-EAGLE | no | as SpecForge's PEagleDraftModel | no | no | no | yes (mask feature before fc) |
| DFlash | q/k norms, draft vocab | q/k norms, target's LM head | no | no | as SGLang | q/k norms |

speculators (its `SpeculatorModel.from_pretrained`) needs the target: its embedding is written
into the folder (and, for a full-vocabulary DFlash head, its LM head).

Every config.json written carries RoPE in both conventions: transformers v5's `rope_parameters`
and v4's `rope_theta` / `rope_scaling` (a v4 reader without them silently takes theta 10000).

What an engine cannot serve is refused with the reason and the fix, before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from selfspec.heads.dflash import DFlashHead
from selfspec.heads.dflash_layouts import DFLASH_LAYOUTS
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle_layouts import EAGLE_LAYOUTS
from selfspec.heads.layouts import (
    BASE_PLACEHOLDER,
    ExportRefused,
    ExportRequest,
    HeadLayouts,
    Written,
    layouts_of,
    vllm_command,
    with_v4_rope,
)
from selfspec.heads.medusa import MedusaHeads
from selfspec.heads.medusa_layouts import MEDUSA_LAYOUTS

ENGINES = ("vllm", "sglang", "medusa", "eagle", "dflash", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the release whose from_pretrained the layout is proven with
SERVING_FILE = "SERVING.md"
WRITERS: dict[type, HeadLayouts] = {MedusaHeads: MEDUSA_LAYOUTS, EagleHead: EAGLE_LAYOUTS,
                                    DFlashHead: DFLASH_LAYOUTS}


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
    layouts = layouts_of(head, WRITERS)
    request = ExportRequest(to, base_model, target_layers_count, target_lm_head,
                            target_embedding)
    if layouts is not None and to == "speculators" and layouts.speculators is not None:
        config, state, files, command, notes = _speculators(head, request, layouts)
    elif layouts is not None:
        config, state, files, command, notes = layouts.write(head, request)
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
    layouts = layouts_of(head, WRITERS)
    kind = layouts.name(head) if layouts is not None else type(head).__name__
    lines = [f"# Serving this {kind} head with {to}", "", "```bash", exported.command, "```", ""]
    lines += [f"- {note}" for note in exported.notes]
    return "\n".join(lines) + "\n"


# ---- speculators ----------------------------------------------------------------------------


def _speculators(head: nn.Module, request: ExportRequest, layouts: HeadLayouts) -> Written:
    """speculators' own saved layout (`Eagle3DraftModel` / `DFlashDraftModel`, which its
    `SpeculatorModel.from_pretrained` and vLLM load), the envelope around the head type's own
    part (`layouts.speculators`): the draft layers' config nested under
    `transformer_layer_config`, `layers.{i}.*` names, the fused layers as HF's
    `hidden_states[l]` (ours), and the target's embedding in the folder (without it speculators'
    from_pretrained leaves the embedding uninitialised)."""
    c = head.config
    embedding, base_model = request.target_embedding, request.base_model
    if embedding is None:
        raise ExportRefused("speculators reads the target's embedding from the head folder: "
                            "pass the target (--target MODEL_FOLDER)")
    if tuple(embedding.shape) != (c.vocab_size, c.hidden_size):
        raise ExportRefused(f"the target's embedding is {list(embedding.shape)}, the head "
                            f"expects {[c.vocab_size, c.hidden_size]}: pass the head's own target")
    state = dict(head.state_dict()) | {"embed_tokens.weight": embedding}
    layer = with_v4_rope(c.layer_config().to_hf(), c)
    verifier = {"name_or_path": base_model, "architectures": []}
    part = layouts.speculators(head, state, layer, request)
    config = {"speculators_model_type": part.kind,
              "speculators_version": SPECULATORS_VERSION} | part.config
    config["speculators_config"] = {
        "algorithm": part.kind, "default_proposal_method": "greedy", "verifier": verifier,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": part.steps}]}
    notes = [f"fused target layers {list(c.target_layers)} (HF hidden_states[l], the input of "
             f"layer l, as speculators and vLLM number them)",
             "the folder holds the target's embedding (speculators' from_pretrained reads it "
             "there)", *part.notes]
    if base_model is None:
        notes.append("no verifier named (speculators_config.verifier.name_or_path is null): "
                     "speculators 0.9.0's EAGLE-3 from_pretrained looks its verifier up and "
                     "fails without one; export with --base-model or --target")
    command = ("python -c \"from speculators import SpeculatorModel; "
               "SpeculatorModel.from_pretrained('{OUT}')\"  # or: "
               + vllm_command(base_model or BASE_PLACEHOLDER,
                              {"model": "{OUT}", "num_speculative_tokens": part.steps}))
    return config, part.state, "model.safetensors", command, notes


# ---- writing ---------------------------------------------------------------------------------


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
