"""Training objectives: a target plus a trainable head, whose forward is the loss.

`selfspec.training.loop.fit` trains any of these; each method adds one class here, a head in
`selfspec.heads` and a loss in `selfspec.training.losses`. With a frozen target its features
are computed without gradients, or read from a feature source (`features.FeatureCache`, a
feature store's `features.StoredFeatures`), and handed to the head explicitly; Medusa-2 also
trains LoRA adapters on the target (`selfspec.model.lora`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.draft_vocab import DraftVocab
from selfspec.heads.eagle import EagleHead
from selfspec.heads.early_exit import ExitHead
from selfspec.heads.medusa import MedusaHeads
from selfspec.model import Transformer
from selfspec.training.features import (
    FeatureCache,
    FeatureSource,
    TargetStates,
    target_states,
)
from selfspec.training.losses import (
    LossOutput,
    eagle3_loss,
    eagle_loss,
    exit_loss,
    kl_to_teacher,
    medusa_loss,
)

if TYPE_CHECKING:
    from peft import PeftModel


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


class MedusaObjective(nn.Module):
    """Medusa-1: heads read the frozen target's last hidden state and learn the tokens after
    the next one (head k predicts t + k + 2), with per-head weights decay**k.
    cache_features: keep each row's features (`FeatureCache`) for runs of many epochs;
    features: read them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, heads: MedusaHeads, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None):
        super().__init__()
        self.target, self.heads, self.decay = freeze(target), heads, decay
        self.features = feature_source((), cache_features, features, "MedusaObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
        labels, mask = self.heads.labels(tokens, loss_mask)
        logits = self.heads(hidden, self.target.lm_head)
        return medusa_loss(logits, labels, mask, decay=self.decay)


class Medusa2Objective(nn.Module):
    """Medusa-2: heads and LoRA adapters on the target train together.

    The heads read the *adapted* target's hidden state. The adapted target's own LM head is
    what verification will use, so its law is pulled towards the unadapted target's by a KL
    term weighted lm_weight; the teacher is the same model with its adapters disabled, so no
    second copy of the target is held.
    target: the target wrapped by `selfspec.model.lora.add_lora` (only the adapters train).
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
        logits = self.heads(out.last_hidden, self.target.get_base_model().lm_head)
        heads = medusa_loss(logits, *self.heads.labels(tokens, loss_mask), decay=self.decay)
        kl = kl_to_teacher(out.logits, teacher, loss_mask)
        metrics = heads.metrics | {"medusa/lm_kl": float(kl.detach())}
        return LossOutput(heads.loss + self.lm_weight * kl, metrics)


class EagleObjective(nn.Module):
    """EAGLE-1 (and EAGLE-2, which drafts with the same heads): row t of the head reads
    (token t+1, the frozen target's feature f_t) and learns f_{t+1} (smooth-L1, weight
    feature_weight) and the target's law of token t+2 through the target's LM head (soft
    cross-entropy, weight token_weight). Row t counts when token t+2 is a prediction target.

    feature_noise: during training the input features get uniform noise in
    [-feature_noise, feature_noise] (the head learns to read its own imperfect features), drawn
    from `generator` (None: torch's default generator, which `fit` seeds and checkpoints).
    cache_features: keep each row's last hidden states (`FeatureCache`; the noise is drawn
    afresh every step); features: read them from elsewhere (a feature store).
    """

    def __init__(self, target: Transformer, head: EagleHead, feature_weight: float = 1.0,
                 token_weight: float = 0.1, feature_noise: float = 0.0,
                 generator: torch.Generator | None = None, cache_features: bool = False,
                 features: FeatureSource | None = None):
        super().__init__()
        if head.config.version != 1:
            raise ValueError("EagleObjective trains EAGLE-1 heads; use Eagle3Objective for EAGLE-3")
        if not feature_noise >= 0:
            raise ValueError(f"EagleObjective: feature_noise must be >= 0, got {feature_noise}")
        self.target, self.head = freeze(target), head
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.feature_noise, self.generator = feature_noise, generator
        self.features = feature_source((), cache_features, features, "EagleObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        last, _, target_logits, embeds = _target_states(self.target, tokens, (), self.features)
        feature = self._noisy(last[:, :-1])  # [B, T-1, H] f_t for t <= T-2
        positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
        predicted = self.head(embeds[:, 1:], feature, positions)  # [B, T-1, H] f_{t+1}
        logits = self.head.logits(predicted, self.target.lm_head)  # [B, T-1, V]
        valid = torch.cat([loss_mask[:, 2:].bool(), loss_mask.new_zeros(
            loss_mask.shape[0], 1, dtype=torch.bool)], dim=1)  # [B, T-1]: token t+2 counts
        return eagle_loss(predicted, logits, last[:, 1:], target_logits[:, 1:], valid,
                          self.feature_weight, self.token_weight)

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
    features: read them from elsewhere (a feature store holding those layers)."""

    def __init__(self, target: Transformer, head: EagleHead, steps: int = 7, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None):
        super().__init__()
        if head.config.version != 3:
            raise ValueError("Eagle3Objective trains EAGLE-3 heads; use EagleObjective for EAGLE-1")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"Eagle3Objective: steps must be an integer >= 1, got {steps!r}")
        self.target, self.head, self.steps, self.decay = freeze(target), head, steps, decay
        self.features = feature_source(head.config.target_layers, cache_features, features,
                                       "Eagle3Objective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        last, streams, target_logits, embeds = _target_states(
            self.target, tokens, self.head.config.target_layers, self.features)
        feature = self.head.target_feature(last, streams)[:, :-1]  # [B, T-1, H]
        hidden = self.head.unroll(embeds, feature, self.steps)  # steps x [B, T-1, H]
        logits = [self.head.logits(h) for h in hidden]  # steps x [B, T-1, Vd]
        return eagle3_loss(logits, target_logits, self.head.t2d, loss_mask, decay=self.decay)


