"""DFlash: a block drafter that proposes a whole block of tokens in one forward.

A block is [the last committed token, mask x (B - 1)] at the next B positions; attention inside
the block is bidirectional, so slot k (1 <= k < B) reads every other slot and its output scores
the token k positions after the root. The mask slots all carry one fixed token id of the
target's vocabulary (`mask_token_id`, through the target's own frozen embedding), as the
published DFlash drafts do: nothing about the mask is learned but what the layers make of it.

Conditioning: the target's residual streams at `target_layers` (hidden l = the stream after l
layers; by default several, spaced as the references space them: the outputs of layers 1 to
L - 3), concatenated, through `fc` and `hidden_norm`, give one context vector per committed
position. Every draft layer projects those vectors with its own k/v products (and RoPE at their
positions) into keys and values placed in front of the block's own: the context never passes
through the layers' MLPs, only into their attention.

Layers: `num_layers` decoder layers of the target's kind (`selfspec.model.DecoderLayer`), with
Qwen3's per-head q/k RMSNorm when `qk_norm` (the layers every published DFlash draft and every
engine that serves one uses); then a final `norm`. No embedding and, by default, no LM head:
the target's embedding and LM head are used. With `draft_vocab_size` the head scores a reduced
vocabulary with an LM head of its own (`d2t`, `t2d`: `selfspec.heads.draft_vocab`).

Parameter names are the published checkpoints': layers.{i}.self_attn.{q,k,v,o}_proj,
layers.{i}.self_attn.{q,k}_norm, layers.{i}.mlp.*, layers.{i}.{input,post_attention}_layernorm,
norm, fc, hidden_norm (and lm_head, d2t, t2d with a draft vocabulary). Trainable modules only:
no decoding logic here (`selfspec.drafters.dflash` drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checks import is_count, is_int_in
from selfspec.divergences import Divergence, forward_kl, target_log_probs
from selfspec.heads.base import (
    AttentionShape,
    FeatureHead,
    FeatureHeadConfig,
    LossOutput,
    confidence_loss,
    vocab_scores,
)
from selfspec.model import (
    DecoderLayer,
    Linear,
    ModelConfig,
    RMSNorm,
    Rope,
    apply_rope,
)


def default_target_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` residual streams of a target of num_layers layers, spaced evenly from the output
    of layer 1 to that of layer L - 3 (the references' rule; one stream: the middle layer's
    output), in selfspec's numbering (hidden l = the stream after l layers = the output of
    layer l - 1): for 36 layers and 5 streams, 2, 10, 18, 26, 34."""
    if count < 1 or num_layers < 1:
        raise ValueError(f"DFlash: need >= 1 target layer and >= 1 stream, got {num_layers} "
                         f"layers and {count} streams")
    if count == 1:
        outputs = [num_layers // 2]
    else:
        start, end = 1, max(num_layers - 3, 1)
        outputs = [round(start + i * (end - start) / (count - 1)) for i in range(count)]
    return tuple(min(out + 1, num_layers) for out in outputs)


@dataclass(frozen=True, kw_only=True)
class DFlashConfig(FeatureHeadConfig):
    """hidden_size, vocab_size: the target's; the layers' sizes (intermediate_size, heads,
    head_dim, RoPE, biases) default to the target's (`for_target`).
    num_layers: the draft's own decoder layers. block_size: B, the slots of one forward (the
    root and B - 1 masks): it drafts up to B - 1 tokens. mask_token_id: the target token whose
    embedding every mask slot carries. target_layers: the fused residual streams of the target
    (hidden l = after l layers). target_hidden_size: their width (None: hidden_size).
    draft_vocab_size: a reduced vocabulary scored by the head's own LM head (None: the
    target's LM head scores the whole vocabulary). qk_norm: per-head q/k RMSNorm (Qwen3's
    layers, which the engines build). confidence_head: a per-position confidence
    (`FeatureHead.acceptance_logits`) that sizes the block the drafter proposes."""

    num_layers: int = 1
    block_size: int = 8
    mask_token_id: int
    target_layers: tuple[int, ...]
    qk_norm: bool = True

    def __post_init__(self) -> None:
        self._check_counts("hidden_size", "vocab_size", "intermediate_size", "num_heads",
                           "num_kv_heads", "head_dim", "num_layers")
        if not is_count(self.block_size, 2):
            raise ValueError(f"DFlashConfig: block_size must be an integer >= 2 (the root and "
                             f"at least one mask), got {self.block_size!r}")
        if not is_int_in(self.mask_token_id, range(self.vocab_size)):
            raise ValueError(f"DFlashConfig: mask_token_id must be a token id in "
                             f"[0, {self.vocab_size}), got {self.mask_token_id!r}")
        if not self.target_layers or not all(is_count(i, 0) for i in self.target_layers):
            raise ValueError(f"DFlashConfig: target_layers must be one or more layer ids >= 0, "
                             f"got {self.target_layers!r}")
        if self.draft_vocab_size is not None:
            self._check_draft_vocab_size()

    @classmethod
    def for_target(
        cls, target: ModelConfig, *, mask_token_id: int, num_layers: int = 1,
        block_size: int = 8, target_layers: tuple[int, ...] | None = None,
        num_features: int = 3, draft_vocab_size: int | None = None, qk_norm: bool = True,
        confidence_head: bool = False,
    ) -> DFlashConfig:
        """A head whose layers are sized like the target's; target_layers default to
        `num_features` streams spaced as `default_target_layers` spaces them."""
        layers = target_layers or default_target_layers(target.num_layers, num_features)
        return cls(**AttentionShape.of_target(target), intermediate_size=target.intermediate_size,
                   mlp_bias=target.mlp_bias, num_layers=num_layers, block_size=block_size,
                   mask_token_id=mask_token_id, target_layers=tuple(layers),
                   target_hidden_size=target.hidden_size, draft_vocab_size=draft_vocab_size,
                   qk_norm=qk_norm, confidence_head=bool(confidence_head))



class DFlashHead(FeatureHead):
    """A DFlash block drafter's trainable part: `context(streams)` fuses the target's states,
    `write_context` turns them into every layer's keys and values in a cache, `forward` runs
    a block over that cache and returns its normed hidden states; `logits` scores them."""

    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        layer, h = config.layer_config(), config.hidden_size
        self.layers = nn.ModuleList(_draft_layer(layer, i, config.qk_norm)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = Linear(config.feature_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        if config.owns_lm_head:
            self._add_lm_head()
        self._add_confidence()
        self.rope = Rope.of(layer)  # fp32, not a buffer: head.to(bf16) keeps the frequencies

    # ---- the context ---------------------------------------------------------------------

    def context(self, streams: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[..., h] the context vectors of the target's streams (`target_layers` order, each
        [..., target_hidden])."""
        if len(streams) != len(self.config.target_layers):
            raise ValueError(f"DFlashHead: it fuses {len(self.config.target_layers)} target "
                             f"states (layers {self.config.target_layers}), got {len(streams)}")
        return self.hidden_norm(self.fc(torch.cat(streams, dim=-1)))

    def context_keys(self, context: torch.Tensor, positions: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys (RoPE at `positions` [C] or [B, C]) and values [B, H_kv, C, D] of
        context vectors [B, C, h]: what the block attends to ahead of its own slots."""
        cos, sin = self._rope(positions, context.dtype)
        keys = []
        for layer in self.layers:
            _, k, v = layer.self_attn.projections(context)
            keys.append((apply_rope(k, cos, sin), v))
        return keys

    def write_context(self, context: torch.Tensor, positions: torch.Tensor, cache) -> None:
        """Write the context vectors' keys and values into `cache` (KVCache-like, one layer per
        draft layer) at its next slots, and advance it by C."""
        for i, (k, v) in enumerate(self.context_keys(context, positions)):
            cache.write(i, k, v)
        cache.advance(context.shape[1])

    # ---- a block -------------------------------------------------------------------------

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, h] the block's slots: the root's embedding, the masks'
        positions: torch.Tensor,  # [T] or [B, T]
        cache=None,
        mask: torch.Tensor | None = None,  # [T, past + T] bool; None: every slot
    ) -> torch.Tensor:
        """The block's normed hidden states [B, T, h]. The slots attend to the cache (the
        context written there, or `PrefixKeys`) and to one another as `mask` says (default:
        every cached slot and the whole block, bidirectionally); with a KVCache the block's
        own keys are written there too and it advances by T (the drafter cuts them off)."""
        t = embeds.shape[1]
        if mask is None:
            past = 0 if cache is None else cache.length
            mask = torch.ones(t, past + t, dtype=torch.bool, device=embeds.device)
        cos, sin, attn_mask = self.rope_and_mask(embeds, positions, cache, mask)
        hidden = embeds
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attn_mask, cache)
        if cache is not None:
            cache.advance(t)
        return self.norm(hidden)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.rope.cos_sin(positions, dtype)

    # ---- token scores ----------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """[..., output_vocab_size] fp32 scores of normed hidden states: through the head's own
        LM head (a draft vocabulary) or the target's (pass it)."""
        if self.config.owns_lm_head:
            return vocab_scores(self.lm_head, hidden)
        if lm_head is None:
            raise ValueError("DFlashHead.logits: the head scores through the target's LM head: "
                             "pass lm_head=target.lm_head")
        return vocab_scores(lm_head, hidden)



def _draft_layer(config: ModelConfig, index: int, qk_norm: bool) -> DecoderLayer:
    """A draft layer of the target's kind, with Qwen3's per-head q/k norms when qk_norm."""
    return DecoderLayer(replace(config, qk_norm="head" if qk_norm else None), index)


class PrefixKeys:
    """Keys and values held ahead of a forward's own (training: every position's context,
    computed with gradients): speaks the write/advance protocol of
    `selfspec.model.kv_cache.KVCache`, returning per layer its prefix then the new keys."""

    def __init__(self, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.prefix = prefix
        self.length = prefix[0][0].shape[2]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        before_k, before_v = self.prefix[layer]
        return torch.cat([before_k, k], dim=2), torch.cat([before_v, v], dim=2)

    def advance(self, t: int) -> None:
        pass


# ---- loss -------------------------------------------------------------------------------------


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
