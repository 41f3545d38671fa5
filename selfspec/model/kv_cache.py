"""A preallocated key/value cache whose rows (*slots*) are kept apart from RoPE *positions*.

Slots are where K/V live; positions are the RoPE ids the model is given separately. In a tree
verification forward, siblings share a position but occupy different slots; after
verification `commit` compacts the accepted root-to-leaf path so that the cache is again the
plain left-to-right history. A linear draft is rolled back with `truncate`.

Write protocol (what `Transformer.forward` does): every layer calls `write(layer, k, v)`,
which places the new entries at slots [length, length + T) and returns views over slots
[0, length + T); after the last layer the model calls `advance(T)` once.

Below its length a cache holds the committed history left to right: slot s holds position s
(a tree's accepted path is compacted there by `commit`, a rejected draft truncated). So the
positions of the keys a forward attends to are the slots below the length and the new rows'
own positions (`key_positions`), which is what a sliding window is counted in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVCache:
    """K/V for every layer: two tensors [num_layers, B, H_kv, max_slots, D], allocated once
    (V's last dimension `value_dim` where it differs from K's: a latent cache, MLA's, holds
    the roped key [.., 1, S, rope dim] as K and the compressed latent [.., 1, S, rank] as V)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_slots: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S, D]
        self.v = torch.zeros((*shape[:-1], value_dim or head_dim), dtype=dtype,
                             device=device)  # [L, B, H_kv, S, D_v]
        self.length = 0  # number of valid slots

    @classmethod
    def reused(cls, cache: KVCache | None, num_layers: int, num_kv_heads: int, max_slots: int,
               head_dim: int, like: torch.Tensor, value_dim: int | None = None) -> KVCache:
        """A drafter's own cache for a generation (batch 1): `cache` emptied where it holds
        max_slots slots in like's dtype and on its device, else a new one."""
        if cache is None or cache.max_slots < max_slots or cache.k.device != like.device \
                or cache.k.dtype != like.dtype or cache.v.shape[-1] != (value_dim or head_dim):
            cache = cls(num_layers, 1, num_kv_heads, max_slots, head_dim, dtype=like.dtype,
                        device=like.device, value_dim=value_dim)
        cache.reset()
        return cache

    @property
    def max_slots(self) -> int:
        return self.k.shape[3]

    def __repr__(self) -> str:
        num_layers, batch, heads, slots, dim = self.k.shape
        return (
            f"KVCache(length={self.length}, max_slots={slots}, num_layers={num_layers}, "
            f"batch_size={batch}, num_kv_heads={heads}, head_dim={dim}, dtype={self.k.dtype})"
        )

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, T, D] at slots [length, length+T); return K, V over [0, length+T).

        `length` is unchanged: the caller advances it once all layers have written.
        """
        expected = (*self.k.shape[1:3], k.shape[2], self.k.shape[4])
        expected_v = (*expected[:3], self.v.shape[4])
        if tuple(k.shape) != expected or tuple(v.shape) != expected_v:
            raise ValueError(
                f"KVCache.write: k and v must have shape [B, H_kv, T, D] = {list(expected)} "
                f"and {list(expected_v)}, got {list(k.shape)} and {list(v.shape)}"
            )
        end = self._end_after(k.shape[2])
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, H_kv, end, D] each

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[S] or [B, S] the positions of the keys a forward of new rows at `positions` ([T]
        or [B, T]) attends to: the committed slots [0, length), then the new rows."""
        return _after_history(self.length, positions)

    def advance(self, t: int) -> None:
        """Mark t more slots valid (after every layer has written them)."""
        self.length = self._end_after(t)

    def truncate(self, n: int) -> None:
        """Roll back to the first n slots (a rejected linear draft)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.truncate: n must be in [0, {self.length}], got {n}")
        self.length = n

    def commit(self, accepted_slots: torch.Tensor | Sequence[int]) -> None:
        """Keep slots below accepted_slots[0], then move the accepted slots right after them.

        accepted_slots: [n] strictly increasing slot indices below `length` (the root and the
        accepted tree nodes). Afterwards length == accepted_slots[0] + n.
        """
        values = _check_commit_slots(accepted_slots, self.length)  # a tensor is read once
        start, n = values[0], len(values)
        if values != list(range(start, start + n)):  # already contiguous: nothing to move
            slots = torch.tensor(values, dtype=torch.long, device=self.k.device)
            # index_select copies first, so overlapping source/target slots are safe.
            self.k[:, :, :, start : start + n] = self.k.index_select(3, slots)
            self.v[:, :, :, start : start + n] = self.v.index_select(3, slots)
        self.length = start + n

    def reset(self) -> None:
        self.length = 0

    def row(self, b: int) -> KVCache:
        """Batch row b as a cache of its own, with its own length: views of this cache's
        tensors, so what it writes and commits lands here (a batch's rows reach different
        lengths)."""
        return self.rows(b, b + 1)

    def rows(self, start: int, stop: int) -> KVCache:
        """Batch rows [start, stop) as a cache of their own (views, as `row`)."""
        if not 0 <= start < stop <= self.k.shape[1]:
            raise ValueError(f"KVCache.rows: need 0 <= start < stop <= {self.k.shape[1]}, got "
                             f"{start}, {stop}")
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.length = self.k[:, start:stop], self.v[:, start:stop], self.length
        return view

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, T, D] at slot tensor `slots` ([T] for every row, or [B, T]:
        each row's own) and return the layer's whole K, V [B, H_kv, S, D]; `length` is
        unchanged (static and batched forwards, whose caller advances)."""
        keys, values = self.k[layer], self.v[layer]
        if slots.dim() == 1:
            keys.index_copy_(2, slots, k.to(keys.dtype))
            values.index_copy_(2, slots, v.to(values.dtype))
        else:
            index = slots[:, None, :, None]
            keys.scatter_(2, index.expand(k.shape), k.to(keys.dtype))
            values.scatter_(2, index.expand(v.shape), v.to(values.dtype))
        return keys, values

    def move_row(self, view: KVCache, source: int, to: int) -> None:
        """Copy row `source`'s valid slots into row `to` and point `view` (row source's own
        cache, which its holders keep) at row `to`: a batch packs its unfinished rows first."""
        n = view.length
        self.k[:, to, :, :n] = self.k[:, source, :, :n]
        self.v[:, to, :, :n] = self.v[:, source, :, :n]
        view.k, view.v = self.k[:, to:to + 1], self.v[:, to:to + 1]

    def _end_after(self, t: int) -> int:
        end = self.length + t
        if end > self.max_slots:
            raise ValueError(
                f"KV cache overflow: {end} slots needed ({self.length} used + {t} new) but "
                f"max_slots is {self.max_slots}; allocate a larger cache "
                f"(e.g. model.new_cache(max_slots={end}) or KVCache(..., max_slots=...))"
            )
        return end


