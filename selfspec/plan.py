"""What a model needs before any weight is loaded: parameters, weight and KV-cache memory.

The model is built on the meta device, so the count is exactly what `Transformer` would
allocate (tied embeddings counted once) for a 70B model in milliseconds and no memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.model import ModelConfig, Transformer
from selfspec.placement import Placement

GIB = 1024**3
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
            lines.append(self.placement.format(c, BYTES_PER_PARAM[self.placement_dtype],
                                               BYTES_PER_PARAM[self.placement_dtype]))
        return "\n".join(lines)


def plan_model(config: ModelConfig, name: str = "model", num_gpus: int = 8,
               placement: Placement | None = None, placement_dtype: str = "bf16") -> ModelPlan:
    """The plan of `config` without weights (the model is built on the meta device)."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"plan_model: num_gpus must be an integer >= 1, got {num_gpus!r}")
    num_params = count_parameters(config)
    kv_values_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim  # K and V
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
