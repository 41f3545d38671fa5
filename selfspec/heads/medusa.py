"""Medusa heads (Cai et al. 2024): K extra LM heads on the target's last hidden state.

Head k reads the target's normed final hidden state at position t and predicts the token at
t + k + 2 (the target's own LM head predicts t + 1). Each head is `num_layers` residual blocks
followed by its own vocabulary projection. Trainable modules only: decoding lives in
`selfspec.drafters.medusa`, the loss in `selfspec.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    """hidden_size, vocab_size: the target's; num_heads: K (head k predicts t + k + 2);
    num_layers: residual blocks per head."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1

    def __post_init__(self) -> None:
        minimum = {"hidden_size": 1, "vocab_size": 1, "num_heads": 1, "num_layers": 0}
        for name, least in minimum.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"MedusaConfig: {name} must be an integer >= {least}, got {value!r}"
                )


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); the linear starts at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # SiLU(bias) would shift a fresh head otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: its own residual blocks, then its own [V, H] projection."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        # A fresh block per layer: `[ResBlock(h)] * n` would share one block's weights.
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return self.lm_head(hidden)  # [..., V]


class MedusaHeads(nn.Module):
    """K Medusa heads: `forward(hidden [..., H]) -> logits [..., K, V]`."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(MedusaHead(config) for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"MedusaHeads: hidden states have size {hidden.shape[-1]}, the heads expect "
                f"{self.config.hidden_size}: pass the target's last_hidden [..., hidden]"
            )
        return torch.stack([head(hidden) for head in self.heads], dim=-2)  # [..., K, V]

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> MedusaHeads:
        """Copy the target's LM head weight [V, H] into every head's projection (Medusa-1).

        Copies, never shares: each head keeps its own storage and trains apart.
        """
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"MedusaHeads.init_from_lm_head: weight has shape {list(weight.shape)}, expected "
                f"[vocab_size, hidden_size] = {list(expected)}; pass target.lm_head.weight"
            )
        for head in self.heads:
            head.lm_head.weight.copy_(weight)
        return self
