"""What a model needs before any weight is loaded: parameters, weight and KV-cache memory.

The model is built on the meta device, so the count is exactly what `Transformer` would
allocate (tied embeddings counted once) for a 70B model in milliseconds and no memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.checks import check_count
from selfspec.model.config import ModelConfig
from selfspec.model.placement import Placement, parse_device
from selfspec.model.transformer import DecoderLayer, Transformer, mtp_modules

GIB = 1024**3
PLANNERS = ("auto", "balanced", "sequential")  # model.device_map's planners
BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
KV_TOKENS = 1024  # the KV figures are per 1k tokens of context (batch of one)


@dataclass(frozen=True)
class ModelPlan:
    """Memory facts of one model; all sizes in bytes.

    weight_bytes: the full weights per storage dtype (fp32, bf16, fp16, int8).
    kv_bytes_per_1k: K and V of every layer for 1024 tokens, per cache dtype (bf16, fp32).
    zero3_bytes_per_gpu: bf16 weights partitioned num_gpus ways (ZeRO-3), activations,
        KV cache and gathered layers excluded.
    placement: where model.device_map puts the layers for decoding (None: one device), its
        memory counted in placement_dtype.
    """

    name: str
    config: ModelConfig
    num_params: int
    weight_bytes: dict[str, int]
    kv_bytes_per_1k: dict[str, int]
    num_gpus: int
    zero3_bytes_per_gpu: int
    placement: Placement | None = None
    placement_dtype: str = "bf16"

    def format(self) -> str:
        """A readable table (GiB = 2**30 bytes)."""
        c = self.config
        rows = [(f"parameters ({self.num_params:,})", f"{self.num_params / 1e9:.2f} B")]
        rows += [(f"weights {dtype}", _gib(n)) for dtype, n in self.weight_bytes.items()]
        kv = self.kv_bytes_per_1k.items()
        rows += [(f"KV cache / 1k tokens {dtype}", _gib(n)) for dtype, n in kv]
        zero3 = f"ZeRO-3 bf16 weights / GPU ({self.num_gpus} GPUs)"
        rows.append((zero3, _gib(self.zero3_bytes_per_gpu)))
        width = max(len(label) for label, _ in rows)
        head = (
            f"plan for {self.name}: {c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_heads} heads / {c.num_kv_heads} KV heads, vocab {c.vocab_size}"
        )
        lines = [head, *(f"  {label:<{width}}  {value:>12}" for label, value in rows)]
        if self.placement is not None:
            lines.append(placement_lines(self.placement, c, BYTES_PER_PARAM[self.placement_dtype],
                                          BYTES_PER_PARAM[self.placement_dtype]))
        return "\n".join(lines)


def plan_model(config: ModelConfig, name: str = "model", num_gpus: int = 8,
               placement: Placement | None = None, placement_dtype: str = "bf16") -> ModelPlan:
    """The plan of `config` without weights (the model is built on the meta device)."""
    check_count("num_gpus", num_gpus, owner="plan_model")
    num_params = count_parameters(config)
    attention_layers = config.num_layers - len(config.linear_layers)  # a hybrid's keep K/V
    heads, key_dim, value_dim = config.cache_dims  # MLA: one roped key and one latent
    kv_values_per_token = attention_layers * heads * (key_dim + value_dim)
    bf16_weights = num_params * BYTES_PER_PARAM["bf16"]
    return ModelPlan(
        name=name,
        config=config,
        num_params=num_params,
        weight_bytes={dtype: num_params * n for dtype, n in BYTES_PER_PARAM.items()},
        kv_bytes_per_1k={
            dtype: kv_values_per_token * KV_TOKENS * BYTES_PER_PARAM[dtype]
            for dtype in ("bf16", "fp32")
        },
        num_gpus=num_gpus,
        zero3_bytes_per_gpu=-(-bf16_weights // num_gpus),  # ceil: ZeRO pads the last shard
        placement=placement,
        placement_dtype=placement_dtype,
    )


def count_parameters(config: ModelConfig) -> int:
    """Parameters of `Transformer(config)`, shared tensors (tied embeddings) counted once."""
    with torch.device("meta"):
        model = Transformer(config)
    return sum(p.numel() for p in model.parameters())


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def head_training_lines(head: torch.nn.Module, num_gpus: int) -> str:
    """What training a head adds: see `trainable_line`."""
    num_params = sum(p.numel() for p in head.parameters())
    return trainable_line(f"trainable head ({type(head).__name__})", num_params, num_gpus)


def trainable_line(what: str, num_params: int, num_gpus: int) -> str:
    """Trainable parameters and their fp32 weights + gradients + AdamW moments (16 bytes per
    parameter), whole and partitioned num_gpus ways (ZeRO-3)."""
    state = 16 * num_params
    return (f"  {what}: {num_params:,} parameters; "
            f"fp32 weights+grads+AdamW {_gib(state).strip()} ({_gib(state // num_gpus).strip()} "
            f"per GPU under ZeRO-3 on {num_gpus})")


# ---- placement over devices (model.device_map) ----------------------------------------


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
    for name in ("embed_tokens", "norm", "lm_head", "mtp"):  # MTP modules: a drafter's
        getattr(model, name).to(placement.home)
    for layer, device in zip(model.layers, placement.layers, strict=True):
        layer.to(device)
    model.placement = placement
    return model


def placement_lines(placement: Placement, config: ModelConfig, bytes_per_param: int,
                kv_bytes: int = 2) -> str:
    """The placement and the memory it puts on each device: weights, and K/V per 1k
    tokens (kv_bytes a value)."""
    layer_params = _layer_params(config)
    home_bytes = _home_params(config) * bytes_per_param
    heads, key_dim, value_dim = config.cache_dims
    kv_per_layer = heads * (key_dim + value_dim) * 1024 * kv_bytes
    lines = [f"  placement over {len(placement.devices)} device(s); embedding, final norm and "
             f"LM head on {placement.home}"]
    for device in placement.devices:
        layers = [i for i, d in enumerate(placement.layers) if d == device]
        weights = (sum(layer_params[i] for i in layers) * bytes_per_param
                   + (home_bytes if device == placement.home else 0))
        span = ", ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                         for a, b, d in placement.segments() if d == device) or "none"
        lines.append(f"    {str(device):<8} layers {span:<12} {len(layers):>3} layers  "
                     f"weights {weights / GIB:8.2f} GiB  KV / 1k tokens "
                     f"{len(layers) * kv_per_layer / GIB:6.3f} GiB")
    return "\n".join(lines)




class _Home(nn.Module):
    """The embedding, final norm, LM head and MTP modules (a drafter's, run beside the LM
    head) as one unit the planner keeps whole."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = model.embed_tokens, model.norm, model.lm_head
        self.mtp = model.mtp


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
        weights = (sum(n for n, d in zip(_layer_params(config), placement.layers, strict=True)
                       if d == device)
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


def _layer_params(config: ModelConfig) -> list[int]:
    """Each layer's parameters (a mixture of experts' layers hold theirs, and may sit among
    dense ones; a hybrid's linear-attention layers differ from its attention layers)."""
    with torch.device("meta"):
        sizes = {kind: sum(p.numel() for p in DecoderLayer(config, i).parameters())
                 for kind, i in _layer_kinds(config).items()}
    return [sizes[_kind(config, i)] for i in range(config.num_layers)]


def _layer_kinds(config: ModelConfig) -> dict[tuple[bool, bool], int]:
    """One layer of each kind: {(is sparse, is linear attention): its index}."""
    return {_kind(config, i): i for i in reversed(range(config.num_layers))}


def _kind(config: ModelConfig, layer: int) -> tuple[bool, bool]:
    return layer in config.moe_layers, layer in config.linear_layers


def _home_params(config: ModelConfig) -> int:
    with torch.device("meta"):
        home = _Home(Transformer(_one_layer(config)))
        mtp = mtp_modules(config)  # the cut model has none: they read the last layer's output
    return sum(p.numel() for p in home.parameters()) + sum(p.numel() for p in mtp.parameters())


def _one_layer(config: ModelConfig) -> ModelConfig:
    return config.cut(1)


def _model_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    return (sum(_layer_params(config)) + _home_params(config)) * size


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
