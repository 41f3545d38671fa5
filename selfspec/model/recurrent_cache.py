"""The cache of a hybrid target (Qwen3-Next, Qwen3.5): a KV cache for its attention layers and
the recurrent state of its Gated DeltaNet layers (`selfspec.model.recurrent`), behind the
protocol the loop speaks to a `KVCache` (length, write, advance, truncate, commit, reset).

A recurrent state cannot be cut back like a KV cache, so each forward leaves, per recurrent
layer, its snapshots: the state it started from and the state after each new row. The cache
keeps them until the next forward and takes the committed state from them:

- `advance(T)` (every forward): the state after the last row, as a chain or a prefill leaves;
- `commit(slots)` (verification): the state after the last accepted slot, the root's or an
  accepted node's; in a tree every node's state is its parent's advanced by its own token, so
  the accepted path's last node holds the state of exactly the committed tokens;
- `truncate(n)`: the state after slot n - 1, for n within the last forward's rows.

A rollback further back than the last forward, and a forward that runs only some of the
recurrent layers (early exit, layer skipping), are refused: the state they need is gone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.model.kv_cache import KVCache
from selfspec.model.recurrent import DeltaNetDims, Snapshots


class RecurrentState:
    """Every recurrent layer's committed state over some batch rows, windows
    [L_r, B, C, K - 1] (the model's dtype) and states [L_r, B, Hv, Dk, Dv] (fp32), and the
    snapshots the last forward recorded. `rows` gives views of a batch's rows, which share the
    tensors and the recorded snapshots (a batch's forward records every row's at once, and
    each row's own view commits its row from them)."""

    def __init__(self, layers: Sequence[int], batch_size: int, dims: DeltaNetDims, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                 ) -> None:
        self.layers = tuple(layers)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.windows = torch.zeros(n, batch_size, dims.conv_dim, dims.conv_kernel - 1,
                                   dtype=dtype, device=device)
        self.states = torch.zeros(n, batch_size, dims.num_value_heads, dims.key_head_dim,
                                  dims.value_head_dim, device=device)
        self.first = 0  # the batch row these views start at
        # layer index -> (the batch row its snapshots start at, the snapshots): shared by views
        self.pending: dict[int, tuple[int, Snapshots]] = {}
        self._whole = (self.windows, self.states)

    def layer(self, layer: int) -> _LayerView:
        """Model layer `layer`'s view (what `GatedDeltaNet.forward` reads and writes)."""
        return _LayerView(self, self._index[layer])

    def rows(self, start: int, stop: int) -> RecurrentState:
        """Batch rows [start, stop) of this state (views; they share its snapshots)."""
        view = RecurrentState.__new__(RecurrentState)
        view.__dict__ |= self.__dict__
        view.first = self.first + start
        view.windows, view.states = self.windows[:, start:stop], self.states[:, start:stop]
        return view

    def move_row(self, view: RecurrentState, to: int) -> None:
        """Copy the state of `view` (one row) into batch row `to` and point it there."""
        windows, states = self._whole
        windows[:, to] = view.windows[:, 0]
        states[:, to] = view.states[:, 0]
        view.windows, view.states = windows[:, to:to + 1], states[:, to:to + 1]
        view.first = to

    def recorded_rows(self) -> int | None:
        """T + 1 for the last forward over T rows, if every recurrent layer recorded it for
        these batch rows (None otherwise)."""
        counts = {snapshots.states.shape[1] for first, snapshots in self.pending.values()
                  if self._covered(first, snapshots)}
        if len(self.pending) != len(self.layers) or len(counts) != 1:
            return None
        return counts.pop()

    def adopt(self, row: int) -> None:
        """Commit snapshot `row` of the last forward (0: the state it started from)."""
        for i, (first, snapshots) in self.pending.items():
            batch = slice(self.first - first, self.first - first + self.states.shape[1])
            self.windows[i] = snapshots.windows[batch, row]
            self.states[i] = snapshots.states[batch, row]

    def reset(self) -> None:
        self.windows.zero_()
        self.states.zero_()
        self.pending.clear()

    def _covered(self, first: int, snapshots: Snapshots) -> bool:
        """Whether snapshots recorded from batch row `first` hold these rows."""
        return first <= self.first and \
            self.first + self.states.shape[1] <= first + snapshots.states.shape[0]


class _LayerView:
    """One recurrent layer's part of a RecurrentState (`recurrent.LayerState`)."""

    def __init__(self, state: RecurrentState, index: int) -> None:
        self._state, self._index = state, index

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state.windows[self._index], self._state.states[self._index]

    def record(self, snapshots: Snapshots) -> None:
        self._state.pending[self._index] = (self._state.first, snapshots)


class HybridCache:
    """A KV cache over the attention layers and a RecurrentState over the recurrent ones, one
    length: the slots of the attention layers' history, which is also how many tokens the
    recurrent state has read. Layers are named by their index in the model."""

    def __init__(self, kv: KVCache, state: RecurrentState, attention_layers: Sequence[int]
                 ) -> None:
        self.kv, self.state = kv, state
        self._attention = tuple(attention_layers)
        self._kv_index = {layer: i for i, layer in enumerate(self._attention)}
        self._base: int | None = None  # the length the pending snapshots started from

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def max_slots(self) -> int:
        return self.kv.max_slots

    def __repr__(self) -> str:
        return (f"HybridCache({self.kv!r}, recurrent layers {list(self.state.layers)}, "
                f"{self.state.states.shape[1]} rows)")

    @property
    def k(self) -> torch.Tensor:
        """The attention layers' keys (a batch's forward reads their device and rows)."""
        return self.kv.k

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write(self._kv_index[layer], k, v)

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write_at(self._kv_index[layer], slots, k, v)

    def recurrent(self, layer: int) -> _LayerView:
        return self.state.layer(layer)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return self.kv.key_positions(positions)

    def advance(self, t: int) -> None:
        """After a forward of t rows: the state after its last row."""
        if self.state.recorded_rows() != t + 1:
            raise ValueError(
                "a forward over part of a recurrent target's layers (early exit, layer "
                "skipping, a resume) leaves the skipped layers' recurrent state behind; run "
                "every layer over the new tokens")
        self._base = self.kv.length
        self.kv.advance(t)
        self.state.adopt(t)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens, which must lie within the last forward."""
        if n == self.length:
            return
        self.state.adopt(self._row_after(n - 1, "truncate"))
        self.kv.truncate(n)

    def commit(self, accepted_slots: torch.Tensor | Sequence[int]) -> None:
        """The KV cache's commit, and the state after the last accepted slot."""
        last = int(accepted_slots[-1])
        row = self._row_after(last, "commit")
        self.kv.commit(accepted_slots)
        self.state.adopt(row)
        self._base = None  # the slots moved: the snapshots no longer follow them

    def reset(self) -> None:
        self.kv.reset()
        self.state.reset()
        self._base = None

    def rows(self, start: int, stop: int) -> HybridCache:
        """Batch rows [start, stop) as a cache of their own, with their own length (views:
        what they write, record and commit lands here)."""
        return HybridCache(self.kv.rows(start, stop), self.state.rows(start, stop),
                           self._attention)

    def row(self, b: int) -> HybridCache:
        return self.rows(b, b + 1)

    def move_row(self, view: HybridCache, source: int, to: int) -> None:
        """Copy row `source`'s history and state into row `to` and point `view` (row
        source's own cache) at row `to` (`kv_cache.BatchRows.pack`)."""
        self.kv.move_row(view.kv, source, to)
        self.state.move_row(view.state, to)

    def _end_after(self, t: int) -> int:
        return self.kv._end_after(t)

    def _row_after(self, slot: int, what: str) -> int:
        """The snapshot holding the state after `slot` (row 0: before the last forward)."""
        base = self._base
        if base is None or not base - 1 <= slot < self.length:
            raise ValueError(
                f"{what}: a recurrent state rolls back only within the last forward's rows "
                f"(slots {base}..{self.length - 1}), asked for the state after slot {slot}")
        return slot - base + 1
