"""The cache of a hybrid target (Qwen3-Next, Qwen3.5): a KV cache for its attention layers and
the recurrent state of its Gated DeltaNet layers (`selfspec.model.recurrent`), behind the
protocol the loop speaks to a `KVCache` (length, write, advance, truncate, commit, reset).

A recurrent state cannot be cut back like a KV cache, so each forward leaves, per recurrent
layer, its snapshots: the state it started from and the state after each new row. The cache
keeps those of the forwards since its last commit (a verification's one, or a draft model's
one-token forwards) and takes the committed state from them:

- `advance(T)` (every forward): the state after the last row, as a chain or a prefill leaves;
- `commit(slots)` (verification): the state after the last accepted slot, the root's or an
  accepted node's; in a tree every node's state is its parent's advanced by its own token, so
  the accepted path's last node holds the state of exactly the committed tokens;
- `truncate(n)`: the state after slot n - 1, where a kept forward holds it.

A rollback past the kept forwards, and a forward that runs only some of the recurrent layers
(early exit, layer skipping), are refused: the state they need is gone or was never built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.model.kv_cache import KVCache
from selfspec.model.recurrent import RecurrentDims, Snapshots

# The forwards a cache keeps the snapshots of since its last commit (a draft model's chain of
# one-token forwards is the longest run the loop makes): older ones are dropped.
MAX_KEPT_FORWARDS = 64


@dataclass(frozen=True)
class Recorded:
    """One recurrent layer's snapshots of a forward, recorded from batch row `first` on (a
    batch's forward records every row's at once), numbered in the order they were recorded
    (`serial`: a record older than a cache's last advance is stale)."""

    first: int
    snapshots: Snapshots
    serial: int


@dataclass
class _Forward:
    """A forward a cache view advanced over: the length it started from, the last slot whose
    state it still holds (a truncate inside it lowers that), and every layer's snapshots."""

    base: int
    last: int
    layers: dict[int, Recorded]


def refuse_partial_forwards(owner: str, layers: frozenset[int]) -> None:
    """Refuse, naming `owner`, a drafter that runs part of a recurrent target's layers over
    its cache (early exit, layer skipping) when `layers`, the target's recurrent ones, are
    some: the layers it skips would keep a stale state."""
    if layers:
        raise ValueError(f"{owner} runs part of the target's layers over its cache, and the "
                         f"target has recurrent layers ({sorted(layers)}), whose state would "
                         f"then miss the tokens it drafted: use another drafter for a hybrid "
                         f"target")


class RecurrentState:
    """Every recurrent layer's committed state over some batch rows, windows
    [L_r, B, C, K - 1] (the model's dtype) and states [L_r, B, *state_shape] (fp32), and what
    the forward running now records. `rows` gives views of a batch's rows, which share the
    tensors and the records (a batch's forward records every row's at once, and each row's
    own view commits its row from them)."""

    def __init__(self, layers: Sequence[int], batch_size: int, dims: RecurrentDims, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                 ) -> None:
        self.layers = tuple(layers)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        n = len(self.layers)
        self.windows = torch.zeros(n, batch_size, dims.conv_dim, dims.conv_kernel - 1,
                                   dtype=dtype, device=device)
        self.states = torch.zeros(n, batch_size, *dims.state_shape, device=device)
        self.first = 0  # the batch row these views start at
        self.recorded: dict[int, Recorded] = {}  # layer index -> its last record (shared)
        self.serials = itertools.count()  # shared by the views, as the records are
        self._whole = (self.windows, self.states)

    def layer(self, layer: int) -> _LayerView:
        """Model layer `layer`'s view (what `GatedDeltaNet.forward` reads and writes)."""
        return _LayerView(self, self._index[layer])

    def rows(self, start: int, stop: int) -> RecurrentState:
        """Batch rows [start, stop) of this state (views; they share its records)."""
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

    def forward_of(self, t: int, after: int) -> dict[int, Recorded] | None:
        """The records of the forward that just ran, if every recurrent layer recorded it
        (after record number `after`) for these batch rows over t rows or more (a batch's
        row may be padded beyond its own t); None otherwise."""
        if len(self.recorded) != len(self.layers) or any(
                record.snapshots.rows < t or record.serial <= after or not self._covered(record)
                for record in self.recorded.values()):
            return None
        return dict(self.recorded)

    def adopt(self, layers: dict[int, Recorded], row: int) -> None:
        """Commit the state after `row` rows of a forward (0: the state it started from)."""
        size = self.states.shape[1]
        for i, record in layers.items():
            at, rows = record.snapshots.index(row), slice(self.first - record.first,
                                                          self.first - record.first + size)
            self.windows[i] = record.snapshots.windows[rows, at]
            self.states[i] = record.snapshots.states[rows, at]

    def reset(self) -> None:
        self.windows.zero_()
        self.states.zero_()
        self.recorded.clear()

    def _covered(self, record: Recorded) -> bool:
        """Whether a record holds these batch rows."""
        return record.first <= self.first and \
            self.first + self.states.shape[1] <= record.first + record.snapshots.states.shape[0]


class _LayerView:
    """One recurrent layer's part of a RecurrentState (`recurrent.LayerState`)."""

    def __init__(self, state: RecurrentState, index: int) -> None:
        self._state, self._index = state, index

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state.windows[self._index], self._state.states[self._index]

    def record(self, snapshots: Snapshots) -> None:
        self._state.recorded[self._index] = Recorded(self._state.first, snapshots,
                                                     next(self._state.serials))


class HybridCache:
    """A KV cache over the attention layers and a RecurrentState over the recurrent ones, one
    length: the slots of the attention layers' history, which is also how many tokens the
    recurrent state has read. Layers are named by their index in the model."""

    def __init__(self, kv: KVCache, state: RecurrentState, attention_layers: Sequence[int]
                 ) -> None:
        self.kv, self.state = kv, state
        self._attention = tuple(attention_layers)
        self._kv_index = {layer: i for i, layer in enumerate(self._attention)}
        self._forwards: list[_Forward] = []  # since the last commit, oldest first
        self._seen = -1  # the newest record an advance took

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def max_slots(self) -> int:
        return self.kv.max_slots

    @property
    def k(self) -> torch.Tensor:
        """The attention layers' keys (a batch's forward reads their device and rows)."""
        return self.kv.k

    def __repr__(self) -> str:
        return (f"HybridCache({self.kv!r}, recurrent layers {list(self.state.layers)}, "
                f"{self.state.states.shape[1]} rows)")

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
        layers = self.state.forward_of(t, self._seen)
        if layers is None:
            raise ValueError(
                "a forward over part of a recurrent target's layers (early exit, layer "
                "skipping, a resume) leaves the skipped layers' recurrent state behind; run "
                "every layer over the new tokens")
        self._seen = max(record.serial for record in layers.values())
        base = self.kv.length
        self.kv.advance(t)
        self._forwards = [*self._forwards[-MAX_KEPT_FORWARDS + 1:],
                          _Forward(base, base + t - 1, layers)]
        self.state.adopt(layers, t)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens, within the forwards kept since the last commit."""
        if n == self.length:
            return
        at, row = self._after(n - 1, "truncate")
        self.state.adopt(self._forwards[at].layers, row)
        self.kv.truncate(n)
        del self._forwards[at + 1:]
        self._forwards[at].last = n - 1

    def commit(self, accepted_slots: torch.Tensor | Sequence[int]) -> None:
        """The KV cache's commit, and the state after the last accepted slot."""
        at, row = self._after(int(accepted_slots[-1]), "commit")
        self.kv.commit(accepted_slots)
        self.state.adopt(self._forwards[at].layers, row)
        self._forwards = []  # the slots moved: the snapshots no longer follow them

    def reset(self) -> None:
        self.kv.reset()
        self.state.reset()
        self._forwards = []

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

    def _after(self, slot: int, what: str) -> tuple[int, int]:
        """(which kept forward, how many of its rows) holds the state after `slot` (the
        newest such forward; row 0 is the state before it)."""
        for at in range(len(self._forwards) - 1, -1, -1):
            forward = self._forwards[at]
            if forward.base - 1 <= slot <= forward.last:
                return at, slot - forward.base + 1
        kept = (f"slots {self._forwards[0].base - 1}..{self._forwards[-1].last}"
                if self._forwards else "no forward since the last commit")
        raise ValueError(f"{what}: a recurrent state rolls back only within the forwards kept "
                         f"since the last commit ({kept}), asked for the state after slot "
                         f"{slot}")
