"""Training objectives: a target plus a trainable head, whose forward is the loss.

`selfspec.training.fit` trains any of these; each method adds one class here, a head in
`selfspec.heads` and a loss in `selfspec.losses`. With a frozen target its features are computed
without gradients and handed to the head explicitly; Medusa-2 also trains LoRA adapters on the
target (`selfspec.lora`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from selfspec.heads.medusa import MedusaHeads
from selfspec.losses import LossOutput, kl_to_teacher, medusa_loss
from selfspec.model import Transformer

if TYPE_CHECKING:
    from peft import PeftModel


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


class Medusa2Objective(nn.Module):
    """Medusa-2: heads and LoRA adapters on the target train together.

    The heads read the *adapted* target's hidden state. The adapted target's own LM head is
    what verification will use, so its law is pulled towards the unadapted target's by a KL
    term weighted lm_weight; the teacher is the same model with its adapters disabled, so no
    second copy of the target is held.
    target: the target wrapped by `selfspec.lora.add_lora` (only the adapters train).
    adapter_lr_scale: the adapters learn at this fraction of the heads' rate, so the target
    moves slowly while the heads catch up with it.
    """

    def __init__(
        self, target: PeftModel, heads: MedusaHeads, decay: float = 0.8, lm_weight: float = 1.0,
        adapter_lr_scale: float = 0.25,
    ):
        super().__init__()
        if not lm_weight >= 0:
            raise ValueError(f"Medusa2Objective: lm_weight must be >= 0, got {lm_weight}")
        if not adapter_lr_scale > 0:
            raise ValueError(
                f"Medusa2Objective: adapter_lr_scale must be > 0, got {adapter_lr_scale}")
        self.target, self.heads, self.decay, self.lm_weight = target, heads, decay, lm_weight
        self.adapter_lr_scale = adapter_lr_scale

    def param_groups(self, lr: float) -> list[dict]:
        """The heads at lr, the target's adapters at lr * adapter_lr_scale (for `fit`)."""
        adapters = [p for p in self.target.parameters() if p.requires_grad]
        return [{"params": list(self.heads.parameters()), "lr": lr},
                {"params": adapters, "lr": lr * self.adapter_lr_scale}]

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        with torch.no_grad(), self.target.disable_adapter():
            teacher = self.target(tokens, positions).logits  # [B, T, V] the unadapted target
        out = self.target(tokens, positions)
        heads = medusa_loss(self.heads(out.last_hidden), tokens, loss_mask, decay=self.decay)
        kl = kl_to_teacher(out.logits, teacher, loss_mask)
        metrics = heads.metrics | {"medusa/lm_kl": float(kl.detach())}
        return LossOutput(heads.loss + self.lm_weight * kl, metrics)
