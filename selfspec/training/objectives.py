"""Training objectives: a target plus a trainable head, whose forward is the loss.

`selfspec.training.loop.fit` trains any of these; each method adds one class here, and a head
and its loss in `selfspec.heads`. Each takes `objective`, the name of
the divergence its draft's law is fitted to the target's by (`selfspec.divergences`: kl, the
published default, tv, reverse_kl, jsd, lk). With a frozen target its features
are computed without gradients, or read from a feature source (`features.FeatureCache`, a
feature store's `features.StoredFeatures`), and handed to the head explicitly; Medusa-2 also
trains LoRA adapters on the target (`selfspec.model.lora`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checks import check_count, is_count
from selfspec.divergences import Divergence, divergence, kl_to_teacher
from selfspec.heads.base import LossOutput
from selfspec.heads.dflash import DFlashHead, PrefixKeys, dflash_loss
from selfspec.heads.draft_vocab import DraftVocab
from selfspec.heads.eagle import EagleHead
from selfspec.heads.eagle_losses import (
    eagle3_loss,
    eagle_loss,
    parallel_confidence_loss,
    parallel_eagle3_loss,
)
from selfspec.heads.early_exit import ExitHead, exit_loss
from selfspec.heads.medusa import MedusaHeads, medusa_loss
from selfspec.model import Transformer
from selfspec.training.features import (
    FeatureCache,
    FeatureSource,
    TargetStates,
    target_states,
)

if TYPE_CHECKING:
    from peft import PeftModel


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


class MedusaObjective(nn.Module):
    """Medusa-1: heads read the frozen target's last hidden state and learn the tokens after
    the next one (head k predicts t + k + 2), with per-head weights decay**k: the tokens'
    cross-entropy (objective kl, the published loss), or another objective against the
    target's own law of that token (its LM head over the same states, restricted to the
    heads' draft vocabulary).
    cache_features: keep each row's features (`FeatureCache`) for runs of many epochs;
    features: read them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, heads: MedusaHeads, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 objective: str = "kl"):
        super().__init__()
        self.target, self.heads, self.decay = freeze(target), heads, decay
        self.features = feature_source((), cache_features, features, "MedusaObjective")
        self.objective, self.divergence = objective, law_objective(objective, "MedusaObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
        labels, mask = self.heads.labels(tokens, loss_mask)
        logits = self.heads(hidden, self.target.lm_head)
        teacher = None
        if self.objective != "kl":
            with torch.no_grad():
                teacher = medusa_teacher(self.heads, self.target.logits_of(hidden))
        return medusa_loss(logits, labels, mask, decay=self.decay, teacher_logits=teacher,
                           divergence=self.divergence)


def medusa_teacher(heads: MedusaHeads, target_logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V'] the target's logits over the heads' draft vocabulary (all V without one)."""
    vocab = heads.draft_vocab
    return target_logits if vocab is None else target_logits[..., vocab.t2d]


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
        adapter_lr_scale: float = 0.25, objective: str = "kl",
    ):
        super().__init__()
        if not lm_weight >= 0:
            raise ValueError(f"Medusa2Objective: lm_weight must be >= 0, got {lm_weight}")
        if not adapter_lr_scale > 0:
            raise ValueError(
                f"Medusa2Objective: adapter_lr_scale must be > 0, got {adapter_lr_scale}")
        self.target, self.heads, self.decay, self.lm_weight = target, heads, decay, lm_weight
        self.adapter_lr_scale = adapter_lr_scale
        self.objective = objective
        self.divergence = law_objective(objective, "Medusa2Objective")

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
        # objectives other than kl meet the adapted target's law, which verification uses
        adapted = None if self.objective == "kl" else medusa_teacher(self.heads,
                                                                     out.logits.detach())
        heads = medusa_loss(logits, *self.heads.labels(tokens, loss_mask), decay=self.decay,
                            teacher_logits=adapted, divergence=self.divergence)
        kl = kl_to_teacher(out.logits, teacher, loss_mask)
        metrics = heads.metrics | {"medusa/lm_kl": float(kl.detach())}
        return LossOutput(heads.loss + self.lm_weight * kl, metrics)


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


class MtpObjective(EagleObjective):
    """FastMTP: a target's own MTP module (`head`, the drafter's `MtpHead` over it) fine-tuned
    on the frozen rest of the target. Row t reads (token t+1, the target's normed last hidden
    state h_t), as an EAGLE-1 head's row does, and the module's law of token t+2 meets the
    target's law there by `objective` (`EagleObjective`'s token term alone: the module's
    outputs are no features of the target's to regress on). Only the module's own layers
    train: the target, and a NextN module's LM head (a copy of the target's, which DeepSeek
    shares), stay frozen. feature_noise, cache_features and features as `EagleObjective`.

    steps > 1: FastMTP's recursion, the module applied again to its own outputs as a chain
    drafts: step s's row t reads token t+s and step s - 1's output at row t, and meets the
    target's law of token t+s+1 (`exit_loss`, position by position); step s weighs
    decay**(s - 1), the weights summing to 1, and the gradient flows through the chain."""

    def __init__(self, target: Transformer, head: nn.Module, feature_noise: float = 0.0,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 objective: str = "kl", steps: int = 1, decay: float = 0.8):
        super().__init__(target, head, feature_weight=0.0, token_weight=1.0,
                         feature_noise=feature_noise, cache_features=cache_features,
                         features=features, objective=objective)
        check_count("steps", steps, owner="MtpObjective")
        if not decay > 0:
            raise ValueError(f"MtpObjective: decay must be > 0, got {decay}")
        self.steps, self.decay = steps, float(decay)
        for name, param in head.module.named_parameters():  # freeze() froze the module too
            param.requires_grad_(not name.startswith("head."))

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        if self.steps > 1:
            return self._recursive(tokens, loss_mask)
        out = super().forward(tokens, loss_mask)  # its feature term weighs 0: not reported
        return LossOutput(out.loss, {k.replace("eagle/", "mtp/"): v for k, v in
                                     out.metrics.items() if k != "eagle/feature_loss"})

    def _recursive(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        last, _, target_logits, embeds = _target_states(self.target, tokens, (), self.features)
        weights = [self.decay ** s for s in range(self.steps)]
        feature, total, metrics = self._noisy(last), target_logits.new_zeros(()), {}
        for step, weight in enumerate(weights, 1):
            rows = tokens.shape[1] - step
            positions = torch.arange(rows, device=tokens.device)
            feature = self.head(embeds[:, step:], feature[:, :rows], positions)  # [B, rows, H]
            part = exit_loss(self.head.logits(feature), target_logits[:, step:],
                             loss_mask=loss_mask[:, step:], divergence=self.divergence)
            total = total + weight / sum(weights) * part.loss
            metrics |= {f"mtp/step{step}_loss": part.metrics["soft_loss"],
                        f"mtp/step{step}_top1": part.metrics["top1"]}
        return LossOutput(total, metrics | {"mtp/top1": metrics["mtp/step1_top1"]})


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
        last, streams, target_logits, embeds = _target_states(
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


class EarlyExitObjective(nn.Module):
    """Early exits at several layers E of the frozen target, trained together from one target
    forward (so that a sweep can pick E): each exit reads the residual stream after its layer
    and learns the target's final law (`exit_loss`: by `objective`, plus hard_weight x
    cross-entropy to the tokens). The loss is the mean over exits; metrics are per exit,
    `exit/E{E}_*`. features: the target's states read from elsewhere (a feature store holding
    the exit layers) instead of its forward."""

    def __init__(self, target: Transformer, heads: Sequence[ExitHead], hard_weight: float = 0.0,
                 features: FeatureSource | None = None, objective: str = "kl"):
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
        self.objective = objective
        self.divergence = law_objective(objective, "EarlyExitObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        layers = tuple(head.exit_layer for head in self.heads)
        _, streams, target_logits, _ = _target_states(self.target, tokens, layers, self.features)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        total, metrics = target_logits.new_zeros(()), {}
        for head, hidden in zip(self.heads, streams, strict=True):
            logits = head.logits(hidden, positions, self.target)  # [B, T, V]
            part = exit_loss(logits, target_logits, tokens, loss_mask, self.hard_weight,
                             self.divergence)
            total = total + part.loss / len(self.heads)
            metrics |= {f"exit/E{head.exit_layer}_{k}": v for k, v in part.metrics.items()}
        return LossOutput(total, metrics)


class DraftModelObjective(nn.Module):
    """A separate draft model distilled on the frozen target's law (`exit_loss`: by
    `objective`, plus hard_weight x cross-entropy to the tokens). Only the draft's
    parameters that require grad train (a draft cut from the target keeps its embedding and
    LM head frozen).

    draft_vocab: both laws restricted to those ids (EAGLE-3's loss), the draft scoring only
    them, as it will when drafting; on a small real target the full LM head and its softmax
    are most of a training step. cache_features: the target's last hidden states are computed
    once per row and its LM head re-applied, not its layers (see FeatureCache); features: read
    them from elsewhere (a feature store).

    parallel: K > 1 trains PARD's parallel draft, which fills k - 1 mask tokens
    (`mask_token_id`) after the last real one in one forward: the row is replicated K times
    (`parallel_rows`), copy j holding the mask at every position, and the mask at position p of
    copy j sees the real tokens up to p - j and the masks of copies 1..j at p - j + 1..p, so
    it stands where a draft's j-th mask stands and learns the target's law at p, as the
    real row does. Every copy's rows count alike."""

    def __init__(self, target: Transformer, draft: Transformer, hard_weight: float = 0.0,
                 cache_features: bool = False, draft_vocab: DraftVocab | None = None,
                 features: FeatureSource | None = None, parallel: int = 1,
                 mask_token_id: int | None = None, objective: str = "kl"):
        super().__init__()
        if not hard_weight >= 0:
            raise ValueError(f"DraftModelObjective: hard_weight must be >= 0, got {hard_weight}")
        if hard_weight and draft_vocab is not None:
            raise ValueError("DraftModelObjective: hard_weight > 0 with a draft vocabulary is not "
                             "supported (tokens outside it have no label); set one of them")
        if not is_count(parallel) or (parallel > 1) != (mask_token_id is not None):
            raise ValueError(f"DraftModelObjective: parallel must be an integer >= 1, with a "
                             f"mask_token_id when > 1, got {parallel!r} and {mask_token_id!r}")
        self.target, self.draft, self.hard_weight = freeze(target), draft, hard_weight
        self.parallel, self.mask_token_id = parallel, mask_token_id
        self.features = feature_source((), cache_features, features, "DraftModelObjective")
        self.objective = objective
        self.divergence = law_objective(objective, "DraftModelObjective")
        ids = None if draft_vocab is None else draft_vocab.target_ids
        self.register_buffer("vocab_ids", ids, persistent=False)

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
            teacher = self._scores(self.target, hidden)
        rows = parallel_rows(tokens, loss_mask, self.parallel, self.mask_token_id)
        out = self.draft(rows.tokens, rows.positions, mask=rows.mask, with_logits=False,
                         return_hidden=(self.draft.config.num_layers,))
        logits = self._scores(self.draft, self.draft.norm(out.hidden[0]))  # [B, K T, V]
        copies = logits.view(*tokens.shape[:1], self.parallel, tokens.shape[1], -1)
        parts = [exit_loss(copies[:, j], teacher, tokens, rows.loss_mask[:, j],
                           self.hard_weight, self.divergence) for j in range(self.parallel)]
        part = parts[0]
        metrics = {f"draft/{k}": v for k, v in part.metrics.items()}
        if self.parallel == 1:
            return LossOutput(part.loss, metrics)
        counts = rows.loss_mask[:, :, 1:].sum(dim=(0, 2)).float()  # [K] rows each copy counts
        loss = sum(p.loss * n for p, n in zip(parts, counts, strict=True)) / counts.sum().clamp(
            min=1.0)
        metrics |= {f"draft/mask{j}_top1": p.metrics["top1"] for j, p in enumerate(parts) if j}
        return LossOutput(loss, metrics)

    def _scores(self, model: Transformer, normed: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (or [B, T, K] over the draft vocabulary) of final-norm states."""
        weight = model.lm_head.weight
        weight = weight if self.vocab_ids is None else weight[self.vocab_ids]
        return model.final_logits(F.linear(normed, weight)).float()


def detached_confidence(head: DFlashHead | EagleHead, states: torch.Tensor
                        ) -> torch.Tensor | None:
    """A block drafter's confidence logits of its states [..., h] (None: the head has no
    confidence head), from the states detached: the confidence learns from the block, and its
    gradient never reaches the layers that make the block's laws."""
    if not head.config.confidence_head:
        return None
    return head.acceptance_logits(states.detach())


@dataclass(frozen=True)
class BlockFeatures:
    """What a block drafter learns from, of training rows [B, T]: the frozen target's residual
    streams at the head's `target_layers` (each [B, T, H]) and, for the loss against its law,
    its normed last hidden state [B, T, H] (None: cross-entropy against the data), whose
    logits come back through the target's LM head. A forward computes them
    (`DFlashObjective.features`); a feature store may supply them instead."""

    streams: tuple[torch.Tensor, ...]
    last_hidden: torch.Tensor | None = None


ANCHOR_RULES = ("next", "specforge")  # which positions may root a DFlash training block


class DFlashObjective(nn.Module):
    """DFlash: per row, `anchors` block starts are drawn among the positions `anchor_rule`
    allows (`anchor_blocks`; from `generator`, or torch's default generator, which `fit` seeds and
    checkpoints; held-out evaluation draws from a fixed seed). A block at anchor a is
    [token a, mask x (B - 1)] at positions a..a + B - 1; it attends to the context strictly
    before a (every draft layer's keys of the target's fused streams there) and to itself,
    bidirectionally, never to another block. Slot k predicts token a + k, scored against the
    data or (teacher=True) against the target's law at a + k - 1 by `objective`, slot k weighing
    exp(-(k - 1) / gamma) (`losses.dflash_loss`). With a draft vocabulary, slots whose token
    lies outside it do not count and the law is restricted to it.
    cache_features: keep each row's streams (`FeatureCache`) for runs of many epochs;
    features: read them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, head: DFlashHead, anchors: int = 16,
                 gamma: float = 4.0, teacher: bool = False,
                 generator: torch.Generator | None = None, cache_features: bool = False,
                 features: FeatureSource | None = None, objective: str = "kl",
                 anchor_rule: str = "next"):
        super().__init__()
        check_count("anchors", anchors, owner="DFlashObjective")
        if anchor_rule not in ANCHOR_RULES:
            raise ValueError(f"DFlashObjective: anchor_rule must be one of "
                             f"{', '.join(ANCHOR_RULES)}, got {anchor_rule!r}")
        if objective != "kl" and not teacher:
            raise ValueError(f"DFlashObjective: objective {objective!r} fits the draft's law to "
                             f"the target's: give teacher=True (against the data only kl, the "
                             f"cross-entropy, applies)")
        if not gamma > 0:
            raise ValueError(f"DFlashObjective: gamma must be > 0, got {gamma}")
        self.target, self.head, self.anchors = freeze(target), head, anchors
        self.gamma, self.teacher, self.generator = float(gamma), bool(teacher), generator
        self.anchor_rule = anchor_rule
        self.features = feature_source(head.config.target_layers, cache_features, features,
                                       "DFlashObjective")
        self.objective, self.divergence = objective, law_objective(objective, "DFlashObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        return self.loss(tokens, loss_mask, self.block_features(tokens))

    @torch.no_grad()
    def block_features(self, tokens: torch.Tensor) -> BlockFeatures:
        """The frozen target's streams (and last hidden state, for teacher=True) of rows
        tokens [B, T]."""
        states = frozen_states(self.target, tokens, self.head.config.target_layers,
                               self.features)
        return BlockFeatures(states.streams, states.last if self.teacher else None)

    def loss(self, tokens: torch.Tensor, loss_mask: torch.Tensor, features: BlockFeatures
             ) -> LossOutput:
        """The loss of rows tokens [B, T] (loss_mask [B, T]: which tokens are prediction
        targets) from their target features; no target layer runs here, only its embedding
        and LM head."""
        blocks = anchor_blocks(tokens, loss_mask, self.head.config, self.anchors,
                               self._generator(tokens.device), self.anchor_rule)
        states = self.block_states(features, blocks)  # [B, A, K, h]
        logits = self.head.logits(states, self.target.lm_head)  # [B, A, K, V']
        batch, length = tokens.shape
        labels, valid = blocks.labels, blocks.valid
        teacher = None
        if features.last_hidden is not None:
            at = (blocks.label_positions - 1).clamp(max=length - 1)  # [B, A, K]: law of a + k
            rows = features.last_hidden[torch.arange(batch, device=tokens.device)[:, None, None],
                                        at]  # [B, A, K, H]
            with torch.no_grad():
                teacher = self.target.logits_of(rows)  # [B, A, K, V]
        vocab = self.head.draft_vocab
        if vocab is not None:
            labels, kept = vocab.draft_ids(labels)
            valid = valid & kept
            if teacher is not None:
                teacher = teacher[..., vocab.t2d]
        return dflash_loss(logits, labels, valid, self.gamma, teacher, self.divergence,
                           detached_confidence(self.head, states))

    def block_logits(self, features: BlockFeatures, blocks: AnchorBlocks) -> torch.Tensor:
        """[B, A, K, V'] each block's slot scores (K = block_size - 1) over its context."""
        return self.head.logits(self.block_states(features, blocks), self.target.lm_head)

    def block_states(self, features: BlockFeatures, blocks: AnchorBlocks) -> torch.Tensor:
        """[B, A, K, h] each block's slot states (K = block_size - 1) over its context."""
        batch, length, _ = features.streams[0].shape
        context = self.head.context(features.streams)  # [B, T, h]
        positions = torch.arange(length, device=context.device)
        keys = PrefixKeys(self.head.context_keys(context, positions))
        embeds = self.target.embed_tokens(blocks.tokens).detach()  # [B, N, h]
        hidden = self.head(embeds, blocks.positions, keys, mask=blocks.mask)  # [B, N, h]
        size = self.head.config.block_size
        return hidden.view(batch, -1, size, hidden.shape[-1])[:, :, 1:]  # [B, A, K, h]

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.training:
            return self.generator
        return torch.Generator(device=device).manual_seed(0)  # the same held-out blocks


@dataclass(frozen=True)
class AnchorBlocks:
    """A batch's training blocks, A per row of B slots (N = A x B rows): tokens [B, N] (each
    block's anchor token, then the mask token), positions [B, N], mask [B, N, T + N] (the
    context strictly before its anchor, and its own block), label_positions [B, A, B - 1]
    (a + k), labels [B, A, B - 1] (the tokens there) and valid [B, A, B - 1] (a drawn anchor,
    a label inside the row and supervised)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    label_positions: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def anchor_blocks(tokens: torch.Tensor, loss_mask: torch.Tensor, config, anchors: int,
                  generator: torch.Generator | None, rule: str = "next") -> AnchorBlocks:
    """Up to `anchors` distinct anchors per row, drawn uniformly among the positions `rule`
    allows (fixed shapes: a row with fewer has blocks that count nothing), and the blocks at
    them. rule "next": a >= 1 whose next token a + 1 is supervised; "specforge" (SpecForge's
    rule): a >= 0 with tokens a and a + 1 both supervised (a = 0 roots a block with no
    context)."""
    batch, length = tokens.shape
    device, size = tokens.device, config.block_size
    count = max(1, min(anchors, length - 2))
    allowed = torch.zeros(batch, length, dtype=torch.bool, device=device)
    supervised = loss_mask.bool()
    if rule == "specforge":
        allowed[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    else:
        allowed[:, 1:-1] = supervised[:, 2:]  # anchor a: token a + 1 is supervised
    keys = torch.rand(batch, length, generator=generator, device=device)
    keys = keys.masked_fill(~allowed, -1.0)
    chosen, order = torch.topk(keys, count, dim=-1)  # [B, A]
    drawn, anchor = chosen >= 0, order  # [B, A] each
    offsets = torch.arange(size, device=device)
    positions = anchor[..., None] + offsets  # [B, A, S]
    ids = torch.full((batch, count, size), config.mask_token_id, dtype=torch.long,
                     device=device)
    ids[..., 0] = tokens.gather(1, anchor)
    label_positions = positions[..., 1:]  # [B, A, S - 1]
    inside = label_positions < length
    at = label_positions.clamp(max=length - 1).flatten(1)
    labels = tokens.gather(1, at).view_as(label_positions)
    supervised = loss_mask.bool().gather(1, at).view_as(label_positions)
    context = torch.arange(length, device=device) < anchor[..., None]  # [B, A, T]
    own = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool, device=device)] * count)
    mask = torch.cat([context.repeat_interleave(size, dim=1),
                      own.expand(batch, -1, -1)], dim=-1)  # [B, N, T + N]
    return AnchorBlocks(ids.flatten(1), positions.flatten(1), mask, label_positions, labels,
                        drawn[..., None] & inside & supervised)


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
