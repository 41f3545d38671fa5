"""What every method's training objective is built from: a target plus a trainable head whose
forward is the loss.

`selfspec.training.loop.fit` trains any objective. A method's objective lives in its registering
module (`selfspec.from_config.methods.<method>`: `MedusaObjective`, `Medusa2Objective`,
`EagleObjective`, `Eagle3Objective` with P-EAGLE's pairs, `MtpObjective`, `EarlyExitObjective`,
`DraftModelObjective`, `DFlashObjective`), its head and that head's loss in `selfspec.heads`.
Here: what several share. Each takes `objective`, the name of the divergence its draft's law is
fitted to the target's by (`selfspec.divergences`: kl, the published default, tv, reverse_kl,
jsd, lk; `law_objective`). With a frozen target (`freeze`) its features are computed without
gradients, or read from a feature source (`feature_source`: `features.FeatureCache`, a feature
store's `features.StoredFeatures`; `frozen_states`, `frozen_outputs`), and handed to the head
explicitly. The block drafters share the replicated rows of PARD and P-EAGLE (`parallel_rows`)
and a confidence head's detached input (`detached_confidence`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.divergences import Divergence, divergence
from selfspec.heads.base import FeatureHead
from selfspec.model import Transformer
from selfspec.training.features import (
    FeatureCache,
    FeatureSource,
    TargetStates,
    target_states,
)


def law_objective(name: str, owner: str) -> Divergence:
    """The divergence called `name` (`divergences.DIVERGENCES`), refused naming `owner`."""
    try:
        return divergence(name)
    except ValueError as exc:
        raise ValueError(f"{owner}: {exc}") from None


def freeze(target: Transformer) -> Transformer:
    target.requires_grad_(False)
    return target.eval()


def feature_source(layers: tuple[int, ...], cache_features: bool,
                   features: FeatureSource | None, name: str) -> FeatureSource | None:
    """An objective's source of target states: `features` (e.g. a store), a `FeatureCache`
    when cache_features, or None (the target runs at every step)."""
    if features is None:
        return FeatureCache(layers) if cache_features else None
    if cache_features:
        raise ValueError(f"{name}: give cache_features or features (a feature store), not both")
    missing = sorted(set(layers) - set(features.layers))
    if missing:
        raise ValueError(f"{name}: the features lack the target's layers {missing}")
    return features


def frozen_states(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...],
                  features: FeatureSource | None) -> TargetStates:
    """The frozen target's states of rows tokens [B, T] (its last hidden state and the streams
    `layers`) from the feature source, or from its forward without the LM head."""
    if features is None:
        return target_states(target, tokens, layers)
    states = features.states(target, tokens)
    kept = dict(zip(features.layers, states.streams, strict=True))
    return TargetStates(states.last, tuple(kept[i] for i in layers))


def detached_confidence(head: FeatureHead, states: torch.Tensor) -> torch.Tensor | None:
    """A block drafter's confidence logits of its states [..., h] (None: the head has no
    confidence head), from the states detached: the confidence learns from the block, and its
    gradient never reaches the layers that make the block's laws."""
    if not head.config.confidence_head:
        return None
    return head.acceptance_logits(states.detach())


@dataclass(frozen=True)
class ParallelRows:
    """PARD's replicated rows of a batch [B, T] (K copies): tokens [B, K T] (the real row, then
    K - 1 rows of masks), positions [K T] (each copy at 0..T-1), mask [K T, K T] (None: one
    copy, causal) and loss_mask [B, K, T] (copy j's token p + 1 counts from p >= j, where a
    real token precedes its masks)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    loss_mask: torch.Tensor


def parallel_rows(tokens: torch.Tensor, loss_mask: torch.Tensor, copies: int,
                  mask_token_id: int | None) -> ParallelRows:
    """The rows a parallel draft trains on (`DraftModelObjective`); one copy: the row as it
    is, causal."""
    batch, length = tokens.shape
    device = tokens.device
    positions = torch.arange(length, device=device)
    if copies == 1:
        return ParallelRows(tokens, positions, None, loss_mask[:, None])
    masks = torch.full((batch, (copies - 1) * length), mask_token_id, dtype=tokens.dtype,
                       device=device)
    copy = torch.arange(copies, device=device).repeat_interleave(length)  # [K T]
    at = positions.repeat(copies)  # [K T]
    # Row (j, p) sees key (i, q): the real tokens q <= p - j (i = 0), and for 1 <= i <= j the
    # mask of copy i at q = p - j + i.
    j, p = copy[:, None], at[:, None]
    i, q = copy[None, :], at[None, :]
    sees = torch.where(i == 0, q <= p - j, (i <= j) & (q == p - j + i))  # [K T, K T]
    counted = loss_mask.bool()[:, None, :] & (positions[None, None, :] >= torch.arange(
        copies, device=device)[None, :, None] + 1)  # [B, K, T]: row p counts via token p + 1
    return ParallelRows(torch.cat([tokens, masks], dim=1), at, sees, counted)


def frozen_outputs(
    target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...],
    features: FeatureSource | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """What EAGLE heads and exits learn from, without gradients: the frozen target's last
    hidden states [B, T, H], its residual streams `layers` (each [B, T, H]), its logits
    [B, T, V] fp32 and its embeddings of tokens [B, T, H]. With a feature source (holding at
    least those layers) the target's layers do not run: its LM head is applied to the last
    hidden state, as its forward does."""
    with torch.no_grad():
        if features is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            out = target(tokens, positions, return_hidden=layers)
            last, streams, logits = out.last_hidden, out.hidden, out.logits
        else:
            states = frozen_states(target, tokens, layers, features)
            last, streams = states.last, states.streams
            logits = target.logits_of(last)  # what the forward computes from last
        return last, streams, logits, target.embed_tokens(tokens)
