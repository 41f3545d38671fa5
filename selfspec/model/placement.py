"""A target spread over several devices by layers (`model.device_map`), for targets larger
than one GPU.

A placement puts every decoder layer on a device, and the embedding, the final norm and the
LM head together on one *home* device: the run's `device`, where drafters, draft models,
heads and the verifier run too. A forward moves the hidden state across a device boundary
once per boundary, and back home for the LM head; each layer's K/V cache lives beside its
layer (`selfspec.model.kv_cache.SegmentedKVCache`). Keeping the LM head beside the embedding
keeps a tied LM head one tensor.

Plans come from accelerate's planner (`infer_auto_device_map`, `get_balanced_memory`) over
the model built on the meta device, so a plan for a 70B model needs neither weights nor GPUs:
- `auto` and `balanced`: layers spread evenly over the devices of `max_memory` (what
  transformers' `device_map="auto"` does);
- `sequential`: each device filled in turn;
- a mapping of layer ranges to devices, e.g. `{0-39: 0, 40-79: 1}`.
Devices are written as accelerate writes them: an integer is a CUDA GPU, else cpu, cuda:N, mps.

This module is the record alone; `selfspec.model.plan` makes placements and applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.checks import is_int


@dataclass(frozen=True)
class Placement:
    """home: the embedding, final norm and LM head (and every drafter); layers: each layer's
    device, in order."""

    home: torch.device
    layers: tuple[torch.device, ...]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Every device used, home first, then in layer order."""
        return tuple(dict.fromkeys((self.home, *self.layers)))

    @property
    def spans_devices(self) -> bool:
        return len(self.devices) > 1

    def device_of(self, name: str) -> torch.device:
        """The device of one of the model's parameters (its state-dict name)."""
        parts = name.split(".")
        return self.layers[int(parts[1])] if parts[0] == "layers" else self.home

    def segments(self) -> list[tuple[int, int, torch.device]]:
        """Runs of consecutive layers on one device: (first, end, device)."""
        runs: list[tuple[int, int, torch.device]] = []
        for i, device in enumerate(self.layers):
            if runs and runs[-1][2] == device:
                runs[-1] = (runs[-1][0], i + 1, device)
            else:
                runs.append((i, i + 1, device))
        return runs


def parse_device(value) -> torch.device:
    """A device as accelerate and our configs write it: an integer is a CUDA GPU; "cuda" is
    cuda:0."""
    if is_int(value):
        return torch.device("cuda", value)
    try:
        device = torch.device(str(value))
    except RuntimeError:
        raise ValueError(f"model.device_map: {value!r} is not a device; use an integer (a CUDA "
                         f"GPU), cpu, cuda:N or mps") from None
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device
