"""Packed training rows, the one form every source of training data takes (`data`), the
feature store keeps beside the target's states (`features`) and `fit` trains on (`loop`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenRows:
    """Packed training rows: tokens [N, T] and loss_mask [N, T] (1 = a token to predict)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, indices: torch.Tensor) -> TokenRows:
        return TokenRows(self.tokens[indices], self.loss_mask[indices])

    def to(self, device: torch.device | str) -> TokenRows:
        return TokenRows(self.tokens.to(device), self.loss_mask.to(device))
