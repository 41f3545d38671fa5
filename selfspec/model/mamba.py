"""Mamba-2, the recurrent layer of Bamba (IBM's Mamba-2 / attention hybrid), with a state per
new row as `selfspec.model.recurrent` keeps Gated DeltaNet's: each row continues its parent's
convolution window and state (a tree's node its parent's, a chain's row the one before), and
the cache (`selfspec.model.recurrent_cache`) commits the accepted row's.

Per head h of dimension P, with a state of N per head dimension: dt = softplus(dt + dt_bias),
state = exp(dt * A) * state + dt * x B^T (B, C shared by the heads of a group), y = state C + D
x; the heads' outputs are gated by SiLU(z) and normed per group of channels. Every row runs
this step (transformers' recurrent form); its chunked scan is not used. Names mirror
transformers' `BambaMixer` (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model.cpu_linear import Linear
from selfspec.model.recurrent import (
    LayerState,
    RowStates,
    Snapshots,
    chain_parents,
    keeps_every_row,
    path_convolution,
)


@dataclass(frozen=True)
class Mamba2Dims:
    """The widths of a Mamba-2 layer (config.json's mamba_* keys)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba_n_heads ({self.num_heads}) must be a multiple of "
                             f"mamba_n_groups ({self.num_groups})")
        if self.conv_kernel < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {self.conv_kernel}")

    @property
    def inner(self) -> int:
        """The heads' channels: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: x, B and C side by side."""
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, ...]:
        """A row's recurrent state: [H, P, N]."""
        return self.num_heads, self.head_dim, self.state_size


class GroupedGatedNorm(nn.Module):
    """x times SiLU(z), then RMS-normed over each of the groups' channels, times the weight
    (in fp32, cast back before the weight: transformers' BambaRMSNormGated)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float() * F.silu(gate.float())
        grouped = x32.view(*x32.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(x32).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 token mixer: [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, dims: Mamba2Dims) -> None:
        super().__init__()
        d = self.dims = dims
        self.in_proj = Linear(d.hidden_size, d.inner + d.conv_dim + d.num_heads,
                              bias=d.proj_bias)
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim,
                                bias=d.conv_bias, padding=d.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(d.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d.num_heads + 1).float()))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        self.norm = GroupedGatedNorm(d.inner, d.num_groups, d.eps)
        self.out_proj = Linear(d.inner, d.hidden_size, bias=d.proj_bias)

    def forward(self, x: torch.Tensor, parents: torch.Tensor | None,
                state: LayerState | None = None) -> torch.Tensor:
        """As `GatedDeltaNet.forward`: parents [B, T] or None (causal); state: the layer's
        cache (None: from zeros, nothing kept)."""
        d = self.dims
        batch, t, _ = x.shape
        every = keeps_every_row(parents, t)
        parents = chain_parents(batch, t, x.device) if parents is None else parents
        if state is None:
            windows = x.new_zeros(batch, d.conv_dim, d.conv_kernel - 1)
            states = torch.zeros(batch, *d.state_shape, device=x.device)
        else:
            windows, states = state.committed()
        gate, mixed, dt = self.in_proj(x).split((d.inner, d.conv_dim, d.num_heads), dim=-1)
        conv_out, all_windows = path_convolution(mixed, self.conv1d.weight[:, 0],
                                                 self.conv1d.bias, RowStates(windows, t, every),
                                                 parents)
        heads, b, c = conv_out.split((d.inner, d.num_groups * d.state_size,
                                      d.num_groups * d.state_size), dim=-1)
        out, all_states = self._scan(heads.view(batch, t, d.num_heads, d.head_dim),
                                     b.view(batch, t, d.num_groups, d.state_size),
                                     c.view(batch, t, d.num_groups, d.state_size), dt,
                                     RowStates(states.float(), t, every), parents)
        if state is not None:
            state.record(Snapshots(all_windows, all_states, t))
        return self.out_proj(self.norm(out.reshape(batch, t, d.inner), gate))

    def _scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
              states: RowStates, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selective state update, one row at a time from its parent's state: x
        [B, T, H, P], b and c [B, T, G, N], dt [B, T, H]; the outputs [B, T, H, P] in x's
        dtype and the states kept ([B, T + 1, H, P, N], fp32)."""
        d = self.dims
        per_group = d.num_heads // d.num_groups
        b, c = (t.repeat_interleave(per_group, dim=2).float() for t in (b, c))  # [B, T, H, N]
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).float()  # [B, T, H]
        decay = torch.exp(dt * -torch.exp(self.A_log.float()))
        x32 = x.float()
        out = x32.new_empty(x32.shape)
        rows = torch.arange(x.shape[0], device=x.device)
        for i in range(x.shape[1]):
            state = states.before(parents[:, i], rows) * decay[:, i, :, None, None]
            written = (dt[:, i, :, None] * b[:, i])[:, :, None, :] * x32[:, i, :, :, None]
            state = state + written  # [B, H, P, N]
            out[:, i] = (state @ c[:, i, :, :, None])[..., 0] + x32[:, i] * self.D[:, None]
            states.after(i, state)
        return out.to(x.dtype), states.kept()
