"""Rotary position embeddings (RoPE) as `ModelConfig` describes them: the base theta, a
scaling (linear, llama3, yarn, longrope, Gemma 4's proportional share of the frequency pairs),
the share of each head's dimensions rotated (`partial_rotary_factor`), and a second RoPE for
the sliding layers where a family has one (Gemma 3, Gemma 4).
HF's half-split layout, not interleaved; frequencies in fp32 as transformers
computes them."""

from __future__ import annotations

import math

import torch

from selfspec.model.config import ModelConfig


class Rope:
    """One kind of layer's RoPE: fp32 inverse frequencies [rotary_dim / 2] (a plain attribute,
    not a buffer, so that model.to(bf16) does not round them), the factor cos and sin are
    scaled by (yarn, longrope) and, for longrope, the frequencies of positions from
    `long_from` on."""

    def __init__(self, inv_freq: torch.Tensor, factor: float = 1.0,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None
                 ) -> None:
        self.inv_freq, self.factor = inv_freq, factor
        self.long_inv_freq, self.long_from = long_inv_freq, long_from

    @classmethod
    def of(cls, config: ModelConfig, local: bool = False) -> Rope:
        """The RoPE of config's full layers, or (local) of its sliding ones (on the CPU, even
        while a model is built on the meta device)."""
        with torch.device("cpu"):
            return cls._of(config, local)

    @classmethod
    def _of(cls, config: ModelConfig, local: bool) -> Rope:
        theta, scaling = config.local_rope if local else (config.rope_theta,
                                                          config.rope_scaling)
        dim = config.rotary_dim
        if not local and config.full_head_dim is not None:  # Gemma 4's wider full layers
            dim = int(config.full_head_dim * config.partial_rotary_factor)
        base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "default":
            return cls(base)
        if kind == "linear":
            return cls(base / scaling["factor"])
        if kind == "llama3":
            return cls(_llama3_inv_freq(base, scaling))
        if kind == "proportional":
            return cls(_proportional_inv_freq(base, scaling))
        if kind == "yarn":
            return cls(*_yarn(theta, dim, scaling, config.max_position_embeddings))
        return _longrope(cls, theta, dim, scaling, config.max_position_embeddings)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B or 1, 1, T, rotary_dim] at positions [T] or [B, T], on their device."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, dtype, self.factor)
        if self.long_inv_freq is None:
            return cos, sin
        if self.long_inv_freq.device != positions.device:
            self.long_inv_freq = self.long_inv_freq.to(positions.device)
        long_cos, long_sin = rope_cos_sin(self.long_inv_freq, positions, dtype, self.factor)
        # Each row by its own position (a tensor op: no host read), so that a row's RoPE does
        # not depend on the rows it is computed with.
        far = (positions >= self.long_from)[..., None]  # [..., T, 1]
        far = far[None, None] if positions.dim() == 1 else far[:, None]
        return torch.where(far, long_cos, cos), torch.where(far, long_sin, sin)


def _proportional_inv_freq(base: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Gemma 4's full layers: the first partial_rotary_factor of the pairs keep their
    frequencies (of the whole head_dim), the others get 0 (cos 1, sin 0: left as they are);
    every frequency divided by factor."""
    kept = int(scaling["partial_rotary_factor"] * 2 * len(base) // 2)
    inv_freq = torch.cat([base[:kept], torch.zeros(len(base) - kept)])
    return inv_freq / scaling.get("factor", 1.0)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B or 1, 1, T, D] for positions [T] or [B, T] (inv_freq [D/2] on their
    device), each scaled by factor."""
    freqs = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [..., T, D]
    angles = angles[None, None] if positions.dim() == 1 else angles[:, None]
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def interleaved_rope(x: torch.Tensor) -> torch.Tensor:
    """x's last dims, that RoPE rotates as adjacent pairs (DeepSeek's and Llama 4's layout),
    laid out as the half-split RoPE takes them: evens then odds. Queries and keys alike, so
    their products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin broadcastable to its first rotary_dim dimensions (the rest
    pass unrotated: partial rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, rest), dim=-1)


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


def _yarn(theta: float, dim: int, scaling: dict, max_positions: int
          ) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate the low frequencies by `factor`, keep the high
    ones, ramp between the dimensions whose wavelengths fit beta_fast and beta_slow times in
    the original context; cos and sin scaled by the attention factor (mscale)."""
    factor = scaling["factor"]
    old_context = scaling.get("original_max_position_embeddings") or max_positions
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    wavelengths = theta ** (torch.arange(0, dim, 2).float() / dim)  # over 2 pi
    return (1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept,
            float(attention))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope(cls: type[Rope], theta: float, dim: int, scaling: dict, max_positions: int
              ) -> Rope:
    """LongRoPE (Phi-3): per-dimension rescaling factors, `short_factor` within the original
    context and `long_factor` beyond it; cos and sin scaled by the attention factor."""
    old_context = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_context
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor)
                                                       / math.log(old_context))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(factors) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)

    # transformers switches to the long factors once a forward reaches past the original
    # context; here each position beyond it does (the same in one-token steps).
    return cls(inv_freq(scaling["short_factor"]), float(attention),
               inv_freq(scaling["long_factor"]), old_context)
