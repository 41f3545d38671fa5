"""The one decoder of every family selfspec reads (Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3,
Gemma 2/3, OLMo 2, Granite, Phi-3/4, and the mixtures of experts Mixtral, Qwen3-MoE,
gpt-oss): what differs between them is all in `ModelConfig` (`selfspec.model.config`), and
each layer honours it: pre- and post-norms, RMSNorm with (1 + w), q/k norms per head or over
the projection, the softmax scale, soft-capping and attention sinks, GELU-tanh or SiLU gates,
scaled embeddings, multipliers, sliding windows per layer with a RoPE each
(`selfspec.model.rope`), a mixture of experts in place of the MLP (`selfspec.model.moe`).

Module names mirror Hugging Face's, so a HF state dict loads once its leading "model." is
stripped (and, for Phi-3, its fused projections split; experts stacked or rearranged:
`selfspec.model.checkpoint`).

A sliding layer's query at position p attends to the keys at positions > p - W among those
the mask lets it see (the cache holds the committed history: slot s, position s; the new
rows' positions are given), so in a tree a node sees its ancestors and the committed tokens
within its own window. The cache keeps every slot (no ring buffer).

The forward takes RoPE positions apart from cache slots (see `selfspec.model.kv_cache`), an optional
[T, T] attention mask among the new tokens (tree verification), and can run a slice of the
layers: `exit_layer` for LayerSkip-style early exit, `start_layer` + `hidden_in` to resume,
`skip_layers` to leave a set of layers out (layer-skip drafting: Draft & Verify, SWIFT).

A hybrid target (Qwen3-Next, Qwen3.5) has Gated DeltaNet layers among its attention layers
(`ModelConfig.linear_layers`, `selfspec.model.recurrent`): they read each new row's parent off
the forward's mask and keep their state in the cache (`selfspec.model.recurrent_cache`), so
verification restores it exactly after a rejection, for chains and trees alike.

A target whose config names MTP modules (`ModelConfig.mtp_modules`) holds them in `mtp`
(`MtpModule`); `mtp_forward` and `mtp_logits` run one of them (a drafter's work, never the
target's own forward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from selfspec.checks import is_int_in
from selfspec.model import checkpoint
from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import PACKED_FROM_MODEL_BYTES, Linear, aligned, use_packed_products
from selfspec.model.exact_mode import activated, invariant_attention
from selfspec.model.kv_cache import KVCache, SegmentedKVCache
from selfspec.model.mamba import Mamba2Dims, Mamba2Mixer
from selfspec.model.mla import LatentAttention
from selfspec.model.moe import MoE
from selfspec.model.placement import Placement
from selfspec.model.recurrent import DeltaNetDims, GatedDeltaNet, parents_of
from selfspec.model.recurrent_cache import HybridCache, RecurrentState
from selfspec.model.rope import Rope, apply_rope, interleaved_rope


def _moved(device: torch.device, *tensors: torch.Tensor | None) -> tuple:
    """tensors (None kept) on device: a layer of a placed model on another device than the
    one before it."""
    return tuple(None if t is None else t.to(device) for t in tensors)


# ---- building blocks -----------------------------------------------------------------------


@dataclass
class ModelOutput:
    """logits [B, T, V] fp32; hidden: residual streams in `return_hidden` order, each
    [B, T, hidden]; last_hidden [B, T, hidden]: the normed state the LM head consumes
    (logits and last_hidden are None for a forward run with with_logits=False)."""

    logits: torch.Tensor | None
    hidden: tuple[torch.Tensor, ...]
    last_hidden: torch.Tensor | None


class RMSNorm(nn.Module):
    """scale: "weight" (w times the normalised input cast back: Llama), "weight_fp32" (w
    times it in fp32, then cast: OLMo 2) or "one_plus_weight" ((1 + w) in fp32: Gemma, whose
    weights start at 0). The input is normalised in fp32, as transformers does."""

    def __init__(self, dim: int, eps: float, scale: str = "weight") -> None:
        super().__init__()
        self.eps, self.scale = eps, scale
        self.weight = nn.Parameter(torch.zeros(dim) if scale == "one_plus_weight"
                                   else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale == "weight":
            return self.weight * x32.to(x.dtype)
        return (self.gain().float() * x32).to(x.dtype)

    def gain(self) -> torch.Tensor:
        """[dim] what the normalised input is multiplied by (w, or 1 + w)."""
        return 1 + self.weight if self.scale == "one_plus_weight" else self.weight


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x RMS-normed over its last dim in fp32, without a weight (Gemma 4's values)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    """An RMSNorm of the family's kind over dim (default hidden_size) features."""
    return RMSNorm(dim or config.hidden_size, config.rms_norm_eps, config.norm_scale)