class EarlyExitObjective(nn.Module):
    """Early exits at several layers E of the frozen target, trained together from one target
    forward (so that a sweep can pick E): each exit reads the residual stream after its layer
    and learns the target's final law (`exit_loss`: soft cross-entropy, plus hard_weight x
    cross-entropy to the tokens). The loss is the mean over exits; metrics are per exit,
    `exit/E{E}_*`. features: the target's states read from elsewhere (a feature store holding
    the exit layers) instead of its forward."""

    def __init__(self, target: Transformer, heads: Sequence[ExitHead], hard_weight: float = 0.0,
                 features: FeatureSource | None = None):
        super().__init__()
        layers = [head.exit_layer for head in heads]
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"EarlyExitObjective: give one exit per layer E (at least one), "
                             f"got exit layers {layers}")
        if not hard_weight >= 0:
            raise ValueError(f"EarlyExitObjective: hard_weight must be >= 0, got {hard_weight}")
        self.target, self.heads = freeze(target), nn.ModuleList(heads)
        self.hard_weight = hard_weight
        self.features = feature_source(tuple(layers), False, features, "EarlyExitObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        layers = tuple(head.exit_layer for head in self.heads)
        _, streams, target_logits, _ = _target_states(self.target, tokens, layers, self.features)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        total, metrics = target_logits.new_zeros(()), {}
        for head, hidden in zip(self.heads, streams, strict=True):
            logits = head.logits(hidden, positions, self.target)  # [B, T, V]
            part = exit_loss(logits, target_logits, tokens, loss_mask, self.hard_weight)
            total = total + part.loss / len(self.heads)
            metrics |= {f"exit/E{head.exit_layer}_{k}": v for k, v in part.metrics.items()}
        return LossOutput(total, metrics)


class DraftModelObjective(nn.Module):
    """A separate draft model distilled on the frozen target's law (`exit_loss`: soft
    cross-entropy, plus hard_weight x cross-entropy to the tokens). Only the draft's
    parameters that require grad train (a draft cut from the target keeps its embedding and
    LM head frozen).

    draft_vocab: both laws restricted to those ids (EAGLE-3's loss), the draft scoring only
    them, as it will when drafting; on a small real target the full LM head and its softmax
    are most of a training step. cache_features: the target's last hidden states are computed
    once per row and its LM head re-applied, not its layers (see FeatureCache); features: read
    them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, draft: Transformer, hard_weight: float = 0.0,
                 cache_features: bool = False, draft_vocab: DraftVocab | None = None,
                 features: FeatureSource | None = None):
        super().__init__()
        if not hard_weight >= 0:
            raise ValueError(f"DraftModelObjective: hard_weight must be >= 0, got {hard_weight}")
        if hard_weight and draft_vocab is not None:
            raise ValueError("DraftModelObjective: hard_weight > 0 with a draft vocabulary is not "
                             "supported (tokens outside it have no label); set one of them")
        self.target, self.draft, self.hard_weight = freeze(target), draft, hard_weight
        self.features = feature_source((), cache_features, features, "DraftModelObjective")
        ids = None if draft_vocab is None else draft_vocab.target_ids
        self.register_buffer("vocab_ids", ids, persistent=False)

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        with torch.no_grad():
            hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
            teacher = self._scores(self.target, hidden)
        out = self.draft(tokens, positions, with_logits=False,
                         return_hidden=(self.draft.config.num_layers,))
        logits = self._scores(self.draft, self.draft.norm(out.hidden[0]))
        part = exit_loss(logits, teacher, tokens, loss_mask, self.hard_weight)
        return LossOutput(part.loss, {f"draft/{k}": v for k, v in part.metrics.items()})

    def _scores(self, model: Transformer, normed: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (or [B, T, K] over the draft vocabulary) of final-norm states."""
        weight = model.lm_head.weight
        weight = weight if self.vocab_ids is None else weight[self.vocab_ids]
        return model.final_logits(F.linear(normed, weight)).float()


def _target_states(
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
