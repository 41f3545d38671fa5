"""Checkpoint I/O shared by every head type: weights in safetensors, metadata in JSON.

A head folder holds `model.safetensors` (the head's own parameters, nothing of the target) and
`head_config.json`: {"head_type": class name, "config": the config dataclass's fields,
"target": what the head was trained on (hidden_size, vocab_size, num_layers, source, ...)}.
`load_head` refuses a head trained for another target, since its features would not match:
other sizes, another layer count, or target layers (a config's `target_layers`, e.g. EAGLE-3's
fused streams) the target does not have. Head classes are built as `cls(config)`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.heads.base import head_types
from selfspec.heads.layouts import adopt
from selfspec.heads.published import LAYOUTS, describe, is_published, read_published
from selfspec.model import ModelConfig, Transformer, dense_weight
from selfspec.model.converted import described_source

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "head_config.json"
_TARGET_KEYS = ("hidden_size", "vocab_size", "num_layers")  # recorded; must match the target
_CONFIG_KEYS = ("hidden_size", "vocab_size")  # head config fields that must match too

HeadT = TypeVar("HeadT", bound=nn.Module)
log = logging.getLogger(__name__)


def describe_target(target: Transformer) -> dict[str, Any]:
    """The target facts a head checkpoint records (and `load_head` checks)."""
    config = target.config
    return {
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_layers": config.num_layers,
        "model_type": config.model_type,
        "source": described_source(target.source),  # a conversion's package, not its cache
    }


def save_head(
    folder: str | Path, module: nn.Module, config: Any, target_info: dict[str, Any]
) -> Path:
    """Write `module`'s parameters and buffers and its config to `folder`; returns the folder.

    config: the dataclass the module was built from; target_info: e.g. `describe_target(t)`.
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ValueError(
            f"save_head: config must be a dataclass instance (e.g. MedusaConfig(...)), "
            f"got {type(config).__name__}"
        )
    meta = {
        "head_type": type(module).__name__,
        "config": dataclasses.asdict(config),
        "target": dict(target_info),
    }
    try:
        text = json.dumps(meta, indent=2, sort_keys=True)  # before writing anything
    except TypeError as error:
        raise ValueError(
            f"save_head: target_info must hold JSON values (numbers, strings, lists): {error}"
        ) from error
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in module.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"head_type": meta["head_type"]})
    (folder / CONFIG_FILE).write_text(text + "\n")
    return folder