class BatchRows:
    """A batch's cache and each row's own cache: a view of its row (`KVCache.row`; with one
    row, the cache itself), which follows the row when `pack` moves it. Forwards over a
    batch run over its first rows, so the unfinished rows are packed there."""

    def __init__(self, cache: KVCache, rows: int) -> None:
        self.cache = cache
        self.views = [cache] if rows == 1 else [cache.row(b) for b in range(rows)]
        self._at = list(range(rows))  # the cache row each batch row is at now

    def pack(self, rows: Sequence[int]) -> None:
        """Move batch rows `rows` (in order) to the cache's first len(rows) rows (a finished
        row's slots are free)."""
        for i, b in enumerate(rows):
            if self._at[b] != i:  # i < _at[b]: row i's former owner has finished or moved
                self.cache.move_row(self.views[b], self._at[b], i)
                self._at[b] = i

    def first(self, n: int) -> KVCache:
        """The cache's first n rows as one cache (views)."""
        return self.cache.rows(0, n)


class RowSlots:
    """A batch's cache as one forward over all its rows sees it, each row at its own length:
    row b's T new K/V go to its slots [lengths[b], lengths[b] + T), and K/V return over slots
    [0, max(lengths) + T), which the forward's [B, T, max(lengths) + T] mask spans (`length`
    makes `Transformer.forward` take that mask whole). The caller advances each row."""

    def __init__(self, cache: KVCache, lengths: Sequence[int], t: int) -> None:
        self.cache, self.length, self._end = cache, max(lengths), max(lengths) + t
        if self._end > cache.max_slots:
            cache._end_after(self._end - cache.length)  # the overflow error, stated there
        self._starts = torch.tensor(list(lengths), device=cache.k.device)  # [B]
        self._slots = self._starts[:, None] + torch.arange(t, device=cache.k.device)  # [B, T]

    def mask(self, masks: torch.Tensor) -> torch.Tensor:
        """The forward's mask [B, T, max(lengths) + T] from each row's mask among its new
        rows, masks [B, T, T]: row b sees its cached slots [0, lengths[b]) and, where its new
        K/V go, [lengths[b], lengths[b] + T), what masks[b] says."""
        return rows_mask(self._starts, self._slots, self._end, masks)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.write_at(layer, self._slots, k, v)  # [B, H_kv, S, D]
        return keys[:, :, :self._end], values[:, :, :self._end]

    def advance(self, t: int) -> None:
        pass  # each row's own cache advances

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, max(lengths) + T]: each row's committed slots, its new rows' positions at
        their slots (columns past a row's own rows are masked out)."""
        return slot_positions(self._end, self._slots, positions)

    @property
    def new_slots(self) -> torch.Tensor:
        """[B, T] the columns of each row's new rows in the forward's mask."""
        return self._slots

    def recurrent(self, layer: int):
        """A hybrid target's recurrent layer state over these rows
        (`selfspec.model.recurrent_cache.HybridCache.recurrent`)."""
        return self.cache.recurrent(layer)


def slot_positions(width: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[width] or [B, width] the position of every slot: the slot itself, except at `slots`
    ([T] or [B, T]), which hold new rows at `positions` (of slots' shape). Tensor ops only."""
    every = torch.arange(width, device=slots.device)
    if slots.dim() == 2:
        every = every[None].expand(slots.shape[0], width)
    return every.scatter(-1, slots, positions.to(slots.device).expand(slots.shape))


def _after_history(length: int, positions: torch.Tensor) -> torch.Tensor:
    """[length + T] or [B, length + T]: the history's positions 0..length-1, then positions."""
    history = torch.arange(length, device=positions.device)
    if positions.dim() == 2:
        history = history[None].expand(positions.shape[0], length)
    return torch.cat([history, positions], dim=-1)


def rows_mask(starts: torch.Tensor, slots: torch.Tensor, width: int, masks: torch.Tensor
              ) -> torch.Tensor:
    """[B, T, width] bool: row b sees the slots below starts[b], and at its new rows' slots
    slots[b] ([B, T]) what masks[b] ([B, T, T]) says; nothing else. Tensor ops only, so a
    captured step builds it too."""
    rows, t, _ = masks.shape
    past = torch.arange(width, device=starts.device)[None] < starts[:, None]  # [B, width]
    mask = past[:, None].repeat(1, t, 1)
    return mask.scatter_(2, slots[:, None].expand(rows, t, t), masks)


def pad_rows(inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             lengths: list[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's new tokens (tokens [1, T_b], position offsets [T_b] from its length, mask
    [T_b, T_b] among them) padded to one forward's tokens [B, T], positions [B, T] and masks
    [B, T, T] (`RowSlots.mask` widens them): a padding row sees only itself."""
    t = max(row_tokens.shape[1] for row_tokens, _, _ in inputs)
    tokens = torch.zeros(len(inputs), t, dtype=torch.long, device=device)
    positions = torch.zeros(len(inputs), t, dtype=torch.long, device=device)
    masks = torch.eye(t, dtype=torch.bool, device=device).repeat(len(inputs), 1, 1)
    for b, ((row_tokens, offsets, row_mask), length) in enumerate(zip(inputs, lengths,
                                                                       strict=True)):
        n = row_tokens.shape[1]
        tokens[b, :n] = row_tokens[0]
        positions[b] = length + torch.cat([offsets, offsets.new_zeros(t - n)])
        masks[b, :n, :n] = row_mask
    return tokens, positions, masks


class SegmentedKVCache:
    """The cache of a target whose layers lie on several devices (`selfspec.model.placement`): one
    KVCache per run of layers on one device, beside those layers, all of one length. It speaks
    KVCache's protocol (write, advance, truncate, commit, reset, length, max_slots); it has no
    single k and v, so static steps (`selfspec.step`) do not take it."""

    def __init__(self, parts: list[tuple[int, KVCache]]) -> None:
        """parts: (first layer, the cache of that run of layers), in layer order."""
        self.parts = [cache for _, cache in parts]
        self._where = [(cache, layer - first) for first, cache in parts
                       for layer in range(first, first + cache.k.shape[0])]

    @property
    def length(self) -> int:
        return self.parts[0].length

    @property
    def max_slots(self) -> int:
        return self.parts[0].max_slots

    def __repr__(self) -> str:
        return f"SegmentedKVCache({', '.join(f'{c.k.device}: {c!r}' for c in self.parts)})"

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        cache, local = self._where[layer]
        return cache.write(local, k, v)

    def advance(self, t: int) -> None:
        for cache in self.parts:
            cache.advance(t)

    def truncate(self, n: int) -> None:
        for cache in self.parts:
            cache.truncate(n)

    def commit(self, accepted_slots: torch.Tensor | Sequence[int]) -> None:
        for cache in self.parts:
            cache.commit(accepted_slots)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return _after_history(self.length, positions)

    def reset(self) -> None:
        for cache in self.parts:
            cache.reset()


def _check_commit_slots(slots: torch.Tensor | Sequence[int], length: int) -> list[int]:
    """Validate commit slots; returns them as a python list (a tensor's read back: one device
    sync; the decode loop passes a list it already holds)."""
    shape = list(slots.shape) if isinstance(slots, torch.Tensor) else [len(slots)]
    if len(shape) != 1 or shape[0] == 0:
        raise ValueError(
            f"KVCache.commit: accepted_slots must be a non-empty 1-D tensor of slot indices, "
            f"got shape {shape}"
        )
    values = slots.tolist() if isinstance(slots, torch.Tensor) else [int(v) for v in slots]
    if values[0] < 0 or values[-1] >= length:
        raise ValueError(
            f"KVCache.commit: accepted slots must lie in [0, {length}) (the valid slots), "
            f"got {values}"
        )
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(
            f"KVCache.commit: accepted slots must be strictly increasing, got {values}"
        )
    return values
