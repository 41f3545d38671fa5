"""Hugging Face checkpoint I/O of our models: parameter names both ways, the safetensors files
of a model folder (single or sharded), read one tensor at a time, and a folder written back
that transformers loads. Phi-3's checkpoints fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`): they are split on reading and fused again on writing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from selfspec.model.config import ARCHITECTURES, ModelConfig

FUSED_FAMILIES = ("phi3",)  # checkpoints with fused qkv_proj and gate_up_proj


def hf_key(name: str) -> str:
    """The Hugging Face name of one of our parameters."""
    return name if name == "lm_head.weight" else f"model.{name}"


def our_key(name: str, tied: bool) -> str | None:
    """Our parameter name for a HF one, or None for tensors we do not keep."""
    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
        return None  # recomputed / shared with embed_tokens
    return name.removeprefix("model.")


def our_tensors(name: str, tensor: torch.Tensor, config: ModelConfig
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs for one HF tensor: none for what we do not keep, the q/k/v
    or gate/up rows of a fused projection (views, no copy), else the tensor as it is."""
    key = our_key(name, config.tie_word_embeddings)
    if key is None:
        return
    for fused, parts in _fused_parts(config).items():
        if key.endswith(fused):
            rows = tensor.split(list(parts.values()), dim=0)
            for part, piece in zip(parts, rows, strict=True):
                yield key.removesuffix(fused) + part, piece
            return
    yield key, tensor


def _fused_parts(config: ModelConfig) -> dict[str, dict[str, int]]:
    """A fused family's fused HF names (a suffix) and the rows each of ours takes, in order."""
    if config.model_type not in FUSED_FAMILIES:
        return {}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inner = config.intermediate_size
    return {"self_attn.qkv_proj.weight": {"self_attn.q_proj.weight": q,
                                          "self_attn.k_proj.weight": kv,
                                          "self_attn.v_proj.weight": kv},
            "mlp.gate_up_proj.weight": {"mlp.gate_proj.weight": inner,
                                        "mlp.up_proj.weight": inner}}


def hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under HF names, fused projections fused as the family's checkpoints
    store them (a tied LM head is left out)."""
    hf = {hf_key(name): tensor for name, tensor in state.items()
          if not (config.tie_word_embeddings and name == "lm_head.weight")}
    for fused, parts in _fused_parts(config).items():
        for layer in range(config.num_layers):
            prefix = f"model.layers.{layer}."
            hf[prefix + fused] = torch.cat([hf.pop(prefix + part) for part in parts])
    return hf


def read_tensors(folder: Path, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs of a model folder's weights, one at a time."""
    return _read_safetensors(_weight_files(folder), device)


def read_tensor(folder: Path, name: str) -> torch.Tensor:
    """One tensor of a model folder's weights by its HF name (the other tensors unread)."""
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise KeyError(f"{folder} holds no tensor {name}")


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, copied where it is a slice of a larger storage (fused q/k/v or gate/up
    weights), which safetensors refuses to save."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def write_folder(folder: str | Path, state: dict[str, torch.Tensor], config: ModelConfig,
                 dtype: torch.dtype) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors, HF names) that
    `Transformer.from_pretrained` and transformers' `AutoModelForCausalLM` both load; state:
    our parameter names (a tied LM head is left out)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: _own_storage(tensor.contiguous().cpu())
               for name, tensor in hf_state(state, config).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf() | {"architectures": [ARCHITECTURES[config.model_type]],
                           "dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return folder


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a HF model folder, single-file or sharded."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise FileNotFoundError(
            f"no weights in {folder}: expected model.safetensors or "
            f"model.safetensors.index.json (PyTorch .bin checkpoints are not supported)"
        )
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise FileNotFoundError(f"{index} lists shards missing from {folder}: {absent}")
    return [folder / name for name in shards]


def _read_safetensors(
    files: list[Path], device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one tensor at a time so peak memory stays near one tensor."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(
                f"{file} is not a complete safetensors file ({exc}): it was probably cut "
                f"short by an interrupted download or copy; copy it again"
            ) from None
