"""Hugging Face checkpoint I/O of our models: parameter names both ways, the safetensors files
of a model folder (single or sharded), read one tensor at a time, and a folder written back
that transformers loads. Phi-3's checkpoints fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`): they are split on reading and fused again on writing.

Experts are stacked per layer (`selfspec.model.moe`: gate_up_proj [E, 2I, H], down_proj
[E, H, I]). Mixtral's checkpoints hold one w1 (gate), w3 (up), w2 (down) per expert under
`block_sparse_moe`, Qwen3-MoE's one gate/up/down_proj per expert: both are stacked on
reading (transformers' in-memory models hold our stacks already) and split again on writing.
gpt-oss's stacks are transposed ([E, H, 2I] and [E, I, H]) with gate and up interleaved,
and its router is `mlp.router`: converted both ways.

MTP modules (ours `mtp.{i}.*`: embed_norm, hidden_norm, proj, block, norm, head) are read and
written in their checkpoint's layout: DeepSeek-V3's NextN layers at `model.layers.{L + i}.*`
(enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, the block's own names, and a copy
of the embedding, dropped on reading and written back for servers that load it there), or
Qwen3-Next's `mtp.*` (pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0.*, norm), or
MiMo's `model.mtp_layers.{i}.*` (token_layernorm, hidden_layernorm, input_proj,
final_layernorm, the block's own names), which config.json counts under NextN's key: the
checkpoint's names tell the two apart (`with_mtp_layout`).
transformers' classes drop these keys on loading; this reader keeps them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
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
    """Our parameter name for a HF one, or None for tensors we do not keep (an image-text
    model's vision tower: its text decoder's are under `model.language_model.`)."""
    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight") \
            or name.startswith("model.visual."):
        return None  # recomputed / shared with embed_tokens / not a decoder's
    return name.removeprefix("model.").removeprefix("language_model.")


def our_state(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs for a stream of HF ones (`our_tensors`), per-expert weights
    stacked as soon as a layer's are all read."""
    pieces: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        for key, ours in our_tensors(name, tensor, config):
            match = _EXPERT.match(key)
            if match is None:
                yield key, ours
                continue
            layer = pieces.setdefault(match["prefix"], {})
            layer[int(match["expert"]), match["part"]] = ours
            if len(layer) == 3 * config.num_experts:
                yield from _stacked(match["prefix"], pieces.pop(match["prefix"]),
                                    config.num_experts)


# One expert's weight in a per-expert layout, under our part names.
_EXPERT = re.compile(r"^(?P<prefix>(?:layers\.\d+|mtp\.\d+\.block)\.mlp\.experts)"
                     r"\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _stacked(prefix: str, parts: dict[tuple[int, str], torch.Tensor], num_experts: int
             ) -> Iterator[tuple[str, torch.Tensor]]:
    experts = range(num_experts)
    yield f"{prefix}.gate_up_proj", torch.stack(
        [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in experts])
    yield f"{prefix}.down_proj", torch.stack([parts[e, "down_proj"] for e in experts])


