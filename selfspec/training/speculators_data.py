"""A feature store's rows in speculators' offline layout, so that speculators' own trainer
learns from the very rows and target states that selfspec's trainers read.

speculators reads a `datasets` folder (`save_to_disk`, torch format) of `input_ids`,
`loss_mask` and `seq_len`, and beside it `hidden_states/hs_<i>.safetensors`, one file per row:
`token_ids` [T] and `hidden_states` [T, n + 1, H], the n fused streams (HF's
`hidden_states[l]`, the input of layer l: the store's `hidden.<l>`) and last the final
layer's output before the norm (the store's `hidden.<L>` of an L-layer target: speculators
applies the target's norm and LM head to it for its teacher). It holds out the dataset's last
rows for validation by a ratio: the store's training rows come first and its held-out rows
after them.

selfspec's `loss_mask[t]` says token t is a prediction target. speculators 0.9.0 reads its
mask two ways: its DFlash scores the slot predicting token t where mask[t] is set (selfspec's
meaning; an anchor a needs mask[a]), its EAGLE-3 scores the target's law at position t, over
token t + 1, where mask[t] is set. `speculators_loss_mask` writes each its own, so both
trainers supervise the same predicted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from selfspec.heads.draft_vocab import DraftVocab, draft_vocabulary
from selfspec.training.features import FeatureStore
from selfspec.training.rows import TokenRows

HIDDEN_FOLDER = "hidden_states"
TRAIN, HELDOUT = "train-", "heldout-"  # the store's shard prefixes
KINDS = ("eagle3", "dflash")  # the heads speculators' trainer learns from these rows


@dataclass(frozen=True)
class OfflineRows:
    """What `write_offline_rows` wrote: the folder (speculators' `--data-path`), its training
    rows (first) and held-out rows (after them), the row length, the fused streams and the
    target's layer count, whose output closes every row's states."""

    folder: Path
    train_rows: int
    heldout_rows: int
    seq_len: int
    layers: tuple[int, ...]
    final_layer: int

    @property
    def train_ratio(self) -> float:
        """speculators' `--train-data-ratio` that splits exactly at the held-out rows: it
        takes int(rows x ratio) for training, so the ratio sits half a row past the split."""
        return (self.train_rows + 0.5) / (self.train_rows + self.heldout_rows)


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"speculators' rows: kind must be one of {', '.join(KINDS)}, got "
                         f"{kind!r}")


def speculators_loss_mask(loss_mask: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., T] selfspec's mask (token t is predicted) as speculators' trainer of `kind` reads
    it: DFlash's as it is; EAGLE-3's (the law at t, over token t + 1, is scored) shifted one
    position left, the last position unscored."""
    check_kind(kind)
    if kind == "dflash":
        return loss_mask.clone()
    return torch.cat([loss_mask[..., 1:], torch.zeros_like(loss_mask[..., :1])], dim=-1)


def write_offline_rows(store: FeatureStore, out: str | Path, layers: tuple[int, ...],
                       final_layer: int, kind: str, max_train_rows: int | None = None
                       ) -> OfflineRows:
    """Write the store's training rows (the first max_train_rows; None: all) and its held-out
    rows in speculators' layout under `out`, for its trainer of `kind`: `write_hidden_states`,
    then the `datasets` folder of their columns."""
    from datasets import Dataset

    check_kind(kind)  # before anything is written
    rows = write_hidden_states(store, out, layers, final_layer, max_train_rows)
    every = (store_rows(store, max_train_rows), store_rows(store, held_out=True))
    data = Dataset.from_dict({
        "input_ids": torch.cat([part.tokens for part in every]).tolist(),
        "loss_mask": speculators_loss_mask(torch.cat([p.loss_mask for p in every]), kind).tolist(),
        "seq_len": [rows.seq_len] * (rows.train_rows + rows.heldout_rows)})
    data.set_format("torch")  # speculators compares its rows with torch.equal
    data.save_to_disk(str(out))
    return rows


def write_hidden_states(store: FeatureStore, out: str | Path, layers: tuple[int, ...],
                        final_layer: int, max_train_rows: int | None = None) -> OfflineRows:
    """The rows' `hidden_states/hs_<i>.safetensors` files under `out` (states in fp32):
    training rows first, held-out rows after them. Refused when the store lacks a stream:
    `layers` and `final_layer` (the target's layer count) must all be stored."""
    from safetensors.torch import save_file

    needed = (*layers, final_layer)
    missing = sorted(set(needed) - set(store.spec.layers))
    if missing:
        raise ValueError(f"the feature store {store.folder} holds layers "
                         f"{list(store.spec.layers)}, not {missing}: speculators reads the fused "
                         f"streams and the last layer's output before the norm; build the store "
                         f"with store.layers including {list(needed)}")
    folder = Path(out) / HIDDEN_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = store_rows(store, max_train_rows), store_rows(store, held_out=True)
    for i, tokens in enumerate(torch.cat([train.tokens, heldout.tokens])):
        read = store.read(tokens[None], needed, torch.float32)
        states = torch.stack(read.streams, dim=2)[0]  # [T, n + 1, H]
        save_file({"token_ids": tokens.contiguous(), "hidden_states": states.contiguous()},
                  str(folder / f"hs_{i}.safetensors"))
    return OfflineRows(Path(out), len(train), len(heldout), store.index.seq_len, tuple(layers),
                       final_layer)


def write_draft_vocab(store: FeatureStore, out: str | Path, vocab_size: int, size: int,
                      max_train_rows: int | None = None) -> tuple[Path, Path]:
    """The draft vocabulary selfspec's EAGLE-3 trainer picks from these training rows (the
    `size` most frequent predicted tokens) as speculators' d2t and t2d files (.npy); returns
    their paths."""
    rows = store_rows(store, max_train_rows)
    vocab: DraftVocab = draft_vocabulary(rows.tokens, vocab_size, size, rows.loss_mask)
    paths = Path(out) / f"d2t-{size}.npy", Path(out) / f"t2d-{size}.npy"
    np.save(paths[0], vocab.d2t.numpy())
    np.save(paths[1], vocab.t2d.numpy())
    return paths


def store_rows(store: FeatureStore, limit: int | None = None, held_out: bool = False
               ) -> TokenRows:
    """The store's training rows (held_out: its held-out rows), the first `limit` of them
    (None: all), in order: their tokens and loss masks."""
    from safetensors import safe_open

    prefix = HELDOUT if held_out else TRAIN
    tokens, masks = [], []
    for shard in store.index.shards:
        if shard.file.startswith(prefix):
            with safe_open(str(store.folder / shard.file), "pt") as f:
                tokens.append(f.get_tensor("tokens").long())
                masks.append(f.get_tensor("loss_mask").long())
    if not tokens:
        return TokenRows(torch.zeros(0, store.index.seq_len, dtype=torch.long),
                         torch.zeros(0, store.index.seq_len, dtype=torch.long))
    rows = TokenRows(torch.cat(tokens), torch.cat(masks))
    return rows if limit is None else rows.select(torch.arange(min(limit, len(rows))))
