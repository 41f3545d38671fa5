"""Training losses, one pure function per method; each returns a `LossOutput`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    """loss: the scalar to minimise; metrics: plain floats to log (same keys every call)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def medusa_loss(
    head_logits: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    decay: float = 0.8,
) -> LossOutput:
    """Medusa-1 loss: sum over heads k of decay**k * cross-entropy of head k.

    head_logits: [B, T, K, V] head k at position t predicts tokens[t + k + 2] (the target's own
        LM head predicts t + 1), so head k is scored on positions t < T - k - 2.
    tokens: [B, T] the sequence the hidden states were computed on.
    loss_mask: [B, T] bool/0-1, whether a token counts as a *prediction target* (e.g. only
        assistant replies); None = every token.
    A head with no valid position contributes 0 to the loss and reports 0 for its metrics.
    """
    _check_medusa_inputs(head_logits, tokens, loss_mask, decay)
    batch, length, num_heads, _ = head_logits.shape
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    total = head_logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for k in range(num_heads):
        shift = k + 2
        logits = head_logits[:, : max(length - shift, 0), k]  # [B, T - k - 2, V]
        labels, valid = tokens[:, shift:], mask[:, shift:]  # [B, T - k - 2]
        head_loss, top1 = _masked_cross_entropy(logits, labels, valid)
        total = total + decay**k * head_loss
        metrics[f"medusa/head{k}_loss"] = float(head_loss.detach())
        metrics[f"medusa/head{k}_top1"] = top1
    return LossOutput(total, metrics)


def _masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Mean cross-entropy and top-1 accuracy over the valid positions ([B, T', V], [B, T'])."""
    count = valid.sum()
    if count == 0:  # keep the graph connected so every head still gets a (zero) gradient
        return logits.sum().float() * 0.0, 0.0
    per_token = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), reduction="none"
    )  # [B * T']
    weights = valid.flatten().float()
    loss = (per_token * weights).sum() / count
    hits = (logits.detach().argmax(dim=-1) == labels) & valid  # [B, T']
    return loss, float(hits.sum()) / float(count)


def _check_medusa_inputs(
    head_logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor | None, decay: float
) -> None:
    if head_logits.dim() != 4:
        raise ValueError(
            f"medusa_loss: head_logits must be [B, T, K, V], got shape {list(head_logits.shape)}; "
            f"pass MedusaHeads(hidden [B, T, H])"
        )
    if tokens.shape != head_logits.shape[:2] or tokens.is_floating_point():
        raise ValueError(
            f"medusa_loss: tokens must be integer ids of shape [B, T] = "
            f"{list(head_logits.shape[:2])} (head_logits' first two dims), got "
            f"{tokens.dtype} {list(tokens.shape)}"
        )
    if loss_mask is not None and loss_mask.shape != tokens.shape:
        raise ValueError(
            f"medusa_loss: loss_mask must have the tokens' shape {list(tokens.shape)}, got "
            f"{list(loss_mask.shape)}"
        )
    if not decay > 0:
        raise ValueError(f"medusa_loss: decay must be > 0 (head k weighs decay**k), got {decay}")


def kl_to_teacher(
    logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean KL(teacher || model) of the next-token laws, over the positions whose next token
    counts (Medusa-2's self-distillation: the teacher is the unadapted target).

    logits, teacher_logits: [B, T, V]; position t predicts token t + 1, so it counts when
    loss_mask[:, t + 1] is set (None = every position). No valid position gives 0.
    """
    if logits.shape != teacher_logits.shape or logits.dim() != 3:
        raise ValueError(
            f"kl_to_teacher: logits and teacher_logits must both be [B, T, V], got "
            f"{list(logits.shape)} and {list(teacher_logits.shape)}"
        )
    if loss_mask is not None and loss_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"kl_to_teacher: loss_mask must be [B, T] = {list(logits.shape[:2])}, got "
            f"{list(loss_mask.shape)}"
        )
    model = F.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T - 1, V]
    teacher = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)
    per_position = F.kl_div(model, teacher, log_target=True, reduction="none").sum(-1)  # [B, T-1]
    valid = torch.ones_like(per_position) if loss_mask is None else loss_mask[:, 1:].float()
    return (per_position * valid).sum() / valid.sum().clamp(min=1.0)
