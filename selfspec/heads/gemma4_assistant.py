"""Gemma 4's assistant (transformers' `Gemma4AssistantForCausalLM`): the small drafter Google
ships beside each Gemma 4 model. Trainable module and checkpoint I/O only; drafting is
`selfspec.drafters.gemma4_assistant`.

It has no K/V of its own. Each of its layers is a Gemma 4 decoder layer whose query attends to
the target's keys and values: the sliding layers to those of the target's last sliding layer,
the full layers to those of its last full layer (transformers' `shared_kv_states`). Its input
at the root (position t, the token not yet in the target's cache) is the target's scaled
embedding of that token beside the target's normed last hidden state of the token before,
projected to its width (`pre_projection`); its normed output is scored by its LM head and
projected back to the target's width (`post_projection`), the hidden state its next step
reads in place of the target's. Every step of a chain reads the same K/V at the same position.

With `use_ordered_embeddings` it scores through centroids (`CentroidScorer`): the top
`centroid_intermediate_top_k` of `num_centroids` clusters of the vocabulary are chosen by one
small product, and only their tokens' rows of the LM head are scored; every other token gets
one less than the lowest score computed in the call (a law with full support).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from selfspec.model import DecoderLayer, ModelConfig, Rope, apply_rope, checkpoint, rms_norm
from selfspec.model.transformer import layer_output

MODEL_TYPE = "gemma4_assistant"
ARCHITECTURE = "Gemma4AssistantForCausalLM"


@dataclass(frozen=True)
class AssistantConfig:
    """text: its decoder's layers (a gemma4_text config: their widths, kinds, RoPE, window);
    backbone_hidden_size: the target's hidden size; ordered_embeddings: scores through
    centroids (num_centroids clusters, the top centroid_top_k of them scored)."""

    text: ModelConfig
    backbone_hidden_size: int
    ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32

    def __post_init__(self) -> None:
        if self.text.model_type != "gemma4_text":
            raise ValueError(f"a Gemma 4 assistant's text_config is a gemma4_text config, got "
                             f"{self.text.model_type!r}")
        if self.ordered_embeddings and (self.text.vocab_size % self.num_centroids
                                        or not 1 <= self.centroid_top_k <= self.num_centroids):
            raise ValueError(f"num_centroids ({self.num_centroids}) must divide the vocabulary "
                             f"({self.text.vocab_size}) and centroid_intermediate_top_k "
                             f"({self.centroid_top_k}) be in 1..num_centroids")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> AssistantConfig:
        """Read an assistant's config.json (its text_config's layers all read the target's
        K/V: `num_kv_shared_layers` is their count, which the decoder's own reading refuses)."""
        if config.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not a Gemma 4 assistant: model_type {config.get('model_type')!r}"
                             f" (expected {MODEL_TYPE!r})")
        text = ModelConfig.from_hf({**config["text_config"], "num_kv_shared_layers": 0})
        return cls(text, int(config.get("backbone_hidden_size", 1536)),
                   bool(config.get("use_ordered_embeddings", False)),
                   int(config.get("num_centroids", 2048)),
                   int(config.get("centroid_intermediate_top_k", 32)))

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict transformers reads as `Gemma4AssistantForCausalLM`'s."""
        text = {**self.text.to_hf(), "num_kv_shared_layers": self.text.num_layers,
                "vocab_size_per_layer_input": 0}
        return {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "text_config": text,
                "backbone_hidden_size": self.backbone_hidden_size,
                "use_ordered_embeddings": self.ordered_embeddings,
                "num_centroids": self.num_centroids,
                "centroid_intermediate_top_k": self.centroid_top_k, "tie_word_embeddings": True}


