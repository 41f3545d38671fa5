"""Training objectives, each a target plus a trainable head whose forward is the loss, and
what every method's objective is built from.

`selfspec.training.loop.fit` trains any of them. A method's objective lives in its registering
module (`selfspec.from_config.methods.<method>`: `MedusaObjective`, `Medusa2Objective`,
`MtpObjective`, `EarlyExitObjective`, `DraftModelObjective`, `DFlashObjective`), its head and
that head's loss in `selfspec.heads`; EAGLE's two (`EagleObjective`, `Eagle3Objective`, with
P-EAGLE's rows) stay here, which the MTP module's objective extends, and so do the rows that
PARD and P-EAGLE share (`parallel_rows`). Each takes `objective`, the name of the divergence
its draft's law is fitted to the target's by (`selfspec.divergences`: kl, the published
default, tv, reverse_kl, jsd, lk; `law_objective`). With a frozen target (`freeze`) its
features are computed without gradients, or read from a feature source (`feature_source`:
`features.FeatureCache`, a feature store's `features.StoredFeatures`; `frozen_states`,
`frozen_outputs`), and handed to the head explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.checks import check_count
from selfspec.divergences import Divergence, divergence
from selfspec.heads.base import LossOutput
from selfspec.heads.dflash import DFlashHead
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle_losses import (
    eagle3_loss,
    eagle_loss,
    parallel_confidence_loss,
    parallel_eagle3_loss,
)
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


class EagleObjective(nn.Module):
    """EAGLE-1 (and EAGLE-2, which drafts with the same heads): row t of the head reads
    (token t+1, the frozen target's feature f_t) and learns f_{t+1} (smooth-L1, weight
    feature_weight) and the target's law of token t+2 through the target's LM head (by
    `objective`, weight token_weight). Row t counts when token t+2 is a prediction target.

    feature_noise: during training the input features get uniform noise in
    [-feature_noise, feature_noise] (the head learns to read its own imperfect features), drawn
    from `generator` (None: torch's default generator, which `fit` seeds and checkpoints).
    cache_features: keep each row's last hidden states (`FeatureCache`; the noise is drawn
    afresh every step); features: read them from elsewhere (a feature store).
    """

    def __init__(self, target: Transformer, head: EagleHead, feature_weight: float = 1.0,
                 token_weight: float = 0.1, feature_noise: float = 0.0,
                 generator: torch.Generator | None = None, cache_features: bool = False,
                 features: FeatureSource | None = None, objective: str = "kl"):
        super().__init__()
        if head.config.version != 1:
            raise ValueError("EagleObjective trains EAGLE-1 heads; use Eagle3Objective for EAGLE-3")
        if not feature_noise >= 0:
            raise ValueError(f"EagleObjective: feature_noise must be >= 0, got {feature_noise}")
        self.target, self.head = freeze(target), head
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.feature_noise, self.generator = feature_noise, generator
        self.features = feature_source((), cache_features, features, "EagleObjective")
        self.objective, self.divergence = objective, law_objective(objective, "EagleObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            last = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
            embeds = self.target.embed_tokens(tokens)
        feature = self._noisy(last[:, :-1])  # [B, T-1, H] f_t for t <= T-2
        positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
        predicted = self.head(embeds[:, 1:], feature, positions)  # [B, T-1, H] f_{t+1}
        valid = torch.cat([loss_mask[:, 2:].bool(), loss_mask.new_zeros(
            loss_mask.shape[0], 1, dtype=torch.bool)], dim=1)  # [B, T-1]: token t+2 counts
        # Both LM heads score only the rows that count (a chat row's prompt does not): [1, n].
        kept, next_feature = predicted[valid][None], last[:, 1:][valid][None]
        with torch.no_grad():
            target_logits = self.target.logits_of(next_feature)
        return eagle_loss(kept, self.head.logits(kept, self.target.lm_head), next_feature,
                          target_logits, None, self.feature_weight, self.token_weight,
                          divergence=self.divergence)

    def _noisy(self, feature: torch.Tensor) -> torch.Tensor:
        if not self.training or self.feature_noise == 0:
            return feature
        noise = torch.rand(feature.shape, generator=self.generator, device=feature.device,
                           dtype=feature.dtype)  # [B, T-1, H] uniform in [0, 1)
        return feature + (2 * noise - 1) * self.feature_noise


class Eagle3Objective(nn.Module):
    """EAGLE-3: the head fuses the frozen target's layers `head.config.target_layers` and is
    trained by the training-time test (`EagleHead.unroll`, `steps` steps, step j weighing
    decay**j) against the target's law restricted to the head's draft vocabulary.
    cache_features: keep each row's fused streams and last hidden state (`FeatureCache`);
    features: read them from elsewhere (a feature store holding those layers).

    A P-EAGLE head (`parallel=K`) trains instead on its rows and K - 1 copies of mask pairs in
    one forward (`parallel_pairs`), copy j weighing decay**j (`parallel_eagle3_loss`); keep:
    PARD's conditional drop, each anchor's copy j kept with probability keep once its copy
    j - 1 is (1: every copy of every anchor), so with probability keep**j, or max(keep**j,
    keep_floor) (`copy_keep_chances`; speculators' P-EAGLE keeps max(0.7**j, 0.2) of its rows),
    drawn from `generator` (None: torch's default generator, which `fit` seeds and
    checkpoints; held-out evaluation draws from a fixed seed); pooled: one mean over every
    kept row in place of one a copy (speculators')."""

    def __init__(self, target: Transformer, head: EagleHead, steps: int = 7, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 keep: float = 0.5, generator: torch.Generator | None = None,
                 objective: str = "kl", keep_floor: float = 0.0, pooled: bool = False):
        super().__init__()
        if head.config.version != 3:
            raise ValueError("Eagle3Objective trains EAGLE-3 heads; use EagleObjective for EAGLE-1")
        check_count("steps", steps, owner="Eagle3Objective")
        if not 0 < keep <= 1:
            raise ValueError(f"Eagle3Objective: keep must be in (0, 1], got {keep}")
        if not 0 <= keep_floor <= 1:
            raise ValueError(f"Eagle3Objective: keep_floor must be in [0, 1], got {keep_floor}")
        self.target, self.head, self.steps, self.decay = freeze(target), head, steps, decay
        self.keep, self.keep_floor, self.generator = float(keep), float(keep_floor), generator
        self.pooled = bool(pooled)
        self.features = feature_source(head.config.target_layers, cache_features, features,
                                       "Eagle3Objective")
        self.objective, self.divergence = objective, law_objective(objective, "Eagle3Objective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        last, streams, target_logits, embeds = frozen_outputs(
            self.target, tokens, self.head.config.target_layers, self.features)
        feature = self.head.target_feature(last, streams)[:, :-1]  # [B, T-1, H]
        if self.head.config.parallel > 1:
            return self._parallel(tokens, loss_mask, feature, target_logits)
        hidden = self.head.unroll(embeds, feature, self.steps)  # steps x [B, T-1, H]
        # the head's LM head scores only the rows that count (a chat row's prompt does not)
        return eagle3_loss(hidden, target_logits, self.head.t2d, loss_mask, decay=self.decay,
                           scores=self.head.logits, divergence=self.divergence)

    def _parallel(self, tokens: torch.Tensor, loss_mask: torch.Tensor, feature: torch.Tensor,
                  target_logits: torch.Tensor) -> LossOutput:
        """P-EAGLE: row t of copy 0 reads (token t+1, f_t); copy j's row t, a mask pair,
        stands where a draft's j-th mask pair stands after the real pair t - j, and both score
        token t + 2."""
        config = self.head.config
        generator = self.generator if self.training else torch.Generator(
            device=tokens.device).manual_seed(0)  # the same held-out copies
        pairs = parallel_pairs(tokens[:, 1:], config.parallel, config.mask_token_id, self.keep,
                               generator, self.keep_floor)
        embeds = self.target.embed_tokens(pairs.tokens).detach()  # [B, N, h]
        masks = pairs.tokens.shape[1] - feature.shape[1]
        features = torch.cat([feature, self.head.mask_hidden.expand(
            feature.shape[0], masks, -1).to(feature)], dim=1)  # [B, N, h]
        hidden = self.head(embeds, features, pairs.positions, mask=pairs.mask)
        logits = self.head.logits(hidden)
        out = parallel_eagle3_loss(logits, pairs.copies, pairs.positions, target_logits,
                                   self.head.t2d, config.parallel, loss_mask, decay=self.decay,
                                   divergence=self.divergence, pooled=self.pooled)
        confidence = detached_confidence(self.head, hidden)
        if confidence is None:
            return out
        confident = parallel_confidence_loss(confidence, logits, pairs.copies, pairs.positions,
                                             target_logits, self.head.t2d, config.parallel,
                                             loss_mask)
        return LossOutput(out.loss + confident.loss, out.metrics | confident.metrics)


def detached_confidence(head: DFlashHead | EagleHead, states: torch.Tensor
                        ) -> torch.Tensor | None:
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


@dataclass(frozen=True)
class ParallelPairs:
    """P-EAGLE's rows of a batch of pairs [B, T]: tokens [B, N] (the real row, then the mask
    pairs kept), and of each row its copy [N] (0: real; j: the j-th mask pair after the real
    pair at position - j), position [N] and the attention mask [N, N]."""

    tokens: torch.Tensor
    copies: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


def copy_keep_chances(copies: int, keep: float, floor: float = 0.0) -> list[float]:
    """Copy j's chance (j = 1..copies - 1) to be kept once copy j - 1 is, such that copy j is
    kept with probability max(keep**j, floor): keep while keep**j >= floor (PARD's
    conditional drop), then what holds the kept share at the floor."""
    return [keep if keep**j >= floor else floor / max(keep ** (j - 1), floor)
            for j in range(1, copies)]


def kept_copies(length: int, copies: int, keep: float, floor: float,
                generator: torch.Generator | None, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """[length] how many mask copies each anchor keeps (copy j only when copies 1..j - 1
    are), by `copy_keep_chances`."""
    draws = torch.rand(length, copies - 1, generator=generator, device=device)
    chances = torch.tensor(copy_keep_chances(copies, keep, floor), dtype=draws.dtype,
                           device=device)
    return (draws < chances).long().cumprod(dim=1).sum(dim=1)


def parallel_pairs(tokens: torch.Tensor, copies: int, mask_token_id: int, keep: float,
                   generator: torch.Generator | None, keep_floor: float = 0.0
                   ) -> ParallelPairs:
    """The replicated rows of PARD (`parallel_rows`, whose attention a mask pair shares),
    thinned by its conditional drop: anchor a's copy j (at position a + j) is kept with
    probability keep once its copy j - 1 is (`kept_copies`: max(keep**j, keep_floor) in all),
    the same anchors for every row of the batch, so every kept row's keys are kept too."""
    length = tokens.shape[1]
    rows = parallel_rows(tokens, torch.ones_like(tokens), copies, mask_token_id)
    copy = torch.arange(copies, device=tokens.device).repeat_interleave(length)  # [K T]
    depth = kept_copies(length, copies, keep, keep_floor, generator, tokens.device)  # [T]
    anchor = rows.positions - copy  # [K T]
    kept = (copy == 0) | ((anchor >= 0) & (copy <= depth[anchor.clamp(min=0)]))
    picked = kept.nonzero().flatten()
    return ParallelPairs(rows.tokens[:, picked], copy[picked], rows.positions[picked],
                         rows.mask[picked][:, picked])


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