def our_tensors(name: str, tensor: torch.Tensor, config: ModelConfig
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs for one HF tensor: none for what we do not keep, the q/k/v
    or gate/up rows of a fused projection (views, no copy), one expert's weight under our
    part names (`our_state` stacks them), gpt-oss's experts in our layout, else the tensor
    as it is."""
    key = our_key(name, config.tie_word_embeddings)
    if key is not None and config.mtp_modules:
        key = _our_mtp_key(key, config)
    if key is None:
        return
    if config.model_type == "bamba":
        key = _renamed(key, _BAMBA_NAMES)
    if key.endswith(("_blocks", "_scales")):
        raise ValueError(f"{name} is quantized (MXFP4); dequantize the model with "
                         f"transformers first (Mxfp4Config(dequantize=True))")
    if config.model_type == "mixtral":
        key = key.replace(".block_sparse_moe.", ".mlp.")
        for theirs, ours in _MIXTRAL_PARTS.items():
            key = re.sub(rf"(\.experts\.\d+\.){theirs}\.weight$", rf"\g<1>{ours}.weight", key)
    if config.model_type == "gpt_oss":
        yield _from_gpt_oss(key, tensor)
        return
    if config.model_type == "llama4_text":
        yield _from_llama4(key, tensor)
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


def _from_gpt_oss(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One gpt-oss tensor under our name and in our layout."""
    key = key.replace(".mlp.router.", ".mlp.gate.")
    if key.endswith("experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H]
        tensor = _deinterleaved(tensor.transpose(1, 2), dim=1)
    elif key.endswith("experts.gate_up_proj_bias"):
        tensor = _deinterleaved(tensor, dim=1)
    elif key.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
        tensor = tensor.transpose(1, 2)
    return key, tensor.contiguous()


# Llama 4's feed-forward names against ours (its experts' stacks are transposed: [E, H, 2I],
# [E, I, H]; ours [E, 2I, H], [E, H, I])
_LLAMA4_NAMES = ((".feed_forward.router.", ".mlp.gate."),
                 (".feed_forward.shared_expert.", ".mlp.shared_experts."),
                 (".feed_forward.", ".mlp."))


def _from_llama4(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One Llama 4 tensor under our name and in our layout."""
    for theirs, ours in _LLAMA4_NAMES:
        key = key.replace(theirs, ours)
    if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        tensor = tensor.transpose(1, 2).contiguous()
    return key, tensor


def _to_llama4(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our HF-prefixed tensors under Llama 4's name and in its layout."""
    if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        tensor = tensor.transpose(1, 2)
    for theirs, ours in _LLAMA4_NAMES:
        key = key.replace(ours, theirs)
    return key, tensor


def _deinterleaved(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """gate and up, interleaved along dim (gpt-oss), as all gates then all ups."""
    gate, up = tensor.unflatten(dim, (-1, 2)).unbind(dim + 1)
    return torch.cat([gate, up], dim=dim)


def _interleaved(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """All gates then all ups along dim, interleaved as gpt-oss stores them."""
    gate, up = tensor.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


# Bamba's names of a layer's MLP and its norm, and of the final norm, against ours
_BAMBA_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("final_layernorm.", "norm."))


def _renamed(key: str, names) -> str:
    """key with the first of names' (theirs, ours) pairs it holds replaced; a name without a
    leading dot (the final norm's) only at the key's start, after "model."."""
    for theirs, ours in names:
        at = key.find(theirs)
        if at >= 0 and (theirs.startswith(".") or key[:at] in ("", "model.")):
            return key[:at] + ours + key[at + len(theirs):]
    return key


def hf_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under HF names, fused projections fused and experts laid out as the
    family's checkpoints store them (a tied LM head is left out), MTP modules in their
    layout."""
    hf = {hf_key(name): tensor for name, tensor in state.items()
          if not (config.tie_word_embeddings and name == "lm_head.weight")}
    if config.model_type == "bamba":
        hf = {_renamed(key, [(ours, theirs) for theirs, ours in _BAMBA_NAMES]): tensor
              for key, tensor in hf.items()}
    mtp_blocks = [f"model.mtp.{i}.block." for i in range(config.mtp_modules)]
    for fused, parts in _fused_parts(config).items():
        for prefix in [f"model.layers.{layer}." for layer in range(config.num_layers)] \
                + mtp_blocks:
            hf[prefix + fused] = torch.cat([hf.pop(prefix + part) for part in parts])
    mtp_moe = mtp_blocks if config.num_layers - 1 in config.moe_layers else []
    if config.model_type == "llama4_text":
        return dict(_to_llama4(name, tensor) for name, tensor in hf.items())
    for prefix in [f"model.layers.{layer}." for layer in config.moe_layers] + mtp_moe:
        hf |= _hf_experts(hf, prefix + "mlp.", config)
    if not config.mtp_modules:
        return hf
    out = {_hf_mtp_key(name, config): tensor for name, tensor in hf.items()}
    if config.mtp_layout == "nextn":  # the copy of the embedding the first NextN layer holds
        out[f"model.layers.{config.num_layers}.embed_tokens.weight"] = \
            hf["model.embed_tokens.weight"].clone()
    return out


# Our MTP module's parts under each layout's names (the block's own names are the layer's).
_MTP_PARTS = {"nextn": {"embed_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj",
                        "norm": "shared_head.norm", "head": "shared_head.head"},
              "mtp": {"embed_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden",
                      "proj": "fc", "norm": "norm"},
              "mimo": {"embed_norm": "token_layernorm", "hidden_norm": "hidden_layernorm",
                       "proj": "input_proj", "norm": "final_layernorm"}}
_MIMO_PREFIX = "model.mtp_layers."
_OUR_MTP = re.compile(r"^model\.mtp\.(?P<index>\d+)\.(?P<rest>.+)$")


def _hf_mtp_key(name: str, config: ModelConfig) -> str:
    """The checkpoint name of one of our HF-prefixed names (`model.mtp.{i}.*` mapped)."""
    match = _OUR_MTP.match(name)
    if match is None:
        return name
    index, rest = int(match["index"]), match["rest"]
    layout = config.mtp_layout
    prefix = {"nextn": f"model.layers.{config.num_layers + index}.", "mtp": "mtp.",
              "mimo": f"{_MIMO_PREFIX}{index}."}[layout]
    if rest.startswith("block."):
        return (f"mtp.layers.{index}." if layout == "mtp" else prefix) \
            + rest.removeprefix("block.")
    part, _, param = rest.rpartition(".")
    return f"{prefix}{_MTP_PARTS[config.mtp_layout][part]}.{param}"


def _our_mtp_key(key: str, config: ModelConfig) -> str | None:
    """Our name for a checkpoint name (`model.` stripped) of an MTP module's tensor; None for
    NextN's copy of the embedding (the target's is used); other names as they are."""
    if config.mtp_layout == "nextn":
        match = re.match(r"^layers\.(\d+)\.(.+)$", key)
        index = int(match[1]) - config.num_layers if match else -1
        if not 0 <= index < config.mtp_modules:
            return key
        rest = match[2]
        if rest == "embed_tokens.weight":
            return None
    elif config.mtp_layout == "mimo":
        if not key.startswith("mtp_layers."):
            return key
        index, _, rest = key.removeprefix("mtp_layers.").partition(".")
    elif key.startswith("mtp.layers."):  # mtp.layers.{i}.* is the block of module i
        index, _, rest = key.removeprefix("mtp.layers.").partition(".")
        return f"mtp.{index}.block.{rest}"
    elif key.startswith("mtp."):
        index, rest = 0, key.removeprefix("mtp.")
    else:
        return key
    theirs = {name: ours for ours, name in _MTP_PARTS[config.mtp_layout].items()}
    part, _, param = rest.rpartition(".")
    if part in theirs:
        return f"mtp.{index}.{theirs[part]}.{param}"
    return f"mtp.{index}.block.{rest}"


def _hf_experts(hf: dict[str, torch.Tensor], prefix: str, config: ModelConfig
                ) -> dict[str, torch.Tensor]:
    """A layer's router and experts taken out of hf, under the family's names and layout."""
    gate_up, down = hf.pop(prefix + "experts.gate_up_proj"), hf.pop(prefix + "experts.down_proj")
    router = {part: hf.pop(prefix + "gate." + part) for part in ("weight", "bias")
              if prefix + "gate." + part in hf}
    if config.model_type == "gpt_oss":
        out = {prefix + "router." + part: t for part, t in router.items()}
        out[prefix + "experts.gate_up_proj"] = _interleaved(gate_up, dim=1).transpose(1, 2)
        out[prefix + "experts.down_proj"] = down.transpose(1, 2)
        out[prefix + "experts.gate_up_proj_bias"] = _interleaved(
            hf.pop(prefix + "experts.gate_up_proj_bias"), dim=1)
        return out
    names = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    if config.model_type == "mixtral":
        prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        names = {ours: theirs for theirs, ours in _MIXTRAL_PARTS.items()}
    out = {prefix + "gate." + part: t for part, t in router.items()}
    for e in range(config.num_experts):
        gate, up = gate_up[e].chunk(2)
        for part, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down[e])):
            out[f"{prefix}experts.{e}.{names[part]}.weight"] = tensor
    return out


def with_mtp_layout(config: ModelConfig, folder: Path) -> ModelConfig:
    """config as the folder's weights hold its MTP modules (`mtp_as_stored`)."""
    names = []
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                names += handle.keys()
        except SafetensorError as exc:
            raise _incomplete(file, exc) from None
    return mtp_as_stored(config, names)


def mtp_as_stored(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """config with MiMo's layout where config.json counts NextN layers and the weights' names
    are MiMo's (`model.mtp_layers.*`), and with no MTP modules where the weights hold none (a
    folder transformers saved: its classes drop them, while DeepSeek-V3's config.json still
    counts one)."""
    if not config.mtp_modules:
        return config
    names = list(names)
    if config.mtp_layout == "nextn" and any(n.startswith(_MIMO_PREFIX) for n in names):
        config = replace(config, mtp_layout="mimo")
    first = {"nextn": f"model.layers.{config.num_layers}.", "mtp": "mtp.",
             "mimo": _MIMO_PREFIX}[config.mtp_layout]
    if not any(name.startswith(first) for name in names):
        return replace(config, mtp_modules=0, mtp_layout=None)
    return config


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
            raise _incomplete(file, exc) from None


def _incomplete(file: Path, exc: SafetensorError) -> ValueError:
    return ValueError(f"{file} is not a complete safetensors file ({exc}): it was probably cut "
                      f"short by an interrupted download or copy; copy it again")
