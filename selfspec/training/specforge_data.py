"""A feature store's rows in SpecForge's offline DFlash layout, so that SpecForge's own DFlash
trainer learns from the very rows and target states that selfspec's trainers read.

SpecForge reads a folder of `*.ckpt` files (`data.hidden_states_path`), one `torch.save`d dict
a row: `input_ids` [T], `loss_mask` [T] and `hidden_states` [T, n H], the n fused streams
concatenated in the order of the draft's `dflash_config.target_layer_ids` (the store's
`hidden.<l>`, HF's `hidden_states[l]`: SpecForge numbers it l - 1, the layer whose output it
is). Its DFlash supervises the slot predicting token t where `loss_mask[t]` is set and takes
anchors a where `loss_mask[a]` and `loss_mask[a + 1]` both are: selfspec's meaning (token t is
predicted), so the mask is written as it is. Only training rows are written: SpecForge's
offline evaluation reads another folder (`data.eval_hidden_states_path`), which `held_out`
writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from selfspec.training.features import FeatureStore
from selfspec.training.speculators_data import store_rows

FILE_PATTERN = "row_{:06d}.ckpt"  # SpecForge lists `*.ckpt` files sorted by name


def write_specforge_dflash_rows(store: FeatureStore, out: str | Path, layers: tuple[int, ...],
                                max_rows: int | None = None, held_out: bool = False) -> int:
    """Write the store's training rows (held_out: its held-out rows), the first max_rows
    (None: all), as SpecForge's offline DFlash files under `out` (states in fp32); returns
    how many. Refused when the store lacks one of the fused `layers`."""
    missing = sorted(set(layers) - set(store.spec.layers))
    if missing:
        raise ValueError(f"the feature store {store.folder} holds layers "
                         f"{list(store.spec.layers)}, not {missing}: SpecForge's DFlash reads "
                         f"the fused streams; build the store with store.layers including "
                         f"{list(layers)}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = store_rows(store, max_rows, held_out=held_out)
    for i, (tokens, mask) in enumerate(zip(rows.tokens, rows.loss_mask, strict=True)):
        read = store.read(tokens[None], layers, torch.float32)
        hidden = torch.cat(read.streams, dim=-1)[0]  # [T, n H]
        torch.save({"input_ids": tokens.clone(), "loss_mask": mask.clone(),
                    "hidden_states": hidden.contiguous()}, folder / FILE_PATTERN.format(i))
    return len(rows)
