"""What every trainable draft head is: a module built from its config dataclass, `cls(config)`.

`selfspec.heads.io` saves a head under its class name and finds the class again among the
subclasses of `Head`, so a new head needs no entry in any table: defining it is enough.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import nn

from selfspec.heads.draft_vocab import DraftVocab
from selfspec.model import ModelConfig, Transformer, attention_mask, dense_weight


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """The shape of a head's own attention layer: the target's sizes, RoPE and biases
    (hidden_size, vocab_size: the target's), which head configs extend."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    attention_out_bias: bool = False

    @classmethod
    def of_target(cls, target: ModelConfig) -> dict:
        """The target's values of this shape's fields (the attention layer's shape: its own).
        A head's layer rotates all its dimensions: LongRoPE's factors, sized for a target that
        rotates only part of each head (Phi-4-mini), are left out (RoPE at its theta)."""
        shape = {f.name: getattr(target, f.name) for f in fields(AttentionShape)}
        if target.rotary_dim != target.head_dim:
            shape["rope_scaling"] = None
        return shape

    def one_layer(self, intermediate_size: int = 1, mlp_bias: bool = False) -> ModelConfig:
        """A one-layer Llama config of this shape (intermediate_size 1: no MLP is used)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias, attention_out_bias=self.attention_out_bias,
            mlp_bias=mlp_bias)


class Head(nn.Module):
    """A trainable draft head. Subclasses name their config dataclass in `config_class` and
    take an instance of it as their only constructor argument."""

    config_class: ClassVar[type]

    def rope_and_mask(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RoPE's cos and sin at `positions` and the attention mask of x's T new rows [B, T, h]
        after the cache's slots (`mask` among them, default causal), for a head with an
        attention layer of its own: its `rope` (fp32) follows the positions' device."""
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        past = 0 if cache is None else cache.length
        return cos, sin, attention_mask(mask, x.shape[1], past, x.device)


def head_types() -> dict[str, type[Head]]:
    """Every head class defined so far, by class name (subclasses of subclasses too)."""
    found, todo = {}, list(Head.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


@torch.no_grad()
def start_from_target(norm: nn.Module, lm_head: nn.Module | None, target: Transformer,
                      vocab: DraftVocab | None) -> None:
    """A head's final norm from what the target's multiplies by (w, or Gemma's 1 + w) and,
    with a draft vocabulary, its LM head from the target's rows of it."""
    norm.weight.copy_(target.norm.gain())
    if vocab is not None:
        weight = dense_weight(target.lm_head)  # [V, h] (a quantized head's dequantized)
        lm_head.weight.copy_(weight[vocab.target_ids.to(weight.device)])
