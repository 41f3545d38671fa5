"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi) as `ModelConfig` describes it
(`kv_lora_rank` > 0): each token's keys and values are expanded from a compressed latent of
kv_lora_rank (normed) and one key of head_dim (DeepSeek's qk_rope_head_dim) that RoPE rotates,
shared by every head; the cache holds those two per token and layer, not K/V per head (a
`KVCache` with one head, the roped key as K and the latent as V: `ModelConfig.cache_dims`),
so commit, truncate and the tree's mask work on it as on K/V.

Each head's query is qk_nope_head_dim unroped dimensions and head_dim roped ones, from one
product (`q_proj`) or through a low-rank one (`q_a_proj`, `q_a_layernorm`, `q_b_proj`:
q_lora_rank). Inside this module a head's query and key lay the roped part first, so that
the decoder's partial RoPE (`apply_rope` rotates the first dimensions) applies to them as it
does to any family; the softmax is the same. DeepSeek lays its roped dimensions out in
adjacent pairs (`rope_interleave`): they are gathered as evens then odds before RoPE, which
rotates each pair alike. Its softmax scale is (nope + rope dims) ** -0.5, times YaRN's
mscale(mscale_all_dim) squared where the RoPE is scaled so.

The latent is expanded over every cached slot at each forward (`kv_b_proj`), as transformers
does: the arithmetic of a row is then the same in a one-token step and in a verification.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import Linear
from selfspec.model.exact_mode import invariant_attention
from selfspec.model.rope import interleaved_rope

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a and kv_a norms keep their class's default eps


class LatentAttention(nn.Module):
    """Speaks `Attention`'s protocol to the decoder layer: `projections` gives the query
    [B, H, T, rope + nope], the roped key [B, 1, T, rope] (RoPE not applied yet) and the
    latent [B, 1, T, rank] in place of q, k, v; `attend` caches the two and attends; `o_proj`
    maps the heads' values back."""

    def __init__(self, config: ModelConfig, layer_idx: int,
                 norm: Callable[[int, float], nn.Module]) -> None:
        """norm: the decoder's RMSNorm class, built as norm(dim, eps)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.rope_dim = config.num_heads, config.head_dim
        self.nope_dim, self.v_dim, self.rank = (config.qk_nope_head_dim, config.v_head_dim,
                                                config.kv_lora_rank)
        hidden, bias = config.hidden_size, config.attention_bias
        q_out = config.num_heads * (self.nope_dim + self.rope_dim)
        if config.q_lora_rank:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, config.num_heads * (self.nope_dim + self.v_dim),
                                bias=False)
        self.o_proj = Linear(config.num_heads * self.v_dim, hidden,
                             bias=config.attention_out_bias)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5 * _mscale_squared(config)
        self.interleaved = config.rope_interleave
        self.qk_norm = None
        self.invariant_rows: int | None = None  # the exact mode's block (`invariant_attention`)

    def projections(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, ...]:
        """query [B, H, T, rope + nope], roped key [B, 1, T, rope] and latent [B, 1, T, rank]
        of x [B, T, hidden] (fused: unused, nothing here is fused)."""
        batch, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") \
            else self.q_proj(x)
        q = q.view(batch, t, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.interleaved:  # DeepSeek's adjacent pairs as the half-split RoPE takes them
            q_rope, k_rope = interleaved_rope(q_rope), interleaved_rope(k_rope)
        return torch.cat((q_rope, q_nope), dim=-1), k_rope[:, None], latent[:, None]

    @staticmethod
    def gated(attended: torch.Tensor, gate: list[torch.Tensor]) -> torch.Tensor:
        return attended  # MLA has no output gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """[B, T, H * v_head_dim]: the new rows' attention over the cache (where their roped
        keys k and latents v are written first) and themselves."""
        batch, _, t, _ = q.shape
        if cache is not None:
            k, v = cache.write(self.layer_idx, k, v)  # [B, 1, S, rope], [B, 1, S, rank]
        keys, values = self.expanded(k.to(q.dtype), v.to(q.dtype))
        if self.invariant_rows is not None:
            out = invariant_attention(q, keys, values, attn_mask, scale=self.scale,
                                      block_rows=self.invariant_rows)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                                 is_causal=attn_mask is None, scale=self.scale)
        return out.transpose(1, 2).reshape(batch, t, -1)  # [B, T, H * v_head_dim]

    def expanded(self, k_rope: torch.Tensor, latent: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys [B, H, S, rope + nope] and values [B, H, S, v_head_dim] from the
        roped keys [B, 1, S, rope] and latents [B, 1, S, rank]."""
        batch, _, s, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(batch, s, self.num_heads,
                                                self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, values = kv.split((self.nope_dim, self.v_dim), dim=-1)
        keys = torch.cat((k_rope.expand(-1, self.num_heads, -1, -1), k_nope), dim=-1)
        return keys, values


def _mscale_squared(config: ModelConfig) -> float:
    """DeepSeek's factor on the softmax scale under a scaled RoPE with mscale_all_dim:
    (0.1 * mscale_all_dim * ln(factor) + 1) ** 2 (1 otherwise)."""
    scaling = config.rope_scaling or {}
    factor, mscale_all = scaling.get("factor", 1.0), scaling.get("mscale_all_dim")
    if not mscale_all or factor <= 1:
        return 1.0
    return (0.1 * mscale_all * math.log(factor) + 1.0) ** 2
