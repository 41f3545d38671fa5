"""Training losses, one pure function per method; each returns a `LossOutput`. Where a loss
fits the draft's law to the target's, `divergence` says by which objective
(`selfspec.training.divergences`: forward KL by default)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.training.divergences import (
    Divergence,
    forward_kl,
    target_log_probs,
    total_variation,
)


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
    teacher_logits: torch.Tensor | None = None,
    divergence: Divergence = forward_kl,
) -> LossOutput:
    """Medusa-1 loss: sum over heads k of decay**k * cross-entropy of head k, or, given the
    target's logits, of `divergence` between head k's law and the target's.

    head_logits: [B, T, K, V] head k at position t predicts tokens[t + k + 2] (the target's own
        LM head predicts t + 1), so head k is scored on positions t < T - k - 2.
    tokens: [B, T] the sequence the hidden states were computed on.
    loss_mask: [B, T] bool/0-1, whether a token counts as a *prediction target* (e.g. only
        assistant replies); None = every token.
    teacher_logits: [B, T, V] the target's logits (position i: the law of token i + 1), or
    None: against the tokens. Head k at t then meets the target's law at t + k + 1, and its
    top-1 is agreement with that law's argmax.
    A head with no valid position contributes 0 to the loss and reports 0 for its metrics.
    """
    _check_medusa_inputs(head_logits, tokens, loss_mask, decay)
    if teacher_logits is not None and teacher_logits.shape != head_logits[:, :, 0].shape:
        raise ValueError(f"medusa_loss: teacher_logits must be [B, T, V] = "
                         f"{list(head_logits[:, :, 0].shape)}, got {list(teacher_logits.shape)}")
    batch, length, num_heads, _ = head_logits.shape
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    total = head_logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for k in range(num_heads):
        shift = k + 2
        logits = head_logits[:, : max(length - shift, 0), k]  # [B, T - k - 2, V]
        labels, valid = tokens[:, shift:], mask[:, shift:]  # [B, T - k - 2]
        if teacher_logits is None:
            head_loss, top1 = _masked_cross_entropy(logits, labels, valid)
        else:
            teacher = teacher_logits[:, shift - 1: length - 1]  # the laws of tokens t + k + 2
            head_loss = _masked_mean(divergence(logits, target_log_probs(teacher)), valid)
            top1 = _agreement(logits, teacher, valid)
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
    mean = (per_position * valid).sum() / valid.sum().clamp(min=1.0)
    return mean.clamp(min=0.0)  # a KL is >= 0; between near-equal laws rounding dips below


def eagle_loss(
    predicted: torch.Tensor,
    head_logits: torch.Tensor,
    target_features: torch.Tensor,
    target_logits: torch.Tensor,
    valid: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    divergence: Divergence = forward_kl,
) -> LossOutput:
    """EAGLE-1/2 loss: feature_weight x smooth-L1 between the predicted and the target's next
    features, plus token_weight x `divergence` between the head's law and the target's.

    Every input is aligned row by row (the caller shifts): predicted [B, T, H] the head's f_{t+1}
    from (f_t, token t+1); head_logits [B, T, V] its scores through the target's LM head;
    target_features [B, T, H] the target's f_{t+1}; target_logits [B, T, V] the target's
    logits at t+1 (the law of token t+2); valid [B, T] which rows count (None: all).
    Metrics: the two terms and top-1, the share of rows where the head's argmax is the
    target's. No valid row gives 0 (gradients stay connected and finite).
    """
    _check_eagle_inputs(predicted, head_logits, target_features, target_logits, valid)
    rows = torch.ones(predicted.shape[:2], dtype=torch.bool, device=predicted.device)
    rows = rows if valid is None else valid.bool()
    feature = F.smooth_l1_loss(predicted.float(), target_features.float(),
                               reduction="none").mean(-1)  # [B, T]
    token = divergence(head_logits, target_log_probs(target_logits))  # [B, T]
    feature_loss, token_loss = _masked_mean(feature, rows), _masked_mean(token, rows)
    metrics = {"eagle/feature_loss": float(feature_loss.detach()),
               "eagle/token_loss": float(token_loss.detach()),
               "eagle/top1": _agreement(head_logits, target_logits, rows)}
    return LossOutput(feature_weight * feature_loss + token_weight * token_loss, metrics)


def eagle3_loss(
    step_outputs: list[torch.Tensor],
    target_logits: torch.Tensor,
    t2d: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    decay: float = 0.8,
    scores: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows,
    divergence: Divergence = forward_kl,
) -> LossOutput:
    """EAGLE-3's training-time-test loss: sum over steps j of decay**j x `divergence` between
    step j's draft-vocabulary law and the target's law restricted to the draft vocabulary.

    step_outputs: per step j, [B, T-1, ...]: row t scores token t+2+j (`EagleHead.unroll`);
    scores turns the rows that count ([n, ...]) into draft-vocabulary logits [n, Vd] (the
    head's norm and LM head, run on no other row; default: the outputs are the logits).
    target_logits: [B, T, V] the target's logits on the row (position i: the law of token i+1).
    t2d: [V] bool, the draft vocabulary. loss_mask: [B, T] whether a token is a prediction
    target (None: every token). Row t of step j counts when token t+2+j exists and counts, and
    the target's argmax at t+1+j lies in the draft vocabulary. Metrics per step: the loss,
    top-1 and tv, the mean total variation to the target's law: the chance that verification
    rejects a token drawn from the step's law (0 when no row counts).
    """
    if not decay > 0:
        raise ValueError(f"eagle3_loss: decay must be > 0 (step j weighs decay**j), got {decay}")
    batch, length, _ = target_logits.shape
    mask = torch.ones(batch, length, dtype=torch.bool, device=target_logits.device)
    mask = mask if loss_mask is None else loss_mask.bool()
    teacher = DraftTeacher.of(target_logits, t2d)
    total, metrics = target_logits.new_zeros((), dtype=torch.float32), {}
    for j, outputs in enumerate(step_outputs):
        n = max(length - 2 - j, 0)  # rows whose token t+2+j exists
        law = teacher.at(slice(1 + j, 1 + j + n))  # the laws of tokens t+2+j: [B, n, ...]
        rows = mask[:, 2 + j: 2 + j + n] & law.in_vocab  # [B, n]
        logits = scores(outputs[:, :n][rows])  # [m, Vd], the counted rows alone
        step = divergence(logits, law.log_probs[rows]).sum() / max(len(logits), 1)
        total = total + decay**j * step
        metrics[f"eagle3/step{j}_loss"] = float(step.detach())
        with torch.no_grad():  # what tau rewards, whatever the objective
            tv = total_variation(logits, law.log_probs[rows]).sum() / max(len(logits), 1)
        metrics[f"eagle3/step{j}_tv"] = float(tv)
        metrics[f"eagle3/step{j}_top1"] = _hits(logits, law.top[rows])
    return LossOutput(total, metrics)


@dataclass
class DraftTeacher:
    """The target's laws over a draft vocabulary, computed once for every step or copy of a
    loss to slice (per step, the argmax over the whole vocabulary and the restriction cost as
    much as the head's own step). in_vocab [B, T]: the target's argmax lies in the draft
    vocabulary; log_probs [B, T, Vd]: its law restricted to the draft vocabulary (fp32, log);
    top [B, T]: that law's argmax."""

    in_vocab: torch.Tensor
    log_probs: torch.Tensor
    top: torch.Tensor

    @classmethod
    def of(cls, target_logits: torch.Tensor, t2d: torch.Tensor) -> DraftTeacher:
        restricted = target_logits[..., t2d]
        return cls(t2d[target_logits.argmax(-1)], target_log_probs(restricted),
                   restricted.argmax(-1))

    def at(self, index: slice | torch.Tensor) -> DraftTeacher:
        """The laws at positions `index` (of dimension 1)."""
        return DraftTeacher(self.in_vocab[:, index], self.log_probs[:, index],
                            self.top[:, index])


def parallel_eagle3_loss(
    logits: torch.Tensor,
    copies: torch.Tensor,
    positions: torch.Tensor,
    target_logits: torch.Tensor,
    t2d: torch.Tensor,
    count: int,
    loss_mask: torch.Tensor | None = None,
    decay: float = 0.8,
    divergence: Divergence = forward_kl,
    pooled: bool = False,
) -> LossOutput:
    """P-EAGLE's loss: the sum over copies j of decay**j x `divergence` between copy j's
    draft-vocabulary law and the target's law restricted to the draft vocabulary, each
    copy's the mean over its counted rows; pooled: one mean over every counted row of every
    copy, row weights decay**j (speculators' P-EAGLE, undecayed: a copy weighs by its rows).

    logits [B, N, Vd]: the head's rows, row n of copy copies[n] [N] at position positions[n]
    [N], which scores token positions[n] + 2 whatever its copy (copy 0 holds the real pairs,
    copy j the j-th mask pair after the real pair positions[n] - j). target_logits [B, T, V],
    t2d and loss_mask as `eagle3_loss`'s: a row counts when its token exists and counts and
    the target's argmax there lies in the draft vocabulary. count: how many copies there are
    (K), each reported even if none of its rows was kept."""
    if not decay > 0:
        raise ValueError(f"parallel_eagle3_loss: decay must be > 0 (copy j weighs decay**j), "
                         f"got {decay}")
    batch, length, _ = target_logits.shape
    mask = torch.ones(batch, length, dtype=torch.bool, device=target_logits.device)
    mask = mask if loss_mask is None else loss_mask.bool()
    teacher = DraftTeacher.of(target_logits, t2d)
    total, metrics = target_logits.new_zeros((), dtype=torch.float32), {}
    counted = 0
    for j in range(count):
        picked = ((copies == j) & (positions + 2 < length)).nonzero().flatten()  # [n]
        at = positions[picked]  # copy j's rows whose token exists
        law = teacher.at(at + 1)  # the laws of tokens at + 2: [B, n, ...]
        rows = mask[:, at + 2] & law.in_vocab  # [B, n]
        scores = logits[:, picked]
        values = divergence(scores, law.log_probs)  # [B, n]
        part = _masked_mean(values, rows)
        if pooled:
            total = total + decay**j * (values * rows.float()).sum()
            counted += int(rows.sum())
        else:
            total = total + decay**j * part
        metrics[f"peagle/copy{j}_loss"] = float(part.detach())
        metrics[f"peagle/copy{j}_top1"] = _hits(scores, law.top, rows)
    return LossOutput(total / max(counted, 1) if pooled else total, metrics)


def exit_loss(
    exit_logits: torch.Tensor,
    target_logits: torch.Tensor,
    tokens: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    hard_weight: float = 0.0,
    divergence: Divergence = forward_kl,
) -> LossOutput:
    """An early exit's loss: `divergence` from the target's final law (Kangaroo: forward KL,
    the soft cross-entropy less the target's entropy), plus hard_weight x cross-entropy to the
    tokens themselves.

    exit_logits, target_logits: [B, T, V]; position t predicts token t + 1, so it counts when
    loss_mask[:, t + 1] is set (None: every position but the last). tokens [B, T]: needed
    when hard_weight > 0. Metrics: the soft term (the divergence), the KL to the target (0 for
    a perfect exit, whatever the objective) and top-1, the share of counted positions where
    both argmaxes agree (greedy drafting's acceptance, token by token).
    """
    _check_exit_inputs(exit_logits, target_logits, tokens, loss_mask, hard_weight)
    exit_rows, teacher = exit_logits[:, :-1], target_logits[:, :-1]  # [B, T-1, V]
    rows = torch.ones(teacher.shape[:2], dtype=torch.bool, device=teacher.device)
    rows = rows if loss_mask is None else loss_mask[:, 1:].bool()
    law = target_log_probs(teacher)  # [B, T-1, V]
    soft_loss = _masked_mean(divergence(exit_rows, law), rows)
    kl = soft_loss if divergence is forward_kl else _masked_mean(forward_kl(exit_rows, law), rows)
    metrics = {"soft_loss": float(soft_loss.detach()), "kl": float(kl.detach()),
               "top1": _agreement(exit_rows, teacher, rows)}
    if hard_weight == 0:
        return LossOutput(soft_loss, metrics)
    hard, _ = _masked_cross_entropy(exit_rows, tokens[:, 1:], rows)
    metrics["hard_loss"] = float(hard.detach())
    return LossOutput(soft_loss + hard_weight * hard, metrics)


def _check_exit_inputs(
    exit_logits: torch.Tensor, target_logits: torch.Tensor, tokens: torch.Tensor | None,
    loss_mask: torch.Tensor | None, hard_weight: float,
) -> None:
    if exit_logits.dim() != 3 or exit_logits.shape != target_logits.shape:
        raise ValueError(f"exit_loss: exit_logits and target_logits must both be [B, T, V], got "
                         f"{list(exit_logits.shape)} and {list(target_logits.shape)}")
    for name, value in (("loss_mask", loss_mask), ("tokens", tokens)):
        if value is not None and value.shape != exit_logits.shape[:2]:
            raise ValueError(f"exit_loss: {name} must be [B, T] = {list(exit_logits.shape[:2])}, "
                             f"got {list(value.shape)}")
    if not hard_weight >= 0:
        raise ValueError(f"exit_loss: hard_weight must be >= 0, got {hard_weight}")
    if hard_weight > 0 and tokens is None:
        raise ValueError("exit_loss: hard_weight > 0 needs the tokens (hard labels)")


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[...] -sum softmax(teacher) * log_softmax(logits) over the last dimension (fp32)."""
    return cross_entropy_to(logits, torch.softmax(teacher_logits.float(), dim=-1))


def cross_entropy_to(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[...] -sum probs * log_softmax(logits) over the last dimension (fp32)."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def _masked_mean(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean of values [B, T] over rows [B, T] (0, graph kept, when no row counts)."""
    weights = rows.float()
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def _agreement(logits: torch.Tensor, teacher_logits: torch.Tensor, rows: torch.Tensor) -> float:
    """Share of the counted rows where both argmaxes agree (0 when no row counts)."""
    return _hits(logits, teacher_logits.argmax(-1), rows)


def _hits(logits: torch.Tensor, wanted: torch.Tensor, rows: torch.Tensor | None = None
          ) -> float:
    """Share of the counted rows (None: all) where the argmax of logits is `wanted` (0 when
    none counts)."""
    same = logits.detach().argmax(-1) == wanted
    rows = torch.ones_like(same) if rows is None else rows
    return float((same & rows).sum()) / max(float(rows.sum()), 1.0)


def _check_eagle_inputs(
    predicted: torch.Tensor, head_logits: torch.Tensor, target_features: torch.Tensor,
    target_logits: torch.Tensor, valid: torch.Tensor | None,
) -> None:
    if predicted.dim() != 3 or target_features.shape != predicted.shape:
        raise ValueError(f"eagle_loss: predicted and target_features must both be [B, T, H], got "
                         f"{list(predicted.shape)} and {list(target_features.shape)}")
    if head_logits.dim() != 3 or head_logits.shape != target_logits.shape \
            or head_logits.shape[:2] != predicted.shape[:2]:
        raise ValueError(f"eagle_loss: head_logits and target_logits must both be [B, T, V] with "
                         f"[B, T] = {list(predicted.shape[:2])}, got {list(head_logits.shape)} "
                         f"and {list(target_logits.shape)}")
    if valid is not None and valid.shape != predicted.shape[:2]:
        raise ValueError(f"eagle_loss: valid must be [B, T] = {list(predicted.shape[:2])}, got "
                         f"{list(valid.shape)}")


def dflash_weights(slots: int, gamma: float, device: torch.device | str = "cpu"
                   ) -> torch.Tensor:
    """[slots] DFlash's position weights: slot k (1-based) weighs exp(-(k - 1) / gamma), so
    the first drafted tokens, on which every later one's acceptance depends, count most."""
    if not gamma > 0:
        raise ValueError(f"dflash: gamma must be > 0 (slot k weighs exp(-(k-1)/gamma)), "
                         f"got {gamma}")
    return torch.exp(-torch.arange(slots, device=device, dtype=torch.float32) / gamma)


def dflash_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    gamma: float,
    teacher_logits: torch.Tensor | None = None,
    divergence: Divergence = forward_kl,
    confidence: torch.Tensor | None = None,
) -> LossOutput:
    """A block drafter's loss: over blocks and their slots k = 1..K, the weighted mean of
    exp(-(k - 1) / gamma) x the cross-entropy of slot k's scores against the data (labels) or,
    given teacher_logits, `divergence` between slot k's law and the target's; plus, given the
    confidence head's logits [B, A, K], `confidence_loss` of them against each slot's top-1
    hit (the label, or the teacher's argmax).

    logits [B, A, K, V]: block a's slot k scores its token; labels [B, A, K] (ids among the V
    scored); valid [B, A, K] which slots count; teacher_logits [B, A, K, V] or None. Metrics:
    the loss and top-1 per slot (the share of counted slots whose argmax is the label, or the
    teacher's argmax), and `dflash/top1` over all slots. No valid slot gives 0."""
    if logits.dim() != 4 or labels.shape != logits.shape[:3] or valid.shape != labels.shape:
        raise ValueError(f"dflash_loss: logits [B, A, K, V] with labels and valid [B, A, K], "
                         f"got {list(logits.shape)}, {list(labels.shape)}, {list(valid.shape)}")
    if teacher_logits is not None and teacher_logits.shape != logits.shape:
        raise ValueError(f"dflash_loss: teacher_logits must be {list(logits.shape)}, got "
                         f"{list(teacher_logits.shape)}")
    slots = logits.shape[2]
    if teacher_logits is None:
        per_slot = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(),
                                   reduction="none").view(labels.shape)  # [B, A, K]
        wanted = labels
    else:
        per_slot = divergence(logits, target_log_probs(teacher_logits))
        wanted = teacher_logits.argmax(-1)
    weights = dflash_weights(slots, gamma, logits.device) * valid.float()  # [B, A, K]
    loss = (per_slot * weights).sum() / weights.sum().clamp(min=1e-12)
    hits = (logits.detach().argmax(-1) == wanted) & valid
    metrics = {"dflash/loss": float(loss.detach()),
               "dflash/top1": float(hits.sum()) / max(float(valid.sum()), 1.0)}
    for k in range(slots):
        count = float(valid[..., k].sum())
        metrics[f"dflash/slot{k + 1}_top1"] = float(hits[..., k].sum()) / max(count, 1.0)
    if confidence is None:
        return LossOutput(loss, metrics)
    confident = confidence_loss(confidence, hits, valid, "dflash/")
    return LossOutput(loss + confident.loss, metrics | confident.metrics)


