"""What every published head layout shares, below the per-method layouts
(`heads/medusa_layouts.py`, `heads/eagle_layouts.py`, `heads/dflash_layouts.py`) and the two
dispatchers above them (`heads/published.py` reads a folder, `heads/export.py` writes one):
the refusals, the read head's record, the request an export answers, weight and JSON reading,
adopting a state into a head class, RoPE's two config conventions and vLLM's launch line.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from selfspec.model import ModelConfig, aligned

BASE_PLACEHOLDER = "<base-model>"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# What a layout writer returns: config.json's dict, the tensors, the weights file's name, the
# launch command ("{OUT}" for the folder) and the notes of SERVING.md.
Written = tuple[dict, dict[str, torch.Tensor], str, str, list[str]]


class ExportRefused(ValueError):
    """The engine cannot serve this head as it is; the message says why and what to do."""


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

    layout: str  # a key of selfspec.heads.published.LAYOUTS
    module: nn.Module
    config: Any  # MedusaConfig | EagleConfig | DFlashConfig
    base_model: str | None  # the recorded base model name, when the folder has one
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)
    # Copies of the target's weights the folder holds ("embed_tokens", "lm_head"), which the
    # head uses in place of the target's (speculators'): checked against the target on loading
    target_copies: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class HeadFolder:
    """A folder being read as a published head: its config.json ({} without one), what of the
    target the caller passed, and its weights, read once when a layout's reader asks."""

    path: Path
    config: dict
    target: ModelConfig | None = None
    target_lm_head: torch.Tensor | None = None
    _state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def state(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            self._state = read_weights(self.path, WEIGHT_FILES)
        return self._state

    @property
    def target_num_layers(self) -> int | None:
        return self.target and self.target.num_layers


@dataclass(frozen=True)
class ExportRequest:
    """What an export is asked for, beyond the head: the engine (`to`) and what of the target
    the caller passed (see `selfspec.heads.export.export_head`)."""

    to: str
    base_model: str | None = None
    target_layers_count: int | None = None
    target_lm_head: torch.Tensor | None = None
    target_embedding: torch.Tensor | None = None

    @property
    def base(self) -> str:
        """The launch command's model: the one named, else a placeholder to fill in."""
        return self.base_model or BASE_PLACEHOLDER


@dataclass(frozen=True)
class SpeculatorsPart:
    """A head's own part of speculators' layout, inside the envelope that
    `selfspec.heads.export` writes around it: the model type, the tokens a greedy proposal
    drafts, config.json's keys of this head type, its tensors and its notes."""

    kind: str
    steps: int
    config: dict
    state: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HeadLayouts:
    """One head type's layouts, as the dispatchers look them up by the head's class: `write`
    the engines' folders, `name` the head in SERVING.md's title, `speculators` its part of
    speculators' layout (None: speculators has none for it)."""

    write: Callable[[Any, ExportRequest], Written]
    name: Callable[[Any], str]
    speculators: Callable[[Any, dict[str, torch.Tensor], dict, ExportRequest],
                          SpeculatorsPart] | None = None


def layouts_of(head: nn.Module, table: dict[type, HeadLayouts]) -> HeadLayouts | None:
    """The layouts of the nearest class of `head` that `table` holds (a subclass is written as
    its base)."""
    return next((table[cls] for cls in type(head).__mro__ if cls in table), None)


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


def read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    for name in names:
        path = folder / name
        if path.is_file():
            if path.suffix == ".safetensors":
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"load_head: {folder} has none of {', '.join(names)}")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_head: {path} is not valid JSON ({exc})") from None


def agreed_layers(folder: Path, lists: dict[str, list[int] | None]) -> tuple[int, ...] | None:
    """The fused layers, in our numbering, that a config's keys (name: its list, already
    renumbered) agree on; None when none is given, refused when two differ."""
    found = {tuple(ids) for ids in lists.values() if ids}
    if len(found) > 1:
        given = "; ".join(f"{name}: {ids}" for name, ids in lists.items() if ids)
        raise ValueError(f"load_head: {folder}/config.json gives two different fused layer lists "
                         f"(in our numbering, {given}): keep one")
    return found.pop() if found else None


def refuse_flags(folder: Path, config: dict, names: tuple[str, ...], why: str) -> None:
    on = [name for name in names if config.get(name)]
    if on:
        raise ValueError(f"load_head: {folder}: a speculators head with {', '.join(on)} true has "
                         f"no selfspec equivalent ({why})")


def with_v4_rope(layer: dict, c) -> dict:
    """A layer's config.json dict with RoPE in both conventions: v5's `rope_parameters` (from
    `to_hf`) and v4's top-level `rope_theta` and `rope_scaling`, which a transformers 4 reader
    needs (without them it takes theta 10000)."""
    return layer | {"rope_theta": c.rope_theta,
                    "rope_scaling": dict(c.rope_scaling or {}) or None}


def vllm_command(base: str, spec: dict) -> str:
    """vLLM's launch line serving `base` with the speculative config `spec`."""
    return (f"vllm serve {shlex.quote(base)} --speculative-config "
            f"'{json.dumps(spec)}'")
