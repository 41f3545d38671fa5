"""What every trainable draft head is: a module built from its config dataclass, `cls(config)`.

`selfspec.heads.io` saves a head under its class name and finds the class again among the
subclasses of `Head`, so a new head needs no entry in any table: defining it is enough.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from selfspec.model import attention_mask, rope_cos_sin


class Head(nn.Module):
    """A trainable draft head. Subclasses name their config dataclass in `config_class` and
    take an instance of it as their only constructor argument."""

    config_class: ClassVar[type]

    def rope_and_mask(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RoPE's cos and sin at `positions` and the attention mask of x's T new rows [B, T, h]
        after the cache's slots (`mask` among them, default causal), for a head with an
        attention layer of its own: its `inv_freq` (fp32) follows the positions' device."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        past = 0 if cache is None else cache.length
        return cos, sin, attention_mask(mask, x.shape[1], past, x.device)


def head_types() -> dict[str, type[Head]]:
    """Every head class defined so far, by class name (subclasses of subclasses too)."""
    found, todo = {}, list(Head.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found
