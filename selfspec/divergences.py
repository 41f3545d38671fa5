"""The distribution-matching objectives a draft's law q is fitted to the target's law p by:
one name, one pure function, for every trainer's loss (`DIVERGENCES`, `divergence`); and the
cross-entropies and the next-token KL to a teacher that several methods' losses share.

Speculative sampling keeps a token drafted from q with probability
alpha(p, q) = sum_v min(p_v, q_v) = 1 - TV(p, q), so tau rewards a small total variation;
forward KL, the published default, bounds it (Pinsker: TV <= sqrt(KL / 2)) without aiming at
it. Every function here maps the draft's logits [..., V] and the target's log-probabilities
[..., V] to one value per row [...] (fp32), zero exactly where q == p; the masked mean over
rows is `divergence_loss`. The target's law carries no gradient (a frozen teacher): callers
pass it detached, or computed under no_grad.

  kl          KL(p || q) = sum_v p_v (log p_v - log q_v): mass-covering; its gradient in the
              logits is q - p. Against a one-hot p (hard labels) it is the cross-entropy.
  tv          TV(p, q) = 1/2 sum_v |p_v - q_v| = 1 - alpha(p, q): the rejection rate itself.
              Its gradient in the draft's logits z goes through q = softmax(z):
              dTV/dz_j = q_j (g_j - sum_v q_v g_v) with g = 1/2 sign(q - p), so it vanishes
              where q puts little mass: a draft far from the target learns slowly. It has a
              kink where q_v = p_v (there autograd takes a subgradient, |g_v| <= 1/2).
  reverse_kl  KL(q || p) = sum_v q_v (log q_v - log p_v): mode-seeking.
  jsd         JSD(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2: symmetric,
              bounded by log 2.
  lk          The LK hybrid (Samarin et al. 2026, "LK Losses"): per row,
              lambda KL(p || q) + (1 - lambda) TV(p, q) with lambda = exp(-eta alpha),
              alpha = 1 - TV(p, q) held constant (no gradient) and eta = 3. Where the draft
              is poor (alpha near 0) it is mostly KL, whose gradient does not vanish; as
              acceptance rises it turns to TV, the quantity tau rewards. The sources agree
              on the form and on eta = 3 (speculators' `lk_hybrid`: lambda = exp(-3 alpha),
              detached) but not on where alpha is taken: SpecForge's DFlash loss weighs each
              position by its own alpha, as here; SpecForge's EAGLE-3 loss and NVIDIA
              ModelOpt take one lambda per batch from the mean acceptance (SpecForge also
              scales KL's weight by a `kl_scale`, 1 here). The per-row form keeps every
              objective a mean of per-row values, which masks and the trainers' per-step
              weights compose with.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LK_ETA = 3.0  # the LK hybrid's decay: lambda = exp(-LK_ETA * alpha)


def acceptance(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] alpha = sum_v min(p_v, q_v): the chance that speculative sampling keeps a token
    drawn from q = softmax(logits) against p = exp(target_log_probs)."""
    return torch.minimum(target_log_probs.float().exp(), _probs(logits)).sum(-1)


def forward_kl(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] KL(p || q) = sum_v p_v (log p_v - log q_v) (0 log 0 = 0)."""
    return _kl(target_log_probs.float(), _log_probs(logits))


def total_variation(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] TV(p, q) = 1/2 sum_v |p_v - q_v| = 1 - alpha(p, q)."""
    return 0.5 * (target_log_probs.float().exp() - _probs(logits)).abs().sum(-1)


def reverse_kl(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] KL(q || p) = sum_v q_v (log q_v - log p_v)."""
    return _kl(_log_probs(logits), target_log_probs.float())


def jensen_shannon(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] JSD(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m), m = (p + q) / 2."""
    log_p, log_q = target_log_probs.float(), _log_probs(logits)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    return 0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))


def lk_hybrid(logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] lambda KL(p || q) + (1 - lambda) TV(p, q), lambda = exp(-3 alpha), alpha = 1 - TV
    held constant (see the module's docstring)."""
    tv = total_variation(logits, target_log_probs)
    weight = torch.exp(-LK_ETA * (1.0 - tv.detach()))
    return weight * forward_kl(logits, target_log_probs) + (1.0 - weight) * tv


DIVERGENCES: dict[str, Divergence] = {
    "kl": forward_kl, "tv": total_variation, "reverse_kl": reverse_kl, "jsd": jensen_shannon,
    "lk": lk_hybrid,
}


def divergence(name: str) -> Divergence:
    """The objective called `name` (one of `DIVERGENCES`)."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown objective {name!r}: choose one of {', '.join(DIVERGENCES)}")
    return DIVERGENCES[name]


def divergence_loss(name: str, logits: torch.Tensor, target: torch.Tensor,
                    mask: torch.Tensor | None = None, target_is_logits: bool = True
                    ) -> torch.Tensor:
    """The mean of objective `name` over the rows mask [...] keeps (None: all; none kept
    gives 0 with the graph kept): draft logits [..., V] against the target's logits [..., V]
    (target_is_logits) or its probabilities."""
    if logits.shape != target.shape:
        raise ValueError(f"divergence_loss: logits and target must have one shape, got "
                         f"{list(logits.shape)} and {list(target.shape)}")
    per_row = divergence(name)(logits, target_log_probs(target, target_is_logits))
    if mask is None:
        return per_row.mean()
    weights = mask.float()
    return (per_row * weights).sum() / weights.sum().clamp(min=1.0)


def target_log_probs(target: torch.Tensor, is_logits: bool = True) -> torch.Tensor:
    """[..., V] the target's log-probabilities (fp32, no gradient) from its logits or its
    probabilities (zeros stay -inf: a law restricted to some tokens)."""
    target = target.detach().float()
    return torch.log_softmax(target, dim=-1) if is_logits else target.log()


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[...] -sum softmax(teacher) * log_softmax(logits) over the last dimension (fp32)."""
    return cross_entropy_to(logits, torch.softmax(teacher_logits.float(), dim=-1))


def cross_entropy_to(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[...] -sum probs * log_softmax(logits) over the last dimension (fp32)."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)



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


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """[...] KL(a || b) from log-probabilities, terms where a_v = 0 counting 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)
