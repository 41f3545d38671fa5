"""The architecture of a Llama-family model (Llama 1/2/3.x, Mistral, Qwen2/2.5), read from a
Hugging Face config.json. What differs between the families is all here: grouped-query
attention (num_kv_heads < num_heads), q/k/v bias (Qwen2), tied embeddings, RoPE scaling
(linear, llama3)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters (names follow ours; `from_hf` maps HF's config.json).

    rope_scaling: None, {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", ...}.
    attention_bias: bias on q/k/v (Qwen2; Llama when its config says so).
    attention_out_bias: bias on o_proj (Llama's attention_bias covers it; Qwen2 has none).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """The architecture in a model folder's config.json; errors name the file."""
        config_file = Path(folder) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            return cls.from_hf(json.loads(config_file.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON ({exc}): copy the model's "
                             f"config.json again") from None
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (old `rope_scaling` or v5 `rope_parameters`)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; only 'silu'")
        missing = [key for key in REQUIRED_HF_KEYS if key not in config]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: every Llama-family "
                             f"config.json has {', '.join(REQUIRED_HF_KEYS)}")
        num_heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(config)
        llama_bias = bool(config.get("attention_bias", False))
        eos = config.get("eos_token_id")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else llama_bias,
            attention_out_bias=False if model_type == "qwen2" else llama_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            model_type=model_type,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else _opt_tuple(eos),
        )


    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict of this architecture (`from_hf` reads it back)."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        eos = list(self.eos_token_ids)
        return {
            "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope_parameters": rope, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "hidden_act": "silu",
        }


def _opt_tuple(value: int | None) -> tuple[int, ...]:
    return () if value is None else (value,)


def _read_rope(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either HF convention."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return theta, None
    required = ("factor",) if kind == "linear" else _LLAMA3_ROPE_KEYS
    missing = [key for key in required if key not in params]
    if missing:
        raise ValueError(f"RoPE scaling {kind!r} needs {missing} in the config")
    return theta, {"rope_type": kind, **{key: params[key] for key in required}}
