"""EAGLE draft heads (Li et al. 2024, 2025): one decoder layer over the target's features.

A head position t reads a pair (token t+1, feature f_t) and outputs the predicted next feature
f_{t+1}, whose logits give the law of token t+2. Drafting deeper, the head's own output stands
in for the target's feature (`selfspec.drafters.eagle`).

- EAGLE-1 (`version=1`): the feature is the target's last hidden state after its final norm
  (what its LM head reads). `fc` (2h -> h, with a bias unless fc_bias=False) reads
  concat(embedding, feature), then one Llama decoder layer without its input RMSNorm; the
  target's frozen LM head gives the logits.
- EAGLE-3 (`version=3`): the feature fuses three of the target's residual streams (the inputs
  of layers 2, L//2 and L-3 by default) through `fc` (3h -> h, no bias). The layer's attention
  reads concat(input_layernorm(embedding), hidden_norm(feature)) (2h wide); a final norm and
  the head's own LM head score a reduced draft vocabulary: draft id i is target id i + d2t[i],
  and t2d [V] marks the target ids the draft vocabulary holds.
- P-EAGLE (`parallel=K`, EAGLE-3 heads): besides the pair of the root, K - 1 mask pairs (the
  target's embedding of `mask_token_id`, and a learned feature `mask_hidden` in place of the
  head's own output) ride in the same forward at the next K - 1 positions, causally: one
  forward gives the laws of K tokens (`selfspec.drafters.eagle_parallel`), none of which
  depends on a drafted token.

The target's embedding (and EAGLE-1's LM head) are used, never owned: parameter names are the
published checkpoints' (EAGLE-1: fc, layers.0.* without layers.0.input_layernorm; EAGLE-3: fc,
midlayer.*, norm, lm_head, d2t, t2d). Trainable modules only: no decoding logic here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from selfspec.checks import is_count, is_int_in
from selfspec.heads.base import AttentionShape, FeatureHead, FeatureHeadConfig, vocab_scores
from selfspec.model import (
    MLP,
    Attention,
    DecoderLayer,
    Linear,
    ModelConfig,
    RMSNorm,
    Rope,
)

VERSIONS = (1, 3)


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's fused layers for a target of num_layers layers: the inputs of layers 2, L//2
    and L-3 (hidden l = the residual stream after l layers)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 fuses the inputs of layers 2, L//2 and L-3, which a target of "
                         f"{num_layers} layers lacks; pass target_layers explicitly")
    return layers


@dataclass(frozen=True, kw_only=True)
class EagleConfig(FeatureHeadConfig):
    """version: 1 (EAGLE-1 features) or 3 (fused features, own LM head, draft vocabulary).
    hidden_size, vocab_size: the target's. The layer's sizes (intermediate_size, num_heads,
    num_kv_heads, head_dim, RoPE, biases) default to the target's (`for_target`).
    draft_vocab_size: EAGLE-3's reduced vocabulary (None: EAGLE-1, the full vocabulary).
    target_hidden_size: the width of each fused target state (None: hidden_size).
    target_layers: EAGLE-3's fused residual streams of the target (empty for EAGLE-1).
    fc_bias: whether `fc` has a bias; None = the published default (EAGLE-1 yes, EAGLE-3 no).
    vLLM builds EAGLE-1's fc without one: its export carries the bias in the attention biases.
    parallel: P-EAGLE's K (EAGLE-3 only): one forward drafts K tokens, the last K - 1 from
    mask pairs of token mask_token_id and the learned `mask_hidden`; 1: one token a forward.
    confidence_head (P-EAGLE only): a per-position confidence (`FeatureHead.acceptance_logits`)
    that sizes the block the drafter proposes."""

    version: int
    fc_bias: bool | None = None
    parallel: int = 1
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"EagleConfig: version must be 1 or 3, got {self.version!r}")
        self._check_counts("hidden_size", "vocab_size", "intermediate_size", "num_heads",
                           "num_kv_heads", "head_dim")
        if self.version == 1 and (self.draft_vocab_size not in (None, self.vocab_size)
                                  or self.target_layers):
            raise ValueError("EagleConfig: EAGLE-1 drafts over the full vocabulary from the last "
                             "hidden state: leave draft_vocab_size and target_layers unset")
        if self.version == 3:
            self._check_version_3()
        self._check_parallel()

    def _check_parallel(self) -> None:
        self._check_counts("parallel")
        if self.confidence_head and self.parallel == 1:
            raise ValueError("EagleConfig: confidence_head sizes a P-EAGLE block (parallel > 1); "
                             "leave it false for a head that drafts one token a forward")
        if self.parallel == 1:
            if self.mask_token_id is not None:
                raise ValueError("EagleConfig: mask_token_id is P-EAGLE's (parallel > 1): leave "
                                 "it unset for a head that drafts one token a forward")
            return
        if self.version != 3:
            raise ValueError(f"EagleConfig: P-EAGLE (parallel={self.parallel}) drafts with "
                             f"EAGLE-3 heads: use version 3 or parallel 1")
        mask = self.mask_token_id
        if not is_int_in(mask, range(self.vocab_size)):
            raise ValueError(f"EagleConfig: P-EAGLE's mask_token_id must be a token id in "
                             f"0..{self.vocab_size - 1}, got {mask!r}")

    def _check_version_3(self) -> None:
        self._check_draft_vocab_size()
        if len(self.target_layers) != 3 or not all(is_count(i, 0) for i in self.target_layers):
            raise ValueError(f"EagleConfig: EAGLE-3 fuses three target layers (ids >= 0), got "
                             f"target_layers={self.target_layers!r}")
        if self.target_hidden_size is not None:
            self._check_counts("target_hidden_size")

    @classmethod
    def for_target(
        cls, target: ModelConfig, version: int = 1, *, draft_vocab_size: int | None = None,
        target_layers: tuple[int, ...] | None = None, fc_bias: bool | None = None,
        parallel: int = 1, mask_token_id: int | None = None, confidence_head: bool = False,
    ) -> EagleConfig:
        """A head sized like one decoder layer of `target`; EAGLE-3 fuses target_layers
        (default: the inputs of layers 2, L//2 and L-3) over draft_vocab_size tokens, and with
        parallel=K drafts K tokens a forward (P-EAGLE)."""
        if version == 3 and target_layers is None:
            target_layers = default_target_layers(target.num_layers)
        shared = {f.name: getattr(target, f.name) for f in fields(cls) if hasattr(target, f.name)
                  and f.name not in ("version", "draft_vocab_size", "target_layers")}
        shared |= AttentionShape.of_target(target)
        return cls(version=version, **shared,
                   draft_vocab_size=draft_vocab_size if version == 3 else None,
                   target_hidden_size=target.hidden_size if version == 3 else None,
                   target_layers=tuple(target_layers or ()), fc_bias=fc_bias,
                   parallel=parallel, mask_token_id=mask_token_id,
                   confidence_head=bool(confidence_head))

    @property
    def has_fc_bias(self) -> bool:
        return self.version == 1 if self.fc_bias is None else bool(self.fc_bias)

    @property
    def owns_lm_head(self) -> bool:
        """EAGLE-3 scores its draft vocabulary through its own LM head; EAGLE-1 (whose
        draft_vocab_size may name the full vocabulary) the target's."""
        return self.version == 3

    @property
    def feature_size(self) -> int:
        """The width of the target's feature the head reads: h, or 3 fused states (EAGLE-3)."""
        return super().feature_size if self.version == 3 else self.hidden_size


class EagleMidLayer(nn.Module):
    """EAGLE-3's decoder layer: attention reads concat(input_layernorm(embedding),
    hidden_norm(feature)) (2h); the residual stream is the feature."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, 0, input_size=2 * h)
        self.mlp = MLP(config)
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn_mask: torch.Tensor | None, cache) -> torch.Tensor:
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(both, cos, sin, attn_mask, cache)  # [B, T, h]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(FeatureHead):
    """An EAGLE-1 or EAGLE-3 head: `forward(embeds, feature, positions, cache, mask)` -> the
    predicted next features [B, T, h]; `logits` turns them into token scores."""

    config_class = EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        layer, h = config.layer_config(), config.hidden_size
        if config.version == 1:
            self.fc = Linear(2 * h, h, bias=config.has_fc_bias)
            self.layers = nn.ModuleList([DecoderLayer(layer, 0, input_norm=False)])
        else:
            self.fc = Linear(config.feature_size, h, bias=config.has_fc_bias)
            self.midlayer = EagleMidLayer(layer)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self._add_lm_head()
        if config.parallel > 1:  # P-EAGLE: what a mask pair reads in place of a feature
            self.mask_hidden = nn.Parameter(torch.randn(h) * 0.02)
        self._add_confidence()
        # Plain fp32 frequencies, as in Transformer: head.to(bf16) keeps them.
        self.rope = Rope.of(layer)

    # ---- features in, features out ---------------------------------------------------------

    def target_feature(self, last_hidden: torch.Tensor, hidden: tuple[torch.Tensor, ...] = ()
                       ) -> torch.Tensor:
        """[..., h] what the head reads for the target's states: EAGLE-1 the normed last hidden
        state [..., h]; EAGLE-3 fc over the fused streams (`target_layers` order, each [..., h])."""
        if self.config.version == 1:
            return last_hidden
        if len(hidden) != len(self.config.target_layers):
            raise ValueError(f"EagleHead: EAGLE-3 fuses {len(self.config.target_layers)} target "
                             f"states (layers {self.config.target_layers}), got {len(hidden)}")
        # the target's dtype may differ from the head's (a bf16 target, a head kept in fp32)
        return self.fc(torch.cat(hidden, dim=-1).to(self.fc.weight))

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, h] the embeddings of tokens t+1
        feature: torch.Tensor,  # [B, T, h] f_t: the target's (target_feature) or the head's own
        positions: torch.Tensor,  # [T] or [B, T]
        cache=None,
        mask: torch.Tensor | None = None,  # [T, T] or [T, past + T] bool, default causal
    ) -> torch.Tensor:
        """The predicted next features [B, T, h]; with a cache (KVCache-like, one layer) the
        new pairs attend to its slots and it advances by T, as `Transformer.forward` does."""
        cos, sin, attn_mask = self.rope_and_mask(embeds, positions, cache, mask)
        if self.config.version == 1:
            x = self.fc(torch.cat([embeds, feature], dim=-1))  # [B, T, h]
            out = self.layers[0](x, cos, sin, attn_mask, cache)
        else:
            out = self.midlayer(embeds, feature, cos, sin, attn_mask, cache)
        if cache is not None:
            cache.advance(embeds.shape[1])
        return out

    def mask_pairs(self, mask_embed: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE: `count` mask pairs, embeddings and features [count, h] each, from the
        target's embedding of mask_token_id [h]."""
        return mask_embed.expand(count, -1), self.mask_hidden.expand(count, -1)

    # ---- token scores -----------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """[..., output_vocab_size] fp32: EAGLE-1 through the target's LM head (pass it),
        EAGLE-3 through its own norm and LM head over the draft vocabulary."""
        if self.config.version == 1:
            if lm_head is None:
                raise ValueError("EagleHead.logits: EAGLE-1 scores through the target's LM head: "
                                 "pass lm_head=target.lm_head")
            return vocab_scores(lm_head, hidden)
        return vocab_scores(self.lm_head, self.norm(hidden))

    def _scored_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's LM head reads its outputs through the final norm."""
        return self.norm(hidden) if self.config.version == 3 else hidden

    # ---- EAGLE-3 training-time test ---------------------------------------------------------

    def unroll(self, embeds: torch.Tensor, feature: torch.Tensor, steps: int
               ) -> list[torch.Tensor]:
        """EAGLE-3's training-time test: `steps` passes over a row, step j reading its own step
        j-1 outputs as features, as drafting j tokens deep does.

        embeds [B, T, h]: the embeddings of tokens 0..T-1; feature [B, T-1, h]: f_t for rows
        t = 0..T-2. Step j, row t reads token t+1+j (zeros past the end) at position t+j and
        attends to step 0's rows <= t and to row t of steps 1..j (`ttt_mask`). Returns each
        step's predicted features [B, T-1, h]; step j row t scores token t+2+j.
        """
        rows = feature.shape[1]
        keys, outputs = _StepKeys(), []
        for j in range(steps):
            shifted = embeds[:, 1 + j: 1 + j + rows]  # [B, <= T-1, h]
            pad = shifted.new_zeros(shifted.shape[0], rows - shifted.shape[1], shifted.shape[2])
            positions = torch.arange(rows, device=embeds.device) + j
            feature = self(torch.cat([shifted, pad], dim=1), feature, positions, keys,
                           mask=ttt_mask(rows, j, embeds.device))
            outputs.append(feature)
        return outputs


def ttt_mask(rows: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, (step + 1) * rows] bool: step `step`'s rows attend causally to step 0's rows and
    to their own row of every later step (themselves included)."""
    blocks = [torch.ones(rows, rows, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(rows, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)


class _StepKeys:
    """The training-time test's keys and values, one block of rows per step, grown by
    concatenation (no in-place writes, so gradients flow through every step). Speaks the
    write/advance protocol of `selfspec.model.kv_cache.KVCache` for one layer."""

    def __init__(self) -> None:
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H_kv, T, D] appended; returns all keys and values so far [B, H_kv, S, D]."""
        self._k = k if self._k is None else torch.cat([self._k, k], dim=2)
        self._v = v if self._v is None else torch.cat([self._v, v], dim=2)
        return self._k, self._v

    def advance(self, t: int) -> None:
        self.length += t
