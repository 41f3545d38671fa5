"""A compact decoder for the Llama family: Llama 1/2/3.x, Mistral, Qwen2/2.5.

Module names mirror Hugging Face's, so a HF state dict loads once its leading "model." is
stripped. What differs between the families is all in `ModelConfig`: grouped-query attention
(num_kv_heads < num_heads), q/k/v bias (Qwen2), tied embeddings, RoPE scaling (linear, llama3).

Attention is always full (causal or masked). Mistral's and Qwen2's sliding windows are ignored,
which is exact as long as the context is shorter than the window (4096+ tokens).

The forward takes RoPE positions apart from cache slots (see `selfspec.model.kv_cache`), an optional
[T, T] attention mask among the new tokens (tree verification), and can run a slice of the
layers: `exit_layer` for LayerSkip-style early exit, `start_layer` + `hidden_in` to resume,
`skip_layers` to leave a set of layers out (layer-skip drafting: Draft & Verify, SWIFT).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from selfspec.model import checkpoint
from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import PACKED_FROM_MODEL_BYTES, Linear, aligned, use_packed_products
from selfspec.model.kv_cache import KVCache, SegmentedKVCache
from selfspec.model.placement import Placement


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] fp32 RoPE inverse frequencies, scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by `factor`, keep high ones, blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than old_context / low are stretched; shorter than old_context / high kept.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as HF does) so bf16 weights give the same result.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B or 1, 1, T, D] for positions [T] or [B, T] (inv_freq [D/2] on their device)."""
    freqs = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [..., T, D]
    angles = angles[None, None] if positions.dim() == 1 else angles[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin broadcastable to it (HF's half-split layout, not interleaved)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """input_size: the width of what q, k and v read (default hidden_size; EAGLE-3's head reads
    its feature and embedding side by side, 2 x hidden)."""

    def __init__(self, config: ModelConfig, layer_idx: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        bias, width = config.attention_bias, input_size or config.hidden_size
        self.q_proj = Linear(width, q_dim, bias=bias)
        self.k_proj = Linear(width, kv_dim, bias=bias)
        self.v_proj = Linear(width, kv_dim, bias=bias)
        self.o_proj = Linear(q_dim, config.hidden_size, bias=config.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, input_size]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,  # [T, S] bool, None = causal without past
        cache: KVCache | None,
    ) -> torch.Tensor:
        q, k, v = self.projections(x)
        attended = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, attn_mask,
                               cache)
        return self.o_proj(attended)

    def projections(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, ...]:
        """q [B, H, T, D], k and v [B, H_kv, T, D] of x [B, T, input_size]; fused: as one
        product over the weight that `fuse_projections` made q/k/v views of."""
        batch, t, _ = x.shape
        if fused:
            q_dim, kv_dim = self.q_proj.out_features, self.k_proj.out_features
            q, k, v = F.linear(x, self.fused.weight, self.fused.bias).split(
                (q_dim, kv_dim, kv_dim), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v.view(batch, t, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """[B, T, H * D]: the new rows' attention over the cache (where k and v are written
        first) and themselves, before the output product."""
        batch, _, t, _ = q.shape
        if cache is not None:
            k, v = cache.write(self.layer_idx, k, v)  # [B, H_kv, S, D]
        k, v, grouped = _kv_for_kernels(k.to(q.dtype), v.to(q.dtype), self.num_heads,
                                        repeat_heads=q.is_cuda)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=grouped
        )  # [B, H, T, D]
        return out.transpose(1, 2).reshape(batch, t, -1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fused: gate and up as one product over the weight `fuse_projections` made them
        views of."""
        if fused:
            gate, up = F.linear(x, self.fused.weight, self.fused.bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """input_norm=False drops the input RMSNorm (EAGLE-1's head layer reads its fc output as is;
    it then has no `input_layernorm` weight)."""

    def __init__(self, config: ModelConfig, layer_idx: int, *, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm
                                else nn.Identity())
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None,
        stages: LayerStages | None = None,
    ) -> torch.Tensor:
        """stages: how the pointwise-heavy work around attention runs (default eagerly)."""
        stages = stages or EAGER_STAGES
        q, k, v = stages.attention_inputs(self, x, cos, sin)
        return stages.layer_output(self, x, self.self_attn.attend(q, k, v, attn_mask, cache))


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     fused: bool = False) -> tuple[torch.Tensor, ...]:
    """A layer's work before attention: the input norm, the q/k/v products and RoPE."""
    q, k, v = layer.self_attn.projections(layer.input_layernorm(x), fused)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(layer: DecoderLayer, x: torch.Tensor, attended: torch.Tensor,
                 fused: bool = False) -> torch.Tensor:
    """A layer's work after attention: the output product, both residual adds, the second
    norm and the MLP."""
    x = x + layer.self_attn.o_proj(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x), fused)


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
    groups = [(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in model.layers]
    groups += [(layer.mlp, ("gate_proj", "up_proj")) for layer in model.layers]
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


# ---- the model -----------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # A plain fp32 attribute, not a buffer: model.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(config)  # [D/2]
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
        h = self.embed_tokens(tokens) if hidden_in is None else hidden_in  # [B, T, hidden]
        cos, sin = self._rope(positions, h.dtype)
        past = 0 if cache is None else cache.length
        attn_mask = attention_mask(mask, tokens.shape[1], past, h.device)
        saved = {start_layer: h}
        home = h.device
        with _pinned_attention(h.device, masked=attn_mask is not None):
            for i in range(start_layer, end):
                if i not in skip:
                    if self.placement is not None and self.placement.layers[i] != h.device:
                        h, cos, sin, attn_mask = _moved(self.placement.layers[i], h, cos, sin,
                                                        attn_mask)
                    h = self.layers[i](h, cos, sin, attn_mask, cache, stages)
                if i + 1 in return_hidden:
                    saved[i + 1] = h
        if cache is not None:
            cache.advance(tokens.shape[1])
        hidden = tuple(saved[i].to(home) for i in return_hidden)
        h = h.to(home)
        if not with_logits:
            return ModelOutput(None, hidden, None)
        last_hidden = self.norm(h)  # [B, T, hidden]
        logits = self.lm_head(last_hidden).float()  # [B, T, V]
        return ModelOutput(logits, hidden, last_hidden)

    def _checked_skip_layers(self, skip_layers: frozenset[int] | tuple[int, ...]
                             ) -> frozenset[int]:
        """skip_layers as a set of layer ids in [0, num_layers), or a clear error."""
        n = self.config.num_layers
        try:
            skip = frozenset(skip_layers)
        except TypeError:
            raise ValueError(f"skip_layers must be a set or tuple of layer ids, "
                             f"got {skip_layers!r}") from None
        bad = sorted((i for i in skip if isinstance(i, bool) or not isinstance(i, int)
                      or not 0 <= i < n), key=str)
        if bad:
            raise ValueError(f"skip_layers must be layer ids in [0, {n}) (the model's layers), "
                             f"got {bad}")
        return skip

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_cos_sin(self.inv_freq, positions, dtype)

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
    ) -> KVCache:
        """A KVCache for this model; max_slots defaults to max_position_embeddings, which for
        long-context models is a lot of memory: pass what the generation actually needs."""
        weight = self.embed_tokens.weight
        sizes = (batch_size, self.config.num_kv_heads,
                 max_slots or self.config.max_position_embeddings, self.config.head_dim)
        if self.placement is not None and self.placement.spans_devices:
            return SegmentedKVCache([
                (first, KVCache(end - first, *sizes, dtype=dtype or weight.dtype, device=device))
                for first, end, device in self.placement.segments()])
        return KVCache(self.config.num_layers, *sizes, dtype=dtype or weight.dtype,
                       device=weight.device)

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
        config = ModelConfig.from_folder(folder)
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
        config = replace(self.config, num_layers=num_layers)
        state = {name: tensor for name, tensor in self.state_dict().items()
                 if not name.startswith("layers.") or int(name.split(".")[1]) < num_layers}
        tensors = ((checkpoint.hf_key(k), v.clone()) for k, v in state.items())
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
        config = ModelConfig.from_hf(hf_model.config.to_dict())
        state = hf_model.state_dict()
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
        for name, tensor in tensors:
            key = checkpoint.our_key(name, config.tie_word_embeddings)
            if key is not None:
                on = device if placement is None else placement.device_of(key)
                state[key] = aligned(tensor.to(device=on, dtype=dtype))
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