def load_head(
    folder: str | Path, cls: type[HeadT] | None = None, config_cls: type | None = None, *,
    target: Transformer, allow_other_base: bool = False,
) -> HeadT:
    """Load a head on the target's device and dtype: one saved by `save_head`, or one in a
    published layout (Medusa's reference or vLLM folders, EAGLE-1, EAGLE-3:
    `selfspec.heads.published`), whose layout is logged and kept in `module.loaded_from`.

    cls, config_cls: the head class expected (None: whatever the folder holds). Refuses
    (ValueError) a head of another class, or one trained for a target with another hidden
    size, vocab size or layer count, or (allow_other_base=False) whose recorded base model
    name is not the target's; a missing folder or file is a FileNotFoundError.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"head checkpoint folder not found: {folder}; pass the folder save_head wrote"
        )
    if not (folder / CONFIG_FILE).is_file() and is_published(folder):
        return _load_published(folder, cls, target, allow_other_base)
    meta = _read_meta(folder)
    cls, config_cls = _head_class(meta.get("head_type"), cls, config_cls, folder)
    config = _build_config(config_cls, meta.get("config", {}), folder)
    _check_target(folder, meta.get("target", {}), config, target)
    weight = target.embed_tokens.weight
    state = load_file(str(folder / WEIGHTS_FILE), device=str(weight.device))
    module = adopt(cls, config, state, cls.__name__)
    module.loaded_from = f"{folder}: a selfspec {cls.__name__} checkpoint"
    return module.to(device=weight.device, dtype=weight.dtype)


def read_head(folder: str | Path, target: ModelConfig | None = None
              ) -> tuple[nn.Module, dict[str, Any]]:
    """A head as stored (CPU, its own dtype), with no target model loaded (for exporting it),
    and what the folder records: {"layout", "base_model", "target" (selfspec checkpoints)}.

    target: the target's architecture (`ModelConfig.from_folder`), which a published head that
    relies on its target needs (Medusa heads without an LM head, EAGLE-3 without fused layer
    ids); without it those raise `TargetNeeded`.
    """
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() and folder.is_dir() and is_published(folder):
        found = read_published(folder, target)
        return found.module, {"layout": found.layout, "base_model": found.base_model}
    meta = _read_meta(folder)
    cls, config_cls = _head_class(meta.get("head_type"), None, None, folder)
    config = _build_config(config_cls, meta.get("config", {}), folder)
    module = adopt(cls, config, load_file(str(folder / WEIGHTS_FILE)), cls.__name__)
    recorded = meta.get("target", {})
    return module, {"layout": "selfspec", "base_model": recorded.get("source"),
                    "target": recorded}


def recorded_target(folder: str | Path) -> Path | None:
    """The target model folder a head folder records, when it exists on this machine: a
    selfspec checkpoint's target source, or a published head's `base_model_name_or_path`."""
    folder = Path(folder)
    for name, key in ((CONFIG_FILE, ("target", "source")),
                      ("config.json", ("base_model_name_or_path",))):
        if (folder / name).is_file():
            value: Any = json.loads((folder / name).read_text())
            for part in key:
                value = value.get(part) if isinstance(value, dict) else None
            if value and Path(value).is_dir():
                return Path(value)
            return None
    return None


def _load_published(folder: Path, cls: type | None, target: Transformer,
                    allow_other_base: bool) -> nn.Module:
    found = read_published(folder, target.config, dense_weight(target.lm_head))
    if cls is not None and not isinstance(found.module, cls):
        raise ValueError(f"load_head: {folder} holds a {LAYOUTS[found.layout]} head, not "
                         f"{cls.__name__}; load it where a {type(found.module).__name__} goes")
    sizes = {key: getattr(found.config, key) for key in _CONFIG_KEYS}
    _check_target(folder, sizes, found.config, target)
    if not allow_other_base:
        _check_base_name(folder, found.base_model, target)
    _check_target_copies(folder, found.target_copies, target)
    log.info(describe(found, folder))
    weight = target.embed_tokens.weight
    module = found.module.to(device=weight.device, dtype=weight.dtype)
    module.loaded_from = describe(found, folder)
    return module


def _check_target_copies(folder: Path, copies: dict[str, torch.Tensor],
                         target: Transformer) -> None:
    """A head folder's copies of the target's embedding or LM head (speculators' heads embed,
    and a full-vocabulary DFlash head scores, with the ones their folder holds) must be this
    target's: selfspec's heads use the target's own, so others would change the outputs
    unseen. Compared at the folder's precision (bf16: about 1e-2)."""
    for name, theirs in copies.items():
        module = target.embed_tokens if name == "embed_tokens" else target.lm_head
        ours = dense_weight(module).detach()
        theirs = theirs.to(ours.device)
        if tuple(theirs.shape) != tuple(ours.shape) or not torch.allclose(
                theirs.float(), ours.to(theirs.dtype).float(), rtol=1e-2,
                atol=1e-2 * float(ours.abs().max())):
            raise ValueError(f"load_head: {folder} holds its own {name}, not this "
                             f"target's, and uses it where selfspec's heads use the target's: "
                             f"load it with the target it was trained for")


def _head_class(head_type: str | None, cls: type | None, config_cls: type | None,
                folder: Path) -> tuple[type, type]:
    """The head class and its config class: the caller's, which must be the checkpoint's."""
    known = head_types()
    if cls is not None and head_type != cls.__name__:
        raise ValueError(
            f"load_head: {folder} holds a {head_type!r} head, not {cls.__name__!r}; "
            f"load it with its own class or pick a {cls.__name__} checkpoint"
        )
    if head_type not in known:
        raise ValueError(f"load_head: {folder / CONFIG_FILE} names head_type {head_type!r}; "
                         f"selfspec has {', '.join(sorted(known))}")
    head = known[head_type]
    return cls or head, config_cls or head.config_class


def _check_base_name(folder: Path, base_model: str | None, target: Transformer) -> None:
    """Refuse a head whose recorded base model is not the target (names compared by their
    last path component, lower case, one a prefix of the other: `vicuna-7b-v1.3` matches a
    local folder `vicuna-7b-v1.3`)."""
    if not base_model or not target.source:
        return
    ours, theirs = _model_name(target.source), _model_name(base_model)
    if not (ours.startswith(theirs) or theirs.startswith(ours)):
        raise ValueError(
            f"load_head: {folder} was trained for {base_model!r}, and the target is "
            f"{target.source!r}: load the head of this target, or, if both name the same model, "
            f"pass allow_other_base=True")