def confidence_loss(logits: torch.Tensor, accepted: torch.Tensor, valid: torch.Tensor,
                    prefix: str = "") -> LossOutput:
    """A block drafter's confidence (`FeatureHead.acceptance_logits`) fitted by binary
    cross-entropy to whether each position's drafted token is accepted, counted where the
    position counts and every position before it in its block was accepted: position k learns
    its chance given positions 1..k-1 accepted, which the drafter multiplies into the chance of
    the prefix (`drafters.block.cumulative_acceptance`).

    The label is the 0/1 event "the position's top token is the target's" (the data's token
    where the target's law is not at hand, which a self-distilled row makes the target's
    greedy token): greedy verification's exact acceptance, where block drafters are used most,
    at hand with or without the target's law, and a rate BCE calibrates; a sampled draft's is
    the softer 1 - TV, which the event's chance follows where the laws are peaked.

    logits, accepted, valid [..., K], positions last. Metrics (`prefix`): the loss and the mean
    |sigmoid - accepted| over the counted positions (0 when none counts)."""
    if not logits.shape == accepted.shape == valid.shape:
        raise ValueError(f"confidence_loss: logits, accepted and valid must share one shape "
                         f"[..., K], got {list(logits.shape)}, {list(accepted.shape)}, "
                         f"{list(valid.shape)}")
    kept = (accepted.bool() & valid.bool()).long().cumprod(dim=-1).bool()  # [..., K]
    before = torch.ones_like(kept)
    before[..., 1:] = kept[..., :-1]  # every earlier position counted and accepted
    rows = valid.bool() & before
    target = accepted.float()
    bce = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none")
    loss = _masked_mean(bce, rows)
    error = _masked_mean((torch.sigmoid(logits.detach().float()) - target).abs(), rows)
    return LossOutput(loss, {f"{prefix}confidence_loss": float(loss.detach()),
                             f"{prefix}confidence_error": float(error)})


