"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5, written so that a
verification forward keeps the layer's state after every row it feeds.

A recurrent layer reads its whole history through a fixed-size state: the last K - 1 inputs
of its causal depthwise convolution and a [H, Dk, Dv] matrix per value head updated by the
gated delta rule. A rejected draft token must leave no trace in either, and neither can be
truncated like a KV cache. So the layer computes the state after each of the T new rows
(a *snapshot*, row 0 being the state the forward started from) and hands them all to the cache
(`selfspec.model.recurrent_cache`), which keeps the one after the last accepted row.

The new rows form paths: row i continues its *parent* (the last earlier row it sees; none: the
committed history), so a tree forward gives each node its parent's state advanced by its own
token, and a chain is the path 0, 1, ..., T - 1. `parents_of` reads the parents off the
forward's mask and refuses a mask that is not a forest of paths (a recurrent layer cannot skip
a row it saw).

Every row runs the delta rule token by token (transformers' recurrent form, one step per row),
so a row's arithmetic is the same in a one-token step and in a verification of many; the
chunked scan, faster over long prompts, is not used.

Names mirror transformers' `Qwen3NextGatedDeltaNet` (in_proj_qkvz, in_proj_ba, conv1d, dt_bias,
A_log, norm, out_proj; Qwen3.5's `Qwen3_5GatedDeltaNet` splits the input products into
in_proj_qkv, in_proj_z, in_proj_b and in_proj_a: `DeltaNetDims.split_projections`), so their
checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model.cpu_linear import Linear

# transformers' l2norm of q and k inside the kernel (FLA's constant)
_L2_EPS = 1e-6
# A causal forward (no mask: a prefill, a draft model's feed) over more rows than this keeps
# only the states before and after it: every row's state of a long prompt would outweigh the
# model (at Qwen3-Next's widths 72 MiB a row over its 36 such layers). A forward under a mask
# (a verification's chain or tree, a batch's) keeps every row's.
MAX_SNAPSHOT_ROWS = 16


@dataclass(frozen=True)
class DeltaNetDims:
    """The widths of a Gated DeltaNet layer (config.json's linear_* keys)."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float
    # Qwen3.5: q, k, v | z | b | a as four products, each laid out head after head; else
    # Qwen3-Next's two, grouped by key head ([q, k, v, z] and [b, a] per key head)
    split_projections: bool = False

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_value_heads // self.num_key_heads

    @property
    def state_shape(self) -> tuple[int, ...]:
        """A row's recurrent state: [Hv, Dk, Dv]."""
        return self.num_value_heads, self.key_head_dim, self.value_head_dim


@dataclass
class Snapshots:
    """A recurrent layer's states over one forward of `rows` new rows, row 0 the state it
    started from and row i + 1 the state after new row i: the convolution's last K - 1 inputs
    windows [B, R, C, K - 1] and the recurrence's states [B, R, *state_shape] (fp32), with
    R = rows + 1, or R = 2 (the first and the last) for a long causal forward
    (MAX_SNAPSHOT_ROWS)."""

    windows: torch.Tensor
    states: torch.Tensor
    rows: int

    def index(self, row: int) -> int:
        """Where the state after `row` rows is held, or a ValueError if it was not kept."""
        if self.states.shape[1] == self.rows + 1:
            return row
        if row in (0, self.rows):
            return 0 if row == 0 else 1
        raise ValueError(f"a causal forward of {self.rows} rows (more than "
                         f"{MAX_SNAPSHOT_ROWS}) keeps only the states before and after it; "
                         f"roll back to one of those")


