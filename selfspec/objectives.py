"""Training objectives: a frozen target plus a trainable head, whose forward is the loss.

`selfspec.training.fit` trains any of these; each method adds one class here, a head in
`selfspec.heads` and a loss in `selfspec.losses`. The target's features are computed without
gradients and handed to the head explicitly.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.medusa import MedusaHeads
from selfspec.losses import LossOutput, medusa_loss
from selfspec.model import Transformer


def freeze(target: Transformer) -> Transformer:
    target.requires_grad_(False)
    return target.eval()


class MedusaObjective(nn.Module):
    """Medusa-1: heads read the frozen target's last hidden state and learn the tokens after
    the next one (head k predicts t + k + 2), with per-head weights decay**k."""

    def __init__(self, target: Transformer, heads: MedusaHeads, decay: float = 0.8):
        super().__init__()
        self.target, self.heads, self.decay = freeze(target), heads, decay

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        with torch.no_grad():
            hidden = self.target(tokens, positions).last_hidden  # [B, T, H]
        return medusa_loss(self.heads(hidden), tokens, loss_mask, decay=self.decay)