def parallel_confidence_loss(
    confidence: torch.Tensor,
    logits: torch.Tensor,
    copies: torch.Tensor,
    positions: torch.Tensor,
    target_logits: torch.Tensor,
    t2d: torch.Tensor,
    count: int,
    loss_mask: torch.Tensor | None = None,
) -> LossOutput:
    """P-EAGLE's confidence: `confidence_loss` over each anchor's copies, copy j the block's
    position j + 1. confidence [B, N]: the head's acceptance logits of its rows; logits,
    copies, positions, target_logits, t2d, count and loss_mask as `parallel_eagle3_loss`'s (a
    row counts where its token exists and counts and the target's argmax lies in the draft
    vocabulary; it is accepted where its top token is that argmax). A copy that was not kept
    counts nothing, nor do the copies after it."""
    batch, length, _ = target_logits.shape
    teacher = DraftTeacher.of(target_logits, t2d)
    mask = torch.ones(batch, length, dtype=torch.bool, device=target_logits.device)
    mask = mask if loss_mask is None else loss_mask.bool()
    exists = positions + 2 < length  # [N]
    law = teacher.at((positions + 1).clamp(max=length - 1))  # the laws of tokens p + 2
    counted = mask[:, (positions + 2).clamp(max=length - 1)] & law.in_vocab & exists  # [B, N]
    hits = logits.detach().argmax(-1) == law.top  # [B, N]
    anchor = positions - copies  # [N] the real pair each row drafts after
    shape = (batch, length, count)  # [B, anchors, K]
    accepted = torch.zeros(shape, dtype=torch.bool, device=logits.device)
    valid = torch.zeros_like(accepted)
    by_anchor = confidence.new_zeros(shape, dtype=torch.float32)
    accepted[:, anchor, copies] = hits
    valid[:, anchor, copies] = counted
    by_anchor[:, anchor, copies] = confidence.float()
    return confidence_loss(by_anchor, accepted, valid, "peagle/")