class CentroidScorer(nn.Module):
    """Scores only the tokens of the best clusters: `centroids` picks the top_k of
    num_centroids clusters, `token_ordering` [V] lists each cluster's tokens in turn."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        self.top_k, self.num_centroids = config.centroid_top_k, config.num_centroids
        self.centroids = nn.Linear(config.text.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering",
                             torch.arange(config.text.vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[B, T, V] scores of hidden [B, T, h] through lm_head [V, h]: the chosen clusters'
        tokens scored, the others one below the call's lowest score."""
        chosen = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [B, T, k]
        clusters = self.token_ordering.view(self.num_centroids, -1)  # [C, V / C]
        tokens = clusters[chosen].flatten(-2)  # [B, T, k * V / C]
        scores = (lm_head[tokens] @ hidden[..., None])[..., 0]  # [B, T, k * V / C]
        floor = scores.min() - 1.0  # as transformers: the lowest over the whole call
        out = floor.expand(*hidden.shape[:-1], lm_head.shape[0]).clone()  # [B, T, V]
        return out.scatter_(-1, tokens, scores)


class AssistantLayer(DecoderLayer):
    """A Gemma 4 decoder layer whose attention has a query only: keys and values are the
    target's (its k_proj, v_proj and k_norm are dropped)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        attn = self.self_attn
        del attn.k_proj, attn.v_proj, attn.k_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
                ) -> torch.Tensor:
        """x [B, T, h]; keys, values [B, H_kv, S, D] (the target's, roped and normed); mask
        [T, S] bool or None (every key)."""
        attn = self.self_attn
        batch, t, _ = x.shape
        q = attn.q_proj(self.normed(0, x)).view(batch, t, attn.num_heads, attn.head_dim)
        q = apply_rope(attn.q_norm(q).transpose(1, 2), cos, sin)  # [B, H, T, D]
        groups = attn.num_heads // keys.shape[1]
        out = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(groups, 1).to(q.dtype),
            values.repeat_interleave(groups, 1).to(q.dtype), attn_mask=mask, scale=attn.scale)
        return self.scaled(layer_output(self, x, out.transpose(1, 2).reshape(batch, t, -1)))


@dataclass(frozen=True)
class AssistantOutput:
    """logits [B, T, V] fp32; hidden [B, T, backbone]: what the next step reads in place of
    the target's hidden state."""

    logits: torch.Tensor
    hidden: torch.Tensor


class Gemma4Assistant(nn.Module):
    """The assistant's weights under transformers' names (its `model.` prefix dropped, its
    tied embedding as `lm_head`)."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, text.hidden_size,
                                        bias=False)
        self.post_projection = nn.Linear(text.hidden_size, config.backbone_hidden_size,
                                         bias=False)
        self.layers = nn.ModuleList(AssistantLayer(text, i) for i in range(text.num_layers))
        self.norm = rms_norm(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.masked_embedding = CentroidScorer(config) if config.ordered_embeddings else None
        self.ropes = {"full": Rope.of(text), "sliding": Rope.of(text, local=True)
                      if text.local_rope else Rope.of(text)}

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                shared: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                masks: Mapping[str, torch.Tensor] | None = None) -> AssistantOutput:
        """embeds [B, T, backbone]: the target's scaled embeddings of the tokens; hidden
        [B, T, backbone]: the target's (or the last step's) states before them; positions
        [T]; shared: the target's (keys, values) [B, H_kv, S, D] by layer kind ("full",
        "sliding"), every query seeing every full key and the last sliding_window + 1 sliding
        ones (transformers' reading of a window over the shared states: its bidirectional
        window counts |query - key| <= W, one key more than the target's own query sees).
        masks: [T, S] bool by kind in place of that, where the rows stand at positions of
        their own (`teacher_forced_masks`: every position of a sequence at once)."""
        x = self.pre_projection(torch.cat([embeds, hidden], dim=-1))
        sliding = self.config.text.sliding_layers
        for i, layer in enumerate(self.layers):
            kind = "sliding" if i in sliding else "full"
            keys, values = shared[kind]
            cos, sin = self.ropes[kind].cos_sin(positions, x.dtype)
            mask = self._mask(kind, keys.shape[2], x) if masks is None else masks[kind]
            x = layer(x, cos, sin, keys, values, mask)
        last = self.norm(x)
        return AssistantOutput(self.scores(last), self.post_projection(last))

    def scores(self, last: torch.Tensor) -> torch.Tensor:
        """[..., V] fp32 scores of its normed states: its LM head, or through centroids."""
        if self.masked_embedding is None:
            return self.lm_head(last).float()
        return self.masked_embedding(last, self.lm_head.weight).float()

    def _mask(self, kind: str, keys: int, x: torch.Tensor) -> torch.Tensor | None:
        window = self.config.text.sliding_window
        seen = _seen(window)
        if kind == "full" or seen is None or keys <= seen:
            return None
        mask = torch.zeros(x.shape[1], keys, dtype=torch.bool, device=x.device)
        mask[:, keys - seen:] = True
        return mask

    # ---- Hugging Face folders -------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> Gemma4Assistant:
        """An assistant folder transformers wrote (config.json + safetensors)."""
        folder = Path(folder)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in assistant folder {folder}")
        config = AssistantConfig.from_hf(json.loads(config_file.read_text()))
        state = {our_key(name): tensor for name, tensor in
                 checkpoint.read_tensors(folder, device)}
        with torch.device("meta"):
            model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"{folder}: the weights do not match a Gemma 4 assistant of its "
                             f"config.json: missing {missing[:8]}, unexpected {unexpected[:8]}")
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, folder: str | Path) -> Path:
        """A folder transformers' `Gemma4AssistantForCausalLM.from_pretrained` reads."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {hf_key(name): tensor.detach().cpu().clone()
                 for name, tensor in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        dtype = str(self.lm_head.weight.dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(self.config.to_hf() | {"dtype": dtype},
                                                       indent=2) + "\n")
        return folder


def _seen(window: int | None) -> int | None:
    """How many of the last shared sliding keys a query sees (transformers' bidirectional
    window: |query - key| <= W)."""
    return None if window is None else window + 1


def teacher_forced_masks(positions: torch.Tensor, keys: int, window: int | None
                         ) -> dict[str, torch.Tensor]:
    """[T, S] masks by kind for rows at positions [T] (each the root of its own draft) over
    the K/V of a whole sequence's S slots: a row at t sees the slots before t, its sliding
    layers the last W + 1 of them, as it would drafting after a prefill of t tokens."""
    slots = torch.arange(keys, device=positions.device)
    full = slots[None, :] < positions[:, None]  # [T, S]
    seen = _seen(window)
    if seen is None:
        return {"full": full, "sliding": full}
    return {"full": full, "sliding": full & (slots[None, :] >= positions[:, None] - seen)}


@dataclass(frozen=True)
class AssistantShape:
    """The shape of a random assistant for a target (its hidden_size, num_layers (sliding
    ones, then one full), intermediate_size, num_heads; centroids when ordered)."""

    hidden_size: int = 256
    num_layers: int = 4
    intermediate_size: int = 1024
    num_heads: int = 4
    ordered: bool = False
    num_centroids: int = 64
    centroid_top_k: int = 8


@torch.no_grad()
def random_assistant(target: ModelConfig, shape: AssistantShape, seed: int = 0
                     ) -> Gemma4Assistant:
    """An assistant of `shape` with random weights for a gemma4_text target (seeded): every
    weight normal with std 0.02, as transformers initialises a linear layer; norms and layer
    scalars at 1; with centroids, the vocabulary in order. For timings, not for acceptance."""
    kinds = ("sliding_attention",) * (shape.num_layers - 1) + ("full_attention",)
    text = replace(target, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                   intermediate_size=shape.intermediate_size, num_heads=shape.num_heads,
                   layer_types=kinds, value_from_key=False, full_kv_heads=None,
                   embedding_multiplier=shape.hidden_size ** 0.5, mtp_modules=0,
                   mtp_layout=None)
    config = AssistantConfig(text, target.hidden_size, shape.ordered, shape.num_centroids,
                             shape.centroid_top_k)
    generator = torch.Generator().manual_seed(seed)
    model = Gemma4Assistant(config)
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model.eval()


def our_key(name: str) -> str:
    """Our name of a transformers assistant tensor."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "lm_head.weight"
    return name.removeprefix("model.")


def hf_key(name: str) -> str:
    """transformers' name of one of our assistant tensors."""
    if name == "lm_head.weight":
        return "model.embed_tokens.weight"
    return f"model.{name}" if name.startswith(("layers.", "norm.")) else name