def _model_name(name: str) -> str:
    return Path(str(name).rstrip("/")).name.lower()


def _read_meta(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"head checkpoint folder not found: {folder}; pass the folder save_head wrote"
        )
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"head checkpoint {folder} has no {name}; it must hold {CONFIG_FILE} and "
                f"{WEIGHTS_FILE} as written by selfspec.heads.save_head"
            )
    return json.loads((folder / CONFIG_FILE).read_text())


def _build_config(config_cls: type, fields: dict[str, Any], folder: Path) -> Any:
    """The config dataclass from its JSON fields (JSON turns tuples into lists: undo that)."""
    declared = {f.name: str(f.type) for f in dataclasses.fields(config_cls)}
    values = {
        name: tuple(v) if isinstance(v, list) and "tuple" in declared.get(name, "") else v
        for name, v in fields.items()
    }
    try:
        return config_cls(**values)
    except TypeError as error:
        raise ValueError(
            f"load_head: the config in {folder / CONFIG_FILE} does not fit "
            f"{config_cls.__name__}: {error}"
        ) from error


def check_sizes(who: str, subject: str, config: Any, target: Transformer, fix: str) -> None:
    """Refuse, before generating, a head whose hidden_size or vocab_size is not the target's;
    subject: e.g. "the heads have", fix: what to do instead."""
    for key in _CONFIG_KEYS:
        ours, theirs = getattr(config, key), getattr(target.config, key)
        if ours != theirs:
            raise ValueError(f"{who}: {subject} {key} {ours}, the target {theirs}: {fix}")


def check_fused_target(who: str, config: Any, target: Transformer) -> None:
    """Refuse a head that fuses target states (EAGLE-3, DFlash) trained for another target:
    its sizes, the width of the states it fuses, or fused layers the target does not have."""
    check_sizes(who, "the head has", config, target, "load a head trained for this target")
    theirs = target.config
    if (config.target_hidden_size or theirs.hidden_size) != theirs.hidden_size:
        raise ValueError(f"{who}: the head fuses target states of width "
                         f"{config.target_hidden_size}, the target's are {theirs.hidden_size}")
    missing = [i for i in config.target_layers if not 0 <= i <= theirs.num_layers]
    if missing:
        raise ValueError(f"{who}: the head fuses target layers {list(config.target_layers)}, "
                         f"but the target has {theirs.num_layers} layers (no {missing}): load "
                         f"a head trained for this target")


def _check_target(
    folder: Path, trained_for: dict[str, Any], config: Any, target: Transformer
) -> None:
    """Refuse a head whose recorded target, or whose config's sizes, disagree with this target."""
    mismatches = []
    for key in _TARGET_KEYS:
        ours = getattr(target.config, key)
        # A head config's num_layers counts the head's own layers, not the target's.
        in_config = getattr(config, key, None) if key in _CONFIG_KEYS else None
        recorded = {"checkpoint target": trained_for.get(key), "head config": in_config}
        for where, value in recorded.items():
            if value is not None and value != ours:
                mismatches.append(f"{key} {value} ({where}) vs {ours} (this target)")
    mismatches += _missing_target_layers(config, target)
    if mismatches:
        source = trained_for.get("source") or "an unrecorded model"
        raise ValueError(
            f"load_head: {folder} was trained for another target ({source}): "
            f"{'; '.join(dict.fromkeys(mismatches))}. Load the head trained for this target "
            f"({target.source or 'this model'}), or train one for it (e.g. train/medusa.py)"
        )


def _missing_target_layers(config: Any, target: Transformer) -> list[str]:
    """The residual streams a head reads (`config.target_layers`, hidden l = after l layers)
    that this target does not have, as mismatch lines."""
    layers = tuple(getattr(config, "target_layers", ()) or ())
    num_layers = target.config.num_layers
    missing = [i for i in layers if not 0 <= i <= num_layers]
    if not missing:
        return []
    return [f"target_layers {list(layers)} (head config) need layers {missing}, which a "
            f"{num_layers}-layer target does not have"]
