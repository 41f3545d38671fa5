"""EAGLE heads' losses: EAGLE-1/2's (`eagle_loss`: the next feature and the token), EAGLE-3's
training-time test (`eagle3_loss`, step by step over a draft vocabulary), P-EAGLE's copies
(`parallel_eagle3_loss`) and P-EAGLE's confidence (`parallel_confidence_loss`). Each is a pure
function of the head's outputs returning a `LossOutput`; where it fits the draft's law to the
target's, `divergence` says by which objective (`selfspec.divergences`: forward KL by
default)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.divergences import Divergence, forward_kl, target_log_probs, total_variation
from selfspec.heads.base import LossOutput, agreement, confidence_loss, hits, masked_mean


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
    feature_loss, token_loss = masked_mean(feature, rows), masked_mean(token, rows)
    metrics = {"eagle/feature_loss": float(feature_loss.detach()),
               "eagle/token_loss": float(token_loss.detach()),
               "eagle/top1": agreement(head_logits, target_logits, rows)}
    return LossOutput(feature_weight * feature_loss + token_weight * token_loss, metrics)


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


def eagle3_loss(
    step_outputs: list[torch.Tensor],
    target_logits: torch.Tensor | DraftTeacher,
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
    target_logits: [B, T, V] the target's logits on the row (position i: the law of token i+1),
    or their `DraftTeacher`.
    t2d: [V] bool, the draft vocabulary. loss_mask: [B, T] whether a token is a prediction
    target (None: every token). Row t of step j counts when token t+2+j exists and counts, and
    the target's argmax at t+1+j lies in the draft vocabulary. Metrics per step: the loss,
    top-1 and tv, the mean total variation to the target's law: the chance that verification
    rejects a token drawn from the step's law (0 when no row counts).
    """
    if not decay > 0:
        raise ValueError(f"eagle3_loss: decay must be > 0 (step j weighs decay**j), got {decay}")
    teacher, mask = _teacher_and_mask(target_logits, t2d, loss_mask)
    length = mask.shape[1]
    total, metrics = teacher.log_probs.new_zeros((), dtype=torch.float32), {}
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
        metrics[f"eagle3/step{j}_top1"] = hits(logits, law.top[rows])
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

    @classmethod
    def at_rows(cls, last: torch.Tensor, needed: torch.Tensor,
                logits_of: Callable[[torch.Tensor], torch.Tensor], t2d: torch.Tensor
                ) -> DraftTeacher:
        """The laws at the positions needed [B, T] marks alone, from the target's last hidden
        states [B, T, H] through its LM head (logits_of): a chat row's prompt is a third of
        its tokens, and the whole-vocabulary product a fifth of an EAGLE-3 step. Elsewhere
        in_vocab is False, so no loss row reads them."""
        part = cls.of(logits_of(last[needed]), t2d)  # [m, ...]
        in_vocab = torch.zeros_like(needed)
        log_probs = part.log_probs.new_zeros(*needed.shape, part.log_probs.shape[-1])
        top = part.top.new_zeros(needed.shape)
        in_vocab[needed], log_probs[needed], top[needed] = part.in_vocab, part.log_probs, part.top
        return cls(in_vocab, log_probs, top)

    @classmethod
    def given(cls, target: torch.Tensor | DraftTeacher, t2d: torch.Tensor) -> DraftTeacher:
        """target as it is when already a teacher, else the laws of its logits [B, T, V]."""
        return target if isinstance(target, DraftTeacher) else cls.of(target, t2d)

    def at(self, index: slice | torch.Tensor) -> DraftTeacher:
        """The laws at positions `index` (of dimension 1)."""
        return DraftTeacher(self.in_vocab[:, index], self.log_probs[:, index],
                            self.top[:, index])


def _teacher_and_mask(target_logits: torch.Tensor | DraftTeacher, t2d: torch.Tensor,
                      loss_mask: torch.Tensor | None) -> tuple[DraftTeacher, torch.Tensor]:
    """The target's laws over the draft vocabulary and the rows' mask [B, T] of tokens that
    are prediction targets (every token when loss_mask is None)."""
    teacher = DraftTeacher.given(target_logits, t2d)
    mask = torch.ones_like(teacher.in_vocab) if loss_mask is None else loss_mask.bool()
    return teacher, mask


def parallel_eagle3_loss(
    logits: torch.Tensor,
    copies: torch.Tensor,
    positions: torch.Tensor,
    target_logits: torch.Tensor | DraftTeacher,
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
    teacher, mask = _teacher_and_mask(target_logits, t2d, loss_mask)
    length = mask.shape[1]
    total, metrics = teacher.log_probs.new_zeros((), dtype=torch.float32), {}
    counted = 0
    for j in range(count):
        picked = ((copies == j) & (positions + 2 < length)).nonzero().flatten()  # [n]
        at = positions[picked]  # copy j's rows whose token exists
        law = teacher.at(at + 1)  # the laws of tokens at + 2: [B, n, ...]
        rows = mask[:, at + 2] & law.in_vocab  # [B, n]
        scores = logits[:, picked]
        values = divergence(scores, law.log_probs)  # [B, n]
        part = masked_mean(values, rows)
        if pooled:
            total = total + decay**j * (values * rows.float()).sum()
            counted += int(rows.sum())
        else:
            total = total + decay**j * part
        metrics[f"peagle/copy{j}_loss"] = float(part.detach())
        metrics[f"peagle/copy{j}_top1"] = hits(scores, law.top, rows)
    return LossOutput(total / max(counted, 1) if pooled else total, metrics)


def parallel_confidence_loss(
    confidence: torch.Tensor,
    logits: torch.Tensor,
    copies: torch.Tensor,
    positions: torch.Tensor,
    target_logits: torch.Tensor | DraftTeacher,
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
    teacher, mask = _teacher_and_mask(target_logits, t2d, loss_mask)
    batch, length = mask.shape
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
