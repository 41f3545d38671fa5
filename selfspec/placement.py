"""A target spread over several devices by layers (`model.device_map`), for targets larger
than one GPU.

A placement puts every decoder layer on a device, and the embedding, the final norm and the
LM head together on one *home* device: the run's `device`, where drafters, draft models,
heads and the verifier run too. A forward moves the hidden state across a device boundary
once per boundary, and back home for the LM head; each layer's K/V cache lives beside its
layer (`selfspec.kv_cache.SegmentedKVCache`). Keeping the LM head beside the embedding keeps
a tied LM head one tensor.

Plans come from accelerate's planner (`infer_auto_device_map`, `get_balanced_memory`) over the
model built on the meta device, so a plan for a 70B model needs neither weights nor GPUs:
- `auto` and `balanced`: layers spread evenly over the devices of `max_memory` (what
  transformers' `device_map="auto"` does);
- `sequential`: each device filled in turn;
- a mapping of layer ranges to devices, e.g. `{0-39: 0, 40-79: 1}`.
Devices are written as accelerate writes them: an integer is a CUDA GPU, else cpu, cuda:N, mps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from selfspec.model import ModelConfig, Transformer

PLANNERS = ("auto", "balanced", "sequential")
GIB = 1024**3


@dataclass(frozen=True)
class Placement:
    """home: the embedding, final norm and LM head (and every drafter); layers: each layer's
    device, in order."""

    home: torch.device
    layers: tuple[torch.device, ...]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Every device used, home first, then in layer order."""
        return tuple(dict.fromkeys((self.home, *self.layers)))

    @property
    def spans_devices(self) -> bool:
        return len(self.devices) > 1

    def device_of(self, name: str) -> torch.device:
        """The device of one of the model's parameters (its state-dict name)."""
        parts = name.split(".")
        return self.layers[int(parts[1])] if parts[0] == "layers" else self.home

    def segments(self) -> list[tuple[int, int, torch.device]]:
        """Runs of consecutive layers on one device: (first, end, device)."""
        runs: list[tuple[int, int, torch.device]] = []
        for i, device in enumerate(self.layers):
            if runs and runs[-1][2] == device:
                runs[-1] = (runs[-1][0], i + 1, device)
            else:
                runs.append((i, i + 1, device))
        return runs

    def format(self, config: ModelConfig, bytes_per_param: int, kv_bytes: int = 2) -> str:
        """The placement and the memory it puts on each device: weights, and K/V per 1k
        tokens (kv_bytes a value)."""
        layer_bytes = _layer_params(config) * bytes_per_param
        home_bytes = _home_params(config) * bytes_per_param
        kv_per_layer = 2 * config.num_kv_heads * config.head_dim * 1024 * kv_bytes
        lines = [f"  placement over {len(self.devices)} device(s); embedding, final norm and "
                 f"LM head on {self.home}"]
        for device in self.devices:
            layers = [i for i, d in enumerate(self.layers) if d == device]
            weights = len(layers) * layer_bytes + (home_bytes if device == self.home else 0)
            span = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                             for a, b, d in self.segments() if d == device) or "none"
            lines.append(f"    {str(device):<8} layers {span:<12} {len(layers):>3} layers  "
                         f"weights {weights / GIB:8.2f} GiB  KV / 1k tokens "
                         f"{len(layers) * kv_per_layer / GIB:6.3f} GiB")
        return "\n".join(lines)


def plan_placement(config: ModelConfig, device_map, max_memory=None,
                   dtype: torch.dtype = torch.float32, home="cpu") -> Placement | None:
    """The placement `device_map` asks for, with the embedding, norm and LM head on `home`
    (None: the model stays on one device, unplaced). The planners count the home parts on the
    first device of max_memory; give `home` that device."""
    if device_map is None:
        return None
    memory = _checked_max_memory(max_memory)
    if isinstance(device_map, Mapping):
        layers = _explicit(config, device_map)
    elif device_map in PLANNERS:
        layers = _planned(config, device_map, memory, dtype)
    else:
        raise ValueError(f"model.device_map: choose null, {', '.join(PLANNERS)} or a mapping of "
                         f"layer ranges to devices (e.g. {{0-15: 0, 16-31: 1}}), "
                         f"got {device_map!r}")
    placement = Placement(parse_device(home), layers)
    _check_fits(placement, config, memory, dtype)
    return placement


def check_present(placement: Placement) -> None:
    """Refuse a placement naming a device this machine lacks (one line, before any load)."""
    for device in placement.devices:
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (device.index or 0) >= count:
                raise ValueError(f"model.device_map places the model on {device}, but this "
                                 f"machine has {count} CUDA device(s); name devices that exist "
                                 f"(cpu{', cuda:0' if count else ''}) or plan it with "
                                 f"dry_run=true")
        elif device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("model.device_map places the model on mps, which this machine "
                             "lacks; name devices that exist (cpu)")


def place(model: Transformer, placement: Placement | None) -> Transformer:
    """Move model's parts onto their devices (in place); None leaves it as it is."""
    if placement is None:
        return model
    if len(placement.layers) != model.config.num_layers:
        raise ValueError(f"a placement of {len(placement.layers)} layers for a model of "
                         f"{model.config.num_layers}")
    for name in ("embed_tokens", "norm", "lm_head"):
        getattr(model, name).to(placement.home)
    for layer, device in zip(model.layers, placement.layers, strict=True):
        layer.to(device)
    model.placement = placement
    return model