class Attention(nn.Module):
    """input_size: the width of what q, k and v read (default hidden_size; EAGLE-3's head reads
    its feature and embedding side by side, 2 x hidden)."""

    def __init__(self, config: ModelConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = config.layer_widths(layer_idx)  # Gemma 4's own
        self.cache_widths = config.cache_dims[:2]  # K/V heads and dim of the cache's entries
        self.scale, self.softcap = config.attention_scale, config.attn_logit_softcapping
        q_dim, kv_dim = config.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias, width = config.attention_bias, input_size or config.hidden_size
        # Qwen3-Next: q_proj also gives each head's output gate (q and gate side by side)
        self.output_gate = config.attention_output_gate
        self.q_proj = Linear(width, 2 * q_dim if self.output_gate else q_dim, bias=bias)
        self.k_proj = Linear(width, kv_dim, bias=bias)
        # Gemma 4's full layers: no v_proj, the keys' product doubles as the values
        from_key = config.value_from_key and layer_idx not in config.sliding_layers
        self.v_proj = None if from_key else Linear(width, kv_dim, bias=bias)
        self.v_norm_eps = config.rms_norm_eps if config.v_norm else None
        self.o_proj = Linear(q_dim, config.hidden_size, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        self.invariant_rows: int | None = None  # the exact mode's block (`invariant_attention`)
        # gpt-oss: a learned logit per head in the softmax's denominator (None: no sinks)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks \
            else None
        # Llama 4: RoPE over adjacent pairs, gathered as evens then odds (`interleaved_rope`);
        # its NoPE layers have neither RoPE nor q/k norms
        self.rope_pairs = config.rope_interleave and layer_idx not in config.no_rope_layers
        self.l2_eps = config.rms_norm_eps if config.qk_norm == "l2" and \
            layer_idx not in config.no_rope_layers else None
        if config.qk_norm in ("head", "projection"):  # over each head's dims, or the whole's
            per_head = config.qk_norm == "head"
            self.q_norm = rms_norm(config, self.head_dim if per_head else q_dim)
            self.k_norm = rms_norm(config, self.head_dim if per_head else kv_dim)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, input_size]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,  # [T, S] bool, None = causal without past
        cache: KVCache | None,
    ) -> torch.Tensor:
        q, k, v, *gate = self.projections(x)
        attended = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, attn_mask,
                               cache)
        return self.o_proj(self.gated(attended, gate))

    def projections(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, ...]:
        """q [B, H, T, D], k and v [B, H_kv, T, D] of x [B, T, input_size], q and k normed if
        the family norms them, then the output gate [B, T, H * D] where the attention has one;
        fused: as one product over the weight that `fuse_projections` made q/k/v views of."""
        batch, t, _ = x.shape
        if fused:
            q_dim, kv_dim = self.q_proj.out_features, self.k_proj.out_features
            parts = (q_dim, kv_dim) if self.v_proj is None else (q_dim, kv_dim, kv_dim)
            q, k, *v = F.linear(x, self.fused.weight, self.fused.bias).split(parts, dim=-1)
            v = v[0] if v else k  # Gemma 4's full layers: the keys' product as values
        else:
            q, k = self.q_proj(x), self.k_proj(x)
            v = k if self.v_proj is None else self.v_proj(x)
        gate = ()
        if self.output_gate:  # per head: its D query dims, then its D gate dims
            q, g = q.view(batch, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(batch, t, -1), (g.reshape(batch, t, -1),)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, t, self.num_heads, self.head_dim)
        k = k.view(batch, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.l2_eps is not None:  # Llama 4's, after RoPE there: a rotation keeps the norm
            q, k = unit_rms(q, self.l2_eps), unit_rms(k, self.l2_eps)
        if self.rope_pairs:
            q, k = interleaved_rope(q), interleaved_rope(k)
        v = v.view(batch, t, self.num_kv_heads, self.head_dim)
        if self.v_norm_eps is not None:
            v = unit_rms(v, self.v_norm_eps)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *gate

    def cached(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H_kv, T, D] written to the cache; every slot's K/V back. A layer narrower
        than the cache's entries (Gemma 4's sliding layers beside wider full ones) writes
        them padded with zeros and reads its own heads and dims back."""
        heads, dim = self.cache_widths
        if (heads, dim) == (self.num_kv_heads, self.head_dim):
            return cache.write(self.layer_idx, k, v)
        pad = (0, dim - self.head_dim, 0, 0, 0, heads - self.num_kv_heads)
        k, v = cache.write(self.layer_idx, F.pad(k, pad), F.pad(v, pad))
        return (k[:, :self.num_kv_heads, :, :self.head_dim],
                v[:, :self.num_kv_heads, :, :self.head_dim])

    @staticmethod
    def gated(attended: torch.Tensor, gate: list[torch.Tensor]) -> torch.Tensor:
        """attended [B, T, H * D] times the sigmoid of its output gate, if given ([] or
        [gate]: what `projections` returned after v)."""
        return attended * torch.sigmoid(gate[0]) if gate else attended

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """[B, T, H * D]: the new rows' attention over the cache (where k and v are written
        first) and themselves, before the output product."""
        batch, _, t, _ = q.shape
        if cache is not None:
            k, v = self.cached(cache, k, v)  # [B, H_kv, S, D]
        if self.invariant_rows is not None:
            out = invariant_attention(q, k, v, attn_mask, scale=self.scale,
                                      block_rows=self.invariant_rows, softcap=self.softcap,
                                      sinks=self.sinks)
        elif self.softcap is not None or self.sinks is not None:
            out = _written_out_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask,
                                         self.scale, self.softcap, self.sinks)
        else:
            k, v, grouped = _kv_for_kernels(k.to(q.dtype), v.to(q.dtype), self.num_heads,
                                            repeat_heads=q.is_cuda)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=grouped,
                scale=self.scale)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(batch, t, -1)


def _written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           attn_mask: torch.Tensor | None, scale: float | None,
                           cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """[B, H, T, D] attention that SDPA has no kernel for, written out as transformers does:
    scores s become cap * tanh(s / cap) before the mask and the softmax (Gemma 2), and/or
    each head's sink logit [H] joins the softmax's denominator (gpt-oss: its weight is
    dropped, so a row's weights sum to less than 1)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(2, 3) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap  # [B, H, T, S]
    if attn_mask is None:  # causal without past
        t = q.shape[2]
        attn_mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return weights[..., :-1].to(q.dtype) @ v


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU-tanh (Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]
        self.invariant_rows: int | None = None  # the exact mode: the gate's act on whole vectors

    def forward(self, x: torch.Tensor, fused: bool = False, static: bool = False
                ) -> torch.Tensor:
        """fused: gate and up as one product over the weight `fuse_projections` made them
        views of. static: unused (one dispatch serves every forward)."""
        if fused:
            gate, up = F.linear(x, self.fused.weight, self.fused.bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activated(self.act, gate, self.invariant_rows) * up)


def feed_forward(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer layer_idx's feed-forward block: the gated MLP, or in `config.moe_layers` a
    mixture of experts (`selfspec.model.moe`). It maps [B, T, hidden] to [B, T, hidden] and
    takes `fused` (whether `fuse_projections` fused its products) and `static` (the forward
    runs in fixed shapes and may read nothing back to the host: a static decode step)."""
    return MoE(config) if layer_idx in config.moe_layers else MLP(config)


class NormNames(NamedTuple):
    """A layer's norms by role, as the names of its modules (None: the role has no norm):
    before and after the attention, before and after the MLP. The names are transformers'
    (where `post_attention_layernorm` is Llama's norm before the MLP, and Gemma's and OLMo
    2's norm of the attention's output)."""

    attention_in: str | None
    attention_out: str | None
    mlp_in: str | None
    mlp_out: str | None

    @classmethod
    def of(cls, config: ModelConfig, input_norm: bool = True) -> NormNames:
        pre, post = config.pre_norms, config.post_norms
        mlp_in = "pre_feedforward_layernorm" if post else "post_attention_layernorm"
        return cls("input_layernorm" if pre and input_norm else None,
                   "post_attention_layernorm" if post else None,
                   mlp_in if pre else None,
                   "post_feedforward_layernorm" if post else None)


class DecoderLayer(nn.Module):
    """input_norm=False drops the input RMSNorm (EAGLE-1's head layer reads its fc output as is;
    it then has no `input_layernorm` weight)."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, input_norm: bool = True,
                 linear: bool | None = None) -> None:
        """linear: a Gated DeltaNet layer instead of attention (default: as config's
        layer_types say of layer_idx)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = layer_idx in config.linear_layers if linear is None else linear
        if self.linear and config.recurrent_mixer == "mamba2":  # Bamba's name
            self.mamba = Mamba2Mixer(mamba_dims(config))
        elif self.linear:
            self.linear_attn = GatedDeltaNet(delta_net_dims(config))
        elif config.latent:  # DeepSeek's MLA: a latent cached in place of K/V
            self.self_attn = LatentAttention(config, layer_idx, RMSNorm)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.mlp = feed_forward(config, layer_idx)
        self.norm_names = NormNames.of(config, input_norm)
        for name in self.norm_names:
            if name is not None:
                setattr(self, name, rms_norm(config))
        if not input_norm:
            self.input_layernorm = nn.Identity()
        self.residual_multiplier = config.residual_multiplier
        # Gemma 4: the layer's output times a learned scalar (a buffer in its checkpoint)
        self.register_buffer("layer_scalar", torch.ones(1) if config.layer_scalars else None)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None,
        stages: LayerStages | None = None,
        static: bool = False,
        query_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """stages: how the pointwise-heavy work around attention runs (default eagerly).
        static: a fixed-shape forward that reads nothing back to the host (`feed_forward`).
        cos, sin: None in a layer without RoPE. query_scale: [B or 1, 1, T, 1] what the
        queries are multiplied by (Llama 4's temperature on its NoPE layers), if anything.
        A linear-attention layer reads attn_mask as the new rows' parents [B, T]
        (`recurrent.parents_of`) and its state from the cache."""
        if self.linear:
            state = None if cache is None else cache.recurrent(self.layer_idx)
            mixer = self.mamba if hasattr(self, "mamba") else self.linear_attn
            mixed = mixer(self.normed(0, x), attn_mask, state)
            return self.scaled(mlp_output(self, self.residual(x, self.normed(1, mixed)),
                                          static=static))
        stages = stages or EAGER_STAGES
        q, k, v, *gate = stages.attention_inputs(self, x, cos, sin)
        if query_scale is not None:
            q = (q * query_scale).to(q.dtype)
        attended = self.self_attn.gated(self.self_attn.attend(q, k, v, attn_mask, cache), gate)
        return self.scaled(stages.layer_output(self, x, attended, static=static))

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output times its layer_scalar, where it has one (Gemma 4)."""
        return out if self.layer_scalar is None else out * self.layer_scalar

    def normed(self, role: int, x: torch.Tensor) -> torch.Tensor:
        """x through the layer's norm of a role (an index of NormNames), if it has one."""
        name = self.norm_names[role]
        return x if name is None else getattr(self, name)(x)

    def residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x plus a block's output (times the residual multiplier: Granite)."""
        m = self.residual_multiplier
        return x + (out if m == 1.0 else out * m)


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     fused: bool = False) -> tuple[torch.Tensor, ...]:
    """A layer's work before attention: the input norm, the q/k/v products (q/k norms) and
    RoPE."""
    q, k, v, *gate = layer.self_attn.projections(layer.normed(0, x), fused)
    if cos is None:  # a layer without RoPE (Llama 4's NoPE layers)
        return q, k, v, *gate
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, *gate


def layer_output(layer: DecoderLayer, x: torch.Tensor, attended: torch.Tensor,
                 fused: bool = False, static: bool = False) -> torch.Tensor:
    """A layer's work after attention: the output product, the norms around the MLP and
    after each block, both residual adds (static: the feed-forward's fixed-shape dispatch)."""
    x = layer.residual(x, layer.normed(1, layer.self_attn.o_proj(attended)))
    return mlp_output(layer, x, fused, static)


def mlp_output(layer: DecoderLayer, x: torch.Tensor, fused: bool = False, static: bool = False
               ) -> torch.Tensor:
    """x plus the layer's feed-forward block of x, with the norms around it."""
    return layer.residual(x, layer.normed(3, layer.mlp(layer.normed(2, x), fused, static)))


def mamba_dims(config: ModelConfig) -> Mamba2Dims:
    """The widths of config's Mamba-2 layers."""
    return Mamba2Dims(config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
                      config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                      config.rms_norm_eps, config.mamba_conv_bias, config.mamba_proj_bias)


def recurrent_dims(config: ModelConfig) -> DeltaNetDims | Mamba2Dims:
    """The widths of config's recurrent layers, of the kind it names."""
    return mamba_dims(config) if config.recurrent_mixer == "mamba2" else delta_net_dims(config)


def delta_net_dims(config: ModelConfig) -> DeltaNetDims:
    """The widths of config's Gated DeltaNet layers."""
    return DeltaNetDims(config.hidden_size, config.linear_num_key_heads,
                        config.linear_num_value_heads, config.linear_key_head_dim,
                        config.linear_value_head_dim, config.linear_conv_kernel_dim,
                        config.rms_norm_eps, config.linear_split_projections)


class LayerStages(NamedTuple):
    """The two stages of a decoder layer around its attention (which writes the cache and
    stays eager): as plain functions, or compiled (`compiled_stages`)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, ...]]
    layer_output: Callable[..., torch.Tensor]


EAGER_STAGES = LayerStages(attention_inputs, layer_output)


@functools.cache
def compiled_stages() -> LayerStages:
    """Both stages compiled by inductor over fused q/k/v and gate/up products: it fuses the
    norms, RoPE, the residual adds and SiLU-times-up into a few kernels. One compiled graph
    serves every layer (its weights are the graph's inputs), one per shape: a static step's
    bucket. Only for a model that went through `fuse_projections`."""
    # Each bucket, model width and dtype is a graph of its own: more than dynamo's default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # A row's result must not depend on its bucket: for few rows inductor splits a norm's sum
    # over blocks, which sums in another order, and in bf16 a bucket of one and one of k then
    # round apart and break the target's near-ties differently (plain and speculative greedy
    # part ways; on a 7B model with random weights at 9 tokens in 10).
    from torch._inductor import config as inductor

    inductor.split_reductions = False
    return LayerStages(
        functools.partial(torch.compile(attention_inputs, dynamic=False), fused=True),
        functools.partial(torch.compile(layer_output, dynamic=False), fused=True))


class FusedWeight(NamedTuple):
    """One weight (and bias) that several Linear layers' parameters are row slices of."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def fuse_projections(model: nn.Module) -> bool:
    """Lay each layer's q/k/v weights, and its gate/up weights, out as one tensor of which the
    original parameters become views (no extra memory; the names, state dict and training
    are unchanged), so that one product computes them (`projections(x, fused=True)`,
    `MLP.forward(x, fused=True)`). Idempotent. False, and nothing changed, where a projection
    is not a plain Linear (a quantized target's)."""
    groups = [(layer.self_attn, ("q_proj", "k_proj") if layer.self_attn.v_proj is None
               else ("q_proj", "k_proj", "v_proj")) for layer in model.layers
              if isinstance(getattr(layer, "self_attn", None), Attention)]  # not MLA's
    groups += [(layer.mlp, ("gate_proj", "up_proj")) for layer in model.layers
               if isinstance(layer.mlp, MLP)]
    if not all(type(getattr(module, name)) is Linear and
               type(getattr(module, name).weight) is nn.Parameter
               for module, names in groups for name in names):
        return False
    for module, names in groups:
        linears = [getattr(module, name) for name in names]
        if not _is_fused(getattr(module, "fused", None), linears):
            module.fused = _fused(linears)
    return True


def _fused(linears: list[nn.Linear]) -> FusedWeight:
    # Not inference tensors, even when a decode under inference_mode fuses: the parameters
    # become views of these, and training through the model (a LoRA adapter) saves them.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = (torch.cat([linear.bias for linear in linears])
                if linears[0].bias is not None else None)
    offset = 0
    for linear in linears:
        rows = slice(offset, offset + linear.out_features)
        linear.weight = nn.Parameter(weight[rows], requires_grad=linear.weight.requires_grad)
        if bias is not None:
            linear.bias = nn.Parameter(bias[rows], requires_grad=linear.bias.requires_grad)
        offset += linear.out_features
    return FusedWeight(weight, bias)


def _is_fused(fused: FusedWeight | None, linears: list[nn.Linear]) -> bool:
    """Whether each linear's weight is still its row slice of fused (not replaced since)."""
    if fused is None:
        return False
    offset, row_bytes = 0, fused.weight.stride(0) * fused.weight.element_size()
    for linear in linears:
        if linear.weight.data_ptr() != fused.weight.data_ptr() + offset * row_bytes:
            return False
        offset += linear.out_features
    return offset == fused.weight.shape[0]


def attention_mask(
    mask: torch.Tensor | None, t: int, past: int, device: torch.device
) -> torch.Tensor | None:
    """[T, past + T] bool: every cached slot, then `mask` (default causal) among the new tokens.

    A mask [T, past + T] is taken as it is (a drafter's own tree over cached draft slots), and
    so is a batch's [B, T, past + T], one per row (`selfspec.model.kv_cache.RowSlots`): it becomes
    [B, 1, T, past + T]. None means plain causal with no past, which SDPA handles with
    is_causal.
    """
    if mask is not None and mask.dim() == 3 and mask.dtype == torch.bool \
            and mask.shape[1:] == (t, past + t):
        return mask[:, None].to(device)
    if mask is None:
        if past == 0:
            return None
        mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    elif mask.dtype != torch.bool or mask.shape not in ((t, t), (t, past + t)):
        raise ValueError(
            f"mask must be a bool tensor [T, T] = [{t}, {t}] (or [T, past + T] = "
            f"[{t}, {past + t}]), got {mask.dtype} {list(mask.shape)}"
        )
    if mask.shape[1] == past + t:
        return mask.to(device)
    past_cols = torch.ones(t, past, dtype=torch.bool, device=device)
    return torch.cat([past_cols, mask.to(device)], dim=1)


def window_mask(mask: torch.Tensor | None, positions: torch.Tensor, keys: torch.Tensor,
                window: int, t: int) -> torch.Tensor:
    """A sliding layer's mask: `mask` (`attention_mask`'s, None = causal without past) where
    the key's position is within the window of the query's: key > query - window.

    positions: the queries' [T] or [B, T]; keys: the positions of the columns mask spans
    ([S] or [B, S]: `KVCache.key_positions`)."""
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    near = keys[..., None, :] > positions[..., :, None] - window  # [T, S] or [B, T, S]
    near = near.to(mask.device)
    return mask & (near[:, None] if near.dim() == 3 else near)


def chunk_mask(mask: torch.Tensor | None, positions: torch.Tensor, keys: torch.Tensor,
               chunk: int, t: int) -> torch.Tensor:
    """A chunked layer's mask (Llama 4): `mask` (`attention_mask`'s, None = causal without
    past) where the key's position lies in the query's chunk: key // chunk == query // chunk.
    positions, keys: as `window_mask` takes them."""
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    same = keys[..., None, :] // chunk == positions[..., :, None] // chunk  # [(B,) T, S]
    same = same.to(mask.device)
    return mask & (same[:, None] if same.dim() == 3 else same)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype (a host number: no tensor is made on the device)."""
    return torch.tensor(value, dtype=dtype).item()


# On CUDA the attention kernel is pinned, not left to SDPA's heuristics: with a boolean mask
# they picked cuDNN attention, which re-planned at every new KV length (~77 ms of host time per
# step on an H100). Flash attention takes no mask, so masked forwards get the memory-efficient
# kernel; the math kernel stays as the last resort for what neither fused kernel takes, so that
# no forward fails for want of a kernel. Other devices keep torch's default choice (on CPU:
# unchanged logits).
_CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CUDA_MASKED_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _kv_for_kernels(
    k: torch.Tensor, v: torch.Tensor, num_heads: int, *, repeat_heads: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """K and V [B, H_kv, S, D] as SDPA takes them, and whether they are still grouped
    (enable_gqa). CUDA's fused kernels take only as many K/V heads as query heads, so there
    (repeat_heads) each K/V head is repeated for its group: query head h reads K/V head
    h // group, as enable_gqa does. Elsewhere they stay grouped."""
    groups = num_heads // k.shape[1]
    if groups == 1:
        return k, v, False
    if not repeat_heads:
        return k, v, True
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False


def attention_kernels(device: torch.device, masked: bool) -> list[SDPBackend] | None:
    """The SDPA kernels a forward on `device` may use (None: torch's default choice)."""
    if device.type != "cuda":
        return None
    return _CUDA_MASKED_KERNELS if masked else _CUDA_KERNELS


def _pinned_attention(device: torch.device, masked: bool) -> AbstractContextManager:
    kernels = attention_kernels(device, masked)
    return nullcontext() if kernels is None else sdpa_kernel(kernels)


# ---- multi-token prediction ----------------------------------------------------------------


class MtpModule(nn.Module):
    """One multi-token-prediction module (DeepSeek-V3's NextN, Qwen3-Next's `mtp`, MiMo's):
    position t reads the embedding of token t+1 and a hidden state h_t (the target's normed
    last state, or the module's own output one step deeper), as proj(concat(embed_norm(
    embedding), hidden_norm(h_t))), runs one decoder layer of the target's kind over it (a
    mixture of experts where the target's last layer has one) and predicts token t+2.

    By layout: "nextn" (DeepSeek-V3) zeroes the embedding at position 0, hands its output on as
    it is and scores it through its own final norm and LM head (`shared_head`); "mtp"
    (Qwen3-Next) norms its output by `norm` before handing it on and scores it by the target's
    LM head; "mimo" does as "mtp" but zeroes position 0's embedding, as NextN does, and
    concatenates the hidden state first."""

    def __init__(self, config: ModelConfig, layout: str) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_norm, self.hidden_norm = rms_norm(config), rms_norm(config)
        self.proj = Linear(2 * h, h, bias=False)
        # Layer 0 of the drafter's own one-layer cache; its feed-forward is the last layer's kind.
        self.block = DecoderLayer(config, 0, linear=False)
        self.block.mlp = feed_forward(config, config.num_layers - 1)
        self.norm = rms_norm(config)
        nextn = layout == "nextn"
        self.head = Linear(h, config.vocab_size, bias=False) if nextn else None
        self.nextn, self.zeroes_first = nextn, layout in ("nextn", "mimo")
        self.hidden_first = layout == "mimo"

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                inputs: LayerInputs, cache: KVCache | None) -> torch.Tensor:
        """[B, T, h] the state handed to the next step, for embeds and hidden [B, T, h] at
        positions [T] or [B, T]."""
        if self.zeroes_first:  # DeepSeek's and MiMo's modules ignore the token at position 0
            embeds = embeds.masked_fill((positions == 0)[..., None], 0)
        pair = [self.embed_norm(embeds), self.hidden_norm(hidden)]
        x = self.proj(torch.cat(pair[::-1] if self.hidden_first else pair, dim=-1))
        x = self.block(x, inputs.cos, inputs.sin, inputs.mask, cache)
        return x if self.nextn else self.norm(x)

    def scored(self, out: torch.Tensor) -> torch.Tensor:
        """[..., h] what the LM head reads of an output: NextN norms it, Qwen3-Next's is
        normed already."""
        return self.norm(out) if self.nextn else out