class RowStates:
    """The states a forward builds, row by row: every row's (a row reads its parent's), or,
    for a long chain, the first and the running one."""

    def __init__(self, first: torch.Tensor, t: int, every: bool) -> None:
        self.every, self.first, self.last = every, first, first
        if every:
            self.all = first.new_empty(first.shape[0], t + 1, *first.shape[1:])
            self.all[:, 0] = first

    def before(self, parents: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
        """The state each batch row's next row starts from (parents [B]: its parent)."""
        return self.all[batch_rows, parents + 1] if self.every else self.last

    def after(self, i: int, state: torch.Tensor) -> None:
        if self.every:
            self.all[:, i + 1] = state
        self.last = state

    def kept(self) -> torch.Tensor:
        return self.all if self.every else torch.stack([self.first, self.last], dim=1)


class RecurrentDims(Protocol):
    """What a recurrent layer's cache is sized by (`DeltaNetDims`, `mamba.Mamba2Dims`)."""

    @property
    def conv_dim(self) -> int: ...

    @property
    def conv_kernel(self) -> int: ...

    @property
    def state_shape(self) -> tuple[int, ...]: ...


class LayerState(Protocol):
    """What a recurrent layer reads and writes of its cache (`RecurrentState.layer`)."""

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before the forward: windows [B, C, K - 1] and states
        [B, *state_shape]."""
        ...

    def record(self, snapshots: Snapshots) -> None:
        """The forward's snapshots, kept until the cache advances, truncates or commits."""
        ...


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output (weight times the normalised input, cast back),
    times SiLU of the output gate z, in fp32 (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer: [B, T, hidden] -> [B, T, hidden]."""

    def __init__(self, dims: DeltaNetDims) -> None:
        super().__init__()
        self.dims = dims
        d = dims
        if d.split_projections:
            self.in_proj_qkv = Linear(d.hidden_size, d.conv_dim, bias=False)
            self.in_proj_z = Linear(d.hidden_size, d.value_dim, bias=False)
            self.in_proj_b = Linear(d.hidden_size, d.num_value_heads, bias=False)
            self.in_proj_a = Linear(d.hidden_size, d.num_value_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(d.hidden_size, 2 * d.key_dim + 2 * d.value_dim,
                                       bias=False)
            self.in_proj_ba = Linear(d.hidden_size, 2 * d.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim,
                                bias=False, padding=d.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(d.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_value_heads))
        self.norm = GatedRMSNorm(d.value_head_dim, d.eps)
        self.out_proj = Linear(d.value_dim, d.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, parents: torch.Tensor | None,
                state: LayerState | None = None) -> torch.Tensor:
        """x [B, T, hidden]; parents [B, T] (`parents_of`; None: a causal forward, each row
        continuing the one before); state: the layer's cache, whose committed state the rows
        continue (None: they start from zeros and nothing is kept)."""
        d = self.dims
        batch, t, _ = x.shape
        every = keeps_every_row(parents, t)
        parents = chain_parents(batch, t, x.device) if parents is None else parents
        windows, states = (self._zero_state(batch, x) if state is None else state.committed())
        mixed, z, beta, decay = self._inputs(x)  # mixed [B, T, C]
        conv_out, all_windows = path_convolution(mixed, self.conv1d.weight[:, 0], None,
                                                 RowStates(windows, t, every), parents)
        q, k, v = conv_out.split((d.key_dim, d.key_dim, d.value_dim), dim=-1)
        out, all_states = delta_rule(
            q.reshape(batch, t, d.num_key_heads, d.key_head_dim),
            k.reshape(batch, t, d.num_key_heads, d.key_head_dim),
            v.reshape(batch, t, d.num_value_heads, d.value_head_dim),
            decay, beta, RowStates(states.float(), t, every), parents)
        if state is not None:
            state.record(Snapshots(all_windows, all_states, t))
        normed = self.norm(out.reshape(-1, d.value_head_dim), z.reshape(-1, d.value_head_dim))
        return self.out_proj(normed.reshape(batch, t, d.value_dim))

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x [B, T, hidden]: the convolution's input [B, T, C] (q, k, v),
        the output gate z [B, T, Hv, Dv], beta and the log decay [B, T, Hv] (fp32 decay)."""
        d = self.dims
        batch, t, _ = x.shape
        if d.split_projections:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        else:  # from the per-key-head layout
            qkvz = self.in_proj_qkvz(x).view(batch, t, d.num_key_heads, -1)
            ba = self.in_proj_ba(x).view(batch, t, d.num_key_heads, 2 * d.group)
            q, k, v, z = qkvz.split((d.key_head_dim, d.key_head_dim,
                                     d.group * d.value_head_dim, d.group * d.value_head_dim),
                                    dim=3)
            b, a = ba.split((d.group, d.group), dim=3)
            mixed = torch.cat([q.reshape(batch, t, -1), k.reshape(batch, t, -1),
                               v.reshape(batch, t, -1)], dim=-1)
        beta = b.reshape(batch, t, d.num_value_heads).sigmoid()
        a = a.reshape(batch, t, d.num_value_heads)
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return mixed, z.reshape(batch, t, d.num_value_heads, d.value_head_dim), beta, decay

    def _zero_state(self, batch: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        return (x.new_zeros(batch, d.conv_dim, d.conv_kernel - 1),
                torch.zeros(batch, *d.state_shape, device=x.device))


def keeps_every_row(parents: torch.Tensor | None, t: int) -> bool:
    """Whether a forward keeps every row's state: under a mask (parents given), or a causal
    one of at most MAX_SNAPSHOT_ROWS rows (else only its ends)."""
    return parents is not None or t <= MAX_SNAPSHOT_ROWS


def path_convolution(mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     windows: RowStates, parents: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution (weight [C, K], bias [C] or None) of each row
    of mixed [B, T, C] over its own path: [B, T, C], and the windows kept (their last K - 1
    inputs after each row, [B, T + 1, C, K - 1], row 0 the committed one)."""
    batch, t, _ = mixed.shape
    weight = weight.to(mixed.dtype)
    out = mixed.new_empty(mixed.shape)
    rows = torch.arange(batch, device=mixed.device)
    for i in range(t):
        before = windows.before(parents[:, i], rows)  # [B, C, K - 1]
        full = torch.cat([before, mixed[:, i, :, None]], dim=-1)  # [B, C, K]
        out[:, i] = (full * weight).sum(-1)
        windows.after(i, full[..., 1:])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return F.silu(out), windows.kept()


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor, states: RowStates, parents: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one row at a time, each row from its parent's state.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; decay (log) and beta [B, T, Hv]; states: from
    the fp32 state [B, Hv, Dk, Dv] before the forward; parents [B, T]. Returns the outputs
    [B, T, Hv, Dv] in q's dtype and the states kept ([B, T + 1, Hv, Dk, Dv], row 0 the one
    given)."""
    dtype, (batch, t, heads, dim_v) = q.dtype, v.shape
    group = heads // q.shape[2]
    q, k = (_l2_normed(x.float()).repeat_interleave(group, dim=2) for x in (q, k))
    q = q / (q.shape[-1] ** 0.5)
    v, beta, gate = v.float(), beta.float(), decay.float().exp()
    out = v.new_empty(batch, t, heads, dim_v)
    rows = torch.arange(batch, device=q.device)
    for i in range(t):
        state = states.before(parents[:, i], rows) * gate[:, i, :, None, None]
        remembered = (state * k[:, i, :, :, None]).sum(dim=-2)  # [B, H, Dv]
        delta = (v[:, i] - remembered) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = (state * q[:, i, :, :, None]).sum(dim=-2)
        states.after(i, state)
    return out.to(dtype), states.kept()


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def chain_parents(batch: int, t: int, device: torch.device | str) -> torch.Tensor:
    """[B, T] the parents of a chain: row i continues row i - 1 (row 0 the history)."""
    return torch.arange(-1, t - 1, device=device).expand(batch, t)


def parents_of(mask: torch.Tensor | None, t: int, device: torch.device | str,
               columns: torch.Tensor | None = None) -> torch.Tensor | None:
    """[B, T] each new row's parent, read off a forward's mask (`Transformer.forward`'s:
    [T, T] among the new rows, [T, past + T] or a batch's [B, T, S]; None, causal, gives
    None): the last earlier row it sees, -1 for none (it continues the committed history).
    columns [B, T]: where each batch row's new rows sit among the mask's columns (a batch's
    rows at their own lengths: `kv_cache.RowSlots.new_slots`); default the last T, the
    committed slots before.

    A recurrent layer reads a path, so a row must see exactly its parent's rows and itself,
    and every committed slot: else a ValueError names the row."""
    if mask is None:
        return None
    rows = (mask if mask.dim() == 3 else mask[None]).cpu()
    width = rows.shape[-1]
    if columns is None:
        columns = torch.arange(width - t, width).expand(rows.shape[0], t)
    columns = columns.cpu()
    among = rows.gather(-1, columns[:, None, :].expand(-1, t, -1))  # [B, T, T]
    committed = torch.arange(width) < columns[:, :1]  # [B, S]
    if not bool((rows | ~committed[:, None, :]).all()):
        raise ValueError("a recurrent layer reads every committed token: a mask that hides "
                         "one from a new row (a drafter's own tree over cached slots) is not "
                         "supported for a recurrent target")
    earlier = among & torch.ones(t, t, dtype=torch.bool).tril(-1)
    index = torch.arange(t).expand_as(earlier)
    parents = torch.where(earlier, index, -1).amax(dim=-1)  # [B, T]
    expected = torch.eye(t, dtype=torch.bool).expand_as(among).clone()
    for i in range(t):  # a row's rows: its parent's and itself
        has = parents[:, i] >= 0
        expected[has, i] |= expected[has, parents[has, i]]
    if not bool((expected == among).all()):
        bad = int((expected != among).any(dim=-1).nonzero()[0, -1])
        raise ValueError(f"a recurrent layer reads a path: new row {bad} of the mask must see "
                         f"exactly its parent's rows and itself (a tree's mask does)")
    return parents.to(device)