def parse_device(value) -> torch.device:
    """A device as accelerate and our configs write it: an integer is a CUDA GPU; "cuda" is
    cuda:0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    try:
        device = torch.device(str(value))
    except RuntimeError:
        raise ValueError(f"model.device_map: {value!r} is not a device; use an integer (a CUDA "
                         f"GPU), cpu, cuda:N or mps") from None
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


# ---- planning ------------------------------------------------------------------------------


class _Home(nn.Module):
    """The embedding, final norm and LM head as one unit the planner keeps whole."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = model.embed_tokens, model.norm, model.lm_head


class _PlanView(nn.Module):
    """The model as the planner sees it: the home unit first, then the layers."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.home, self.layers = _Home(model), model.layers


def _planned(config: ModelConfig, how: str, memory: dict | None,
             dtype: torch.dtype) -> tuple[torch.device, ...]:
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    with torch.device("meta"):
        view = _PlanView(Transformer(config))
    whole = ["_Home", "DecoderLayer"]
    # accelerate warns about every device of max_memory absent here: a plan for another machine.
    logger = logging.getLogger("accelerate.utils.modeling")
    level, logger.level = logger.level, logging.ERROR
    try:
        if how != "sequential":
            memory = get_balanced_memory(view, max_memory=memory, no_split_module_classes=whole,
                                         dtype=dtype)
        plan = infer_auto_device_map(view, max_memory=memory, no_split_module_classes=whole,
                                     dtype=dtype)
    finally:
        logger.level = level
    devices = [plan.get(name, "disk") for name in
               ("home", *(f"layers.{i}" for i in range(config.num_layers)))]
    if "disk" in devices:
        placed = devices.index("disk")
        total = sum(_bytes(v) for v in (memory or {}).values())
        raise ValueError(
            f"model.max_memory ({total / GIB:.0f} GiB in all) is too small for this model's "
            f"weights ({_model_bytes(config, dtype) / GIB:.1f} GiB in {_dtype_name(dtype)}): "
            f"{'the home parts' if placed == 0 else f'layers {placed - 1}-'} fit nowhere; "
            f"raise model.max_memory or add devices")
    return tuple(parse_device(d) for d in devices[1:])


def _explicit(config: ModelConfig, mapping: Mapping) -> tuple[torch.device, ...]:
    """{"a-b" or a: device}: every layer named exactly once."""
    n, layers = config.num_layers, [None] * config.num_layers
    for key, value in mapping.items():
        device = parse_device(value)
        first, last = _layer_range(str(key), n)
        for i in range(first, last + 1):
            if layers[i] is not None:
                raise ValueError(f"model.device_map: layer {i} is placed twice")
            layers[i] = device
    missing = [i for i, d in enumerate(layers) if d is None]
    if missing:
        raise ValueError(f"model.device_map: layers {_ranges(missing)} of {n} have no device; "
                         f"give every layer one (e.g. {{0-{n - 1}: 0}})")
    return tuple(layers)


def _layer_range(key: str, n: int) -> tuple[int, int]:
    try:
        first, _, last = key.partition("-")
        bounds = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"model.device_map: {key!r} is not a layer range; write a-b or a "
                         f"single layer") from None
    if not 0 <= bounds[0] <= bounds[1] < n:
        raise ValueError(f"model.device_map: layers {key} lie outside the model's 0-{n - 1}")
    return bounds


def _check_fits(placement: Placement, config: ModelConfig, memory: dict | None,
                dtype: torch.dtype) -> None:
    """An explicit map against max_memory, where it is given: each device's weights fit."""
    if not memory:
        return
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    limits = {parse_device(k): _bytes(v) for k, v in memory.items()}
    for device in placement.devices:
        weights = (sum(d == device for d in placement.layers) * _layer_params(config)
                   + (_home_params(config) if device == placement.home else 0)) * size
        if device in limits and weights > limits[device]:
            raise ValueError(f"model.max_memory: {device} holds {weights / GIB:.1f} GiB of "
                             f"weights under model.device_map but is given "
                             f"{limits[device] / GIB:.1f} GiB; move layers or raise it")


def _checked_max_memory(max_memory) -> dict | None:
    if max_memory is None:
        return None
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(f"model.max_memory: give a mapping of devices to sizes, e.g. "
                         f"{{0: 80GiB, 1: 80GiB}}, got {max_memory!r}")
    for size in max_memory.values():
        _bytes(size)  # checked
    return {_accelerate_key(key): size for key, size in max_memory.items()}


def _accelerate_key(key) -> int | str:
    """A device as accelerate's max_memory names it: a CUDA GPU by its index."""
    device = parse_device(key)
    return device.index or 0 if device.type == "cuda" else device.type


def _bytes(size) -> int:
    from accelerate.utils import convert_file_size_to_int

    try:
        return convert_file_size_to_int(size)
    except (ValueError, TypeError):
        raise ValueError(f"model.max_memory: {size!r} is not a size; write e.g. 80GiB or "
                         f"40GB") from None


def _layer_params(config: ModelConfig) -> int:
    with torch.device("meta"):
        layer = Transformer(_one_layer(config)).layers[0]
    return sum(p.numel() for p in layer.parameters())


def _home_params(config: ModelConfig) -> int:
    with torch.device("meta"):
        home = _Home(Transformer(_one_layer(config)))
    return sum(p.numel() for p in home.parameters())


def _one_layer(config: ModelConfig) -> ModelConfig:
    return replace(config, num_layers=1)


def _model_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    return (config.num_layers * _layer_params(config) + _home_params(config)) * size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