def mtp_modules(config: ModelConfig) -> nn.ModuleList:
    """The MTP modules config names (an empty list without them)."""
    return nn.ModuleList(MtpModule(config, config.mtp_layout)
                         for _ in range(config.mtp_modules))


# ---- the model -----------------------------------------------------------------------------


class LayerInputs(NamedTuple):
    """What a kind of layer (full or sliding attention) reads besides the residual stream:
    RoPE's cos and sin (None: no RoPE), its attention mask and what its queries are
    multiplied by (Llama 4's NoPE layers' temperature; None: nothing)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    mask: torch.Tensor | None
    query_scale: torch.Tensor | None = None


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = rms_norm(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        sliding, linear = config.sliding_layers, config.linear_layers
        chunked, nope = config.chunked_layers, set(config.no_rope_layers)
        self.layer_kinds = tuple("sliding" if i in sliding else "linear" if i in linear
                                 else "chunked" if i in chunked else "nope" if i in nope
                                 else "full" for i in range(config.num_layers))
        # Each kind's RoPE (fp32, not buffers: model.to(bf16) must not round the frequencies).
        self.ropes = {"full": Rope.of(config)}
        self.ropes["sliding"] = (Rope.of(config, local=True) if config.local_rope
                                 else self.ropes["full"])
        # MTP modules after the last layer (empty without them): drafters run them
        self.mtp = mtp_modules(config)
        self.source: str | None = None  # the folder it was loaded from, if any
        # Layers spread over several devices (`selfspec.model.placement`); None: all on one device.
        self.placement: Placement | None = None
        # Whether its static decode steps (`selfspec.step`) run compiled, over fused products.
        self.compile_steps = False
        fp32_bytes = 4 * sum(p.numel() for p in self.parameters())
        use_packed_products(self, fp32_bytes >= PACKED_FROM_MODEL_BYTES)

    # ---- forward ---------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        *,
        mask: torch.Tensor | None = None,
        exit_layer: int | None = None,
        return_hidden: tuple[int, ...] = (),
        start_layer: int = 0,
        hidden_in: torch.Tensor | None = None,
        with_logits: bool = True,
        skip_layers: frozenset[int] | tuple[int, ...] = (),
        stages: LayerStages | None = None,
    ) -> ModelOutput:
        """Run layers [start_layer, exit_layer) over T new tokens, but those in skip_layers.

        tokens: [B, T] ids (only their shape matters when hidden_in is given).
        positions: [T] or [B, T] RoPE position ids.
        cache: with a cache, the new tokens attend to slots [0, cache.length) and, among
            themselves, to what `mask` [T, T] (True = may attend; default causal) allows; the
            layers that run write their K/V and the cache advances by T. Layers that do not
            run (below start_layer, from exit_layer on) write nothing, yet their slots count
            as advanced: filling them is the caller's job (e.g. an early-exit drafter
            truncates back and verifies with start_layer=E, hidden_in=its hidden E).
            A cache view that says `static_shapes` (a static step's `SlotView`) makes the
            forward one of fixed shapes that reads nothing back to the host: a mixture of
            experts then takes its static dispatch.
        exit_layer: early exit; logits = lm_head(norm(hidden after exit_layer layers)).
        return_hidden: layer indices l; hidden l is the residual stream after l layers
            (0 = embeddings, num_layers = last layer's output, before the final norm).
        start_layer, hidden_in: resume with hidden_in [B, T, hidden] entering start_layer.
        with_logits: False skips the final norm and LM head (a caller that only needs the
            residual streams, e.g. the early layers of an early-exit draft); logits and
            last_hidden are then None.
        skip_layers: layer indices that do not run (layer-skip drafting): the residual stream
            passes them unchanged and they write no K/V, yet their slots count as advanced,
            as for the layers outside [start_layer, exit_layer) (the drafter rolls the cache
            length back; verification then writes every layer there).
        stages: how each layer runs around its attention (default eagerly; a static step
            passes `compiled_stages()`).
        """
        end = self._check_forward_args(
            tokens, positions, exit_layer, return_hidden, start_layer, hidden_in
        )
        skip = self._checked_skip_layers(skip_layers)
        h = self.embed(tokens) if hidden_in is None else hidden_in  # [B, T, hidden]
        inputs = self._layer_inputs(positions, h.dtype, cache, mask, tokens.shape[1], h.device)
        saved = {start_layer: h}
        home = h.device
        masked = any(x.mask is not None for x in inputs.values())
        static = getattr(cache, "static_shapes", False)  # a static step's slot view
        with _pinned_attention(h.device, masked=masked):
            for i in range(start_layer, end):
                if i not in skip:
                    if self.placement is not None and self.placement.layers[i] != h.device:
                        device = self.placement.layers[i]
                        h = h.to(device)
                        inputs = {kind: LayerInputs(*_moved(device, *x))
                                  for kind, x in inputs.items()}
                    x = inputs[self.layer_kinds[i]]
                    h = self.layers[i](h, x.cos, x.sin, x.mask, cache, stages, static,
                                       x.query_scale)
                if i + 1 in return_hidden:
                    saved[i + 1] = h
        if cache is not None:
            cache.advance(tokens.shape[1])
        hidden = tuple(saved[i].to(home) for i in return_hidden)
        h = h.to(home)
        if not with_logits:
            return ModelOutput(None, hidden, None)
        last_hidden = self.norm(h)  # [B, T, hidden]
        return ModelOutput(self.logits_of(last_hidden), hidden, last_hidden)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] the decoder's input: the embedding of tokens [B, T], times the
        embedding multiplier rounded to the model's dtype (Gemma, Granite)."""
        h = self.embed_tokens(tokens)
        multiplier = self.config.embedding_multiplier
        return h if multiplier is None else h * _rounded(multiplier, h.dtype)

    def logits_of(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[..., V] fp32 logits of normed states [..., hidden]: the LM head and
        `final_logits`."""
        return self.final_logits(self.lm_head(last_hidden)).float()

    def final_logits(self, scores: torch.Tensor) -> torch.Tensor:
        """What the family does to the LM head's scores (any rows of it), in their dtype as
        transformers does: the logit scaling (Granite), the final soft-capping (Gemma 2)."""
        cap, scaling = self.config.final_logit_softcapping, self.config.logits_scaling
        if scaling != 1.0:
            scores = scores / scaling
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        return scores

    def mtp_forward(self, index: int, embeds: torch.Tensor, hidden: torch.Tensor,
                    positions: torch.Tensor, cache: KVCache | None = None,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, h] MTP module `index`'s outputs for embeds (the embedding table's rows of
        tokens t+1, unscaled) and hidden states h_t [B, T, h] at positions [T] or [B, T];
        with a one-layer cache the rows attend to its slots and, among themselves, to what
        mask (default causal) allows, and it advances by T."""
        if not is_int_in(index, range(len(self.mtp))):
            raise ValueError(f"mtp_forward: index must be in 0..{len(self.mtp) - 1} (the "
                             f"model's {len(self.mtp)} MTP modules), got {index!r}")
        t = embeds.shape[1]
        past = 0 if cache is None else cache.length
        inputs = LayerInputs(*self._rope("full", positions, embeds.dtype),
                             attention_mask(mask, t, past, embeds.device))
        out = self.mtp[index](embeds, hidden, positions, inputs, cache)
        if cache is not None:
            cache.advance(t)
        return out

    def mtp_logits(self, index: int, out: torch.Tensor) -> torch.Tensor:
        """[..., V] fp32 scores of MTP module `index`'s outputs [..., h]: through its own LM head
        (NextN) or the target's, then what the family does to logits (`final_logits`)."""
        module = self.mtp[index]
        head = self.lm_head if module.head is None else module.head
        return self.final_logits(head(module.scored(out))).float()

    def _layer_inputs(self, positions: torch.Tensor, dtype: torch.dtype, cache,
                      mask: torch.Tensor | None, t: int, device: torch.device
                      ) -> dict[str, LayerInputs]:
        """Each kind of layer's RoPE and mask: the full layers' mask from `mask`
        (`attention_mask`), the sliding layers' that mask within the window, the linear
        layers' the parents of the new rows (`recurrent.parents_of`)."""
        past = 0 if cache is None else cache.length
        full = attention_mask(mask, t, past, device)
        inputs = {"full": LayerInputs(*self._rope("full", positions, dtype), full)}
        if "sliding" in self.layer_kinds:
            keys = positions if cache is None else cache.key_positions(positions)
            window = window_mask(full, positions, keys, self.config.sliding_window, t)
            inputs["sliding"] = LayerInputs(*self._rope("sliding", positions, dtype), window)
        if "chunked" in self.layer_kinds:  # Llama 4's local layers
            keys = positions if cache is None else cache.key_positions(positions)
            chunk = chunk_mask(full, positions, keys, self.config.attention_chunk_size, t)
            inputs["chunked"] = LayerInputs(*self._rope("full", positions, dtype), chunk)
        if "nope" in self.layer_kinds:  # Llama 4's: no RoPE, the queries' temperature
            inputs["nope"] = LayerInputs(None, None, full, self._temperature(positions))
        if "linear" in self.layer_kinds:  # no RoPE; each new row's parent in place of a mask
            columns = getattr(cache, "new_slots", None)  # a batch's rows at their lengths
            inputs["linear"] = LayerInputs(None, None, parents_of(mask, t, device, columns))
        return inputs

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[B or 1, 1, T, 1] fp32 what a NoPE layer's queries at positions [T] or [B, T] are
        multiplied by: 1 + scale * ln(1 + floor((p + 1) / floor_scale)) (Llama 4), or None."""
        c = self.config
        if not c.temperature_tuning:
            return None
        scale = torch.log1p(torch.floor((positions.float() + 1) / c.temperature_floor_scale)
                            ) * c.temperature_scale + 1.0
        return scale[None, None, :, None] if positions.dim() == 1 else scale[:, None, :, None]

    def _checked_skip_layers(self, skip_layers: frozenset[int] | tuple[int, ...]
                             ) -> frozenset[int]:
        """skip_layers as a set of layer ids in [0, num_layers), or a clear error."""
        n = self.config.num_layers
        try:
            skip = frozenset(skip_layers)
        except TypeError:
            raise ValueError(f"skip_layers must be a set or tuple of layer ids, "
                             f"got {skip_layers!r}") from None
        bad = sorted((i for i in skip if not is_int_in(i, range(n))), key=str)
        if bad:
            raise ValueError(f"skip_layers must be layer ids in [0, {n}) (the model's layers), "
                             f"got {bad}")
        return skip

    def _rope(self, kind: str, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ropes[kind].cos_sin(positions, dtype)

    def _check_forward_args(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        exit_layer: int | None,
        return_hidden: tuple[int, ...],
        start_layer: int,
        hidden_in: torch.Tensor | None,
    ) -> int:
        """Validate shapes and the layer range; returns the exclusive end layer."""
        n = self.config.num_layers
        end = n if exit_layer is None else exit_layer
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {list(tokens.shape)}")
        if positions.shape not in (tokens.shape[1:], tokens.shape):
            raise ValueError(
                f"positions must be [T] or [B, T] for tokens {list(tokens.shape)}, "
                f"got {list(positions.shape)}"
            )
        if not 0 <= start_layer <= end <= n:
            raise ValueError(
                f"need 0 <= start_layer <= exit_layer <= num_layers ({n}), "
                f"got start_layer={start_layer}, exit_layer={exit_layer}"
            )
        if start_layer > 0 and hidden_in is None:
            raise ValueError("start_layer > 0 needs hidden_in (the residual entering it)")
        if hidden_in is not None and hidden_in.shape != (*tokens.shape, self.config.hidden_size):
            raise ValueError(
                f"hidden_in must be [B, T, hidden] = {[*tokens.shape, self.config.hidden_size]}, "
                f"got {list(hidden_in.shape)}"
            )
        bad = [i for i in return_hidden if not start_layer <= i <= end]
        if bad:
            raise ValueError(f"return_hidden {bad} outside the layers run [{start_layer}, {end}]")
        return end

    # ---- caches and loading ----------------------------------------------------------------

    def new_cache(
        self, batch_size: int = 1, max_slots: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache | SegmentedKVCache | HybridCache:
        """A KVCache for this model; max_slots defaults to max_position_embeddings, which for
        long-context models is a lot of memory: pass what the generation actually needs."""
        weight = self.embed_tokens.weight
        heads, key_dim, value_dim = self.config.cache_dims  # MLA: its roped key and latent
        sizes = (batch_size, heads, max_slots or self.config.max_position_embeddings, key_dim)
        if self.config.linear_layers:
            return self._hybrid_cache(sizes, dtype or weight.dtype)
        if self.placement is not None and self.placement.spans_devices:
            return SegmentedKVCache([
                (first, KVCache(end - first, *sizes, dtype=dtype or weight.dtype, device=device,
                                value_dim=value_dim))
                for first, end, device in self.placement.segments()])
        return KVCache(self.config.num_layers, *sizes, dtype=dtype or weight.dtype,
                       device=weight.device, value_dim=value_dim)

    def _hybrid_cache(self, sizes: tuple[int, ...], dtype: torch.dtype) -> HybridCache:
        """A hybrid target's cache: K/V for its attention layers, the state of its linear
        ones."""
        if self.placement is not None and self.placement.spans_devices:
            raise ValueError("a recurrent target placed over several devices is not supported "
                             "yet; place it on one device")
        device = self.embed_tokens.weight.device
        linear = sorted(self.config.linear_layers)
        attention = [i for i in range(self.config.num_layers) if i not in linear]
        kv = KVCache(len(attention), *sizes, dtype=dtype, device=device)
        state = RecurrentState(linear, sizes[0], recurrent_dims(self.config), dtype=dtype,
                               device=device)
        return HybridCache(kv, state, attention)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        placement: Placement | None = None,
    ) -> Transformer:
        """Load a local HF model folder: config.json + model.safetensors (or sharded).
        placement: each tensor read straight onto its device (`selfspec.model.placement`); device
        is then ignored."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder not found: {folder}")
        config = checkpoint.with_mtp_layout(ModelConfig.from_folder(folder), folder)
        read_to = "cpu" if placement is not None else device
        model = cls._from_tensors(config, checkpoint.read_tensors(folder, read_to), dtype,
                                  device, placement)
        model.source = str(folder)
        return model

    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write a Hugging Face folder (config.json + model.safetensors, HF names) that
        `from_pretrained` and transformers' `AutoModelForCausalLM` both load."""
        state = {name: tensor.detach().to(dtype or tensor.dtype)
                 for name, tensor in self.state_dict().items()}
        return checkpoint.write_folder(folder, state, self.config,
                                       dtype or self.embed_tokens.weight.dtype)

    def first_layers(self, num_layers: int) -> Transformer:
        """A copy of this model cut after its first num_layers layers, keeping the embedding,
        final norm and LM head: the starting point of a draft model (LayerSkip's early exit
        made a separate model)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"first_layers: num_layers must be in 1..{self.config.num_layers} "
                             f"(the model's layers), got {num_layers}")
        config = self.config.cut(num_layers)
        state = {name: tensor for name, tensor in self.state_dict().items()
                 if not name.startswith(("layers.", "mtp."))
                 or (name.startswith("layers.") and int(name.split(".")[1]) < num_layers)}
        # under the family's checkpoint names and layouts, which _from_tensors reads
        tensors = iter(checkpoint.hf_state({k: v.clone() for k, v in state.items()},
                                           config).items())
        weight = self.embed_tokens.weight
        return self._from_tensors(config, tensors, weight.dtype, weight.device)

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Transformer:
        """Convert an in-memory `transformers` model. Without a dtype/device change the
        weights share storage with hf_model (no copy)."""
        state = hf_model.state_dict()
        config = checkpoint.mtp_as_stored(ModelConfig.from_hf(hf_model.config.to_dict()), state)
        first = next(iter(state.values()))
        return cls._from_tensors(
            config, iter(state.items()), dtype or first.dtype, device or first.device
        )

    @classmethod
    def _from_tensors(
        cls,
        config: ModelConfig,
        tensors: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device | str,
        placement: Placement | None = None,
    ) -> Transformer:
        """Build on the meta device, then adopt the HF-named tensors (assign=True, no copy),
        each on its device: `device`, or where `placement` puts it."""
        with torch.device("meta"):
            model = cls(config)
        state = {}
        for key, ours in checkpoint.our_state(tensors, config):
            on = device if placement is None else placement.device_of(key)
            state[key] = aligned(ours.to(device=on, dtype=dtype))
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            missing = [key for key in missing if key != "lm_head.weight"]
            model.lm_head.weight = model.embed_tokens.weight
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the {config.model_type} architecture: "
                f"missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        model.placement = placement
        return model
