"""What every trainable draft head is: a module built from its config dataclass, `cls(config)`.

`selfspec.heads.io` saves a head under its class name and finds the class again among the
subclasses of `Head`, so a new head needs no entry in any table: defining it is enough.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checks import check_count
from selfspec.heads.draft_vocab import DraftVocab, default_vocab, set_head_vocab
from selfspec.model import Linear, ModelConfig, Transformer, attention_mask, dense_weight


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """The shape of a head's own attention layer: the target's sizes, RoPE and biases
    (hidden_size, vocab_size: the target's), which head configs extend."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    attention_out_bias: bool = False

    @classmethod
    def of_target(cls, target: ModelConfig) -> dict:
        """The target's values of this shape's fields (the attention layer's shape: its own).
        A head's layer rotates all its dimensions: LongRoPE's factors, sized for a target that
        rotates only part of each head (Phi-4-mini), are left out (RoPE at its theta)."""
        shape = {f.name: getattr(target, f.name) for f in fields(AttentionShape)}
        if target.rotary_dim != target.head_dim:
            shape["rope_scaling"] = None
        return shape

    def one_layer(self, intermediate_size: int = 1, mlp_bias: bool = False) -> ModelConfig:
        """A one-layer Llama config of this shape (intermediate_size 1: no MLP is used)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=intermediate_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias, attention_out_bias=self.attention_out_bias,
            mlp_bias=mlp_bias)


@dataclass(frozen=True, kw_only=True)
class FeatureHeadConfig(AttentionShape):
    """A head of decoder layers of its own over the target's states (EAGLE, DFlash): the
    layers' MLP width (intermediate_size, mlp_bias), the fused residual streams of the target
    (target_layers; hidden l = after l layers) and their width (target_hidden_size, None:
    hidden_size), and a reduced vocabulary scored by the head's own LM head (draft_vocab_size;
    None: the target's LM head scores the whole vocabulary), and a block drafter's confidence
    (confidence_head: `FeatureHead.acceptance_logits`)."""

    intermediate_size: int
    target_layers: tuple[int, ...] = ()
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    mlp_bias: bool = False
    confidence_head: bool = False

    @property
    def owns_lm_head(self) -> bool:
        """Whether the head scores a draft vocabulary through an LM head of its own."""
        return self.draft_vocab_size is not None

    @property
    def output_vocab_size(self) -> int:
        """How many tokens the head scores: the draft vocabulary or the full one."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """The width of the fused target states the head's `fc` reads."""
        return (self.target_hidden_size or self.hidden_size) * len(self.target_layers)

    def layer_config(self) -> ModelConfig:
        """The one-layer config each of the head's decoder layers is built from."""
        return self.one_layer(self.intermediate_size, self.mlp_bias)

    def _check_counts(self, *names: str) -> None:
        """Each named field an integer >= 1, the error naming the config's class."""
        for name in names:
            check_count(name, getattr(self, name), owner=type(self).__name__)

    def _check_draft_vocab_size(self) -> None:
        """draft_vocab_size an integer in [1, vocab_size]."""
        self._check_counts("draft_vocab_size")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"{type(self).__name__}: draft_vocab_size {self.draft_vocab_size} "
                             f"exceeds the target's vocab_size {self.vocab_size}")


class Head(nn.Module):
    """A trainable draft head. Subclasses name their config dataclass in `config_class` and
    take an instance of it as their only constructor argument."""

    config_class: ClassVar[type]

    def rope_and_mask(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RoPE's cos and sin at `positions` and the attention mask of x's T new rows [B, T, h]
        after the cache's slots (`mask` among them, default causal), for a head with an
        attention layer of its own: its `rope` (fp32) follows the positions' device."""
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        past = 0 if cache is None else cache.length
        return cos, sin, attention_mask(mask, x.shape[1], past, x.device)


class FeatureHead(Head):
    """A head built from a `FeatureHeadConfig`: with a draft vocabulary, its own `lm_head` and
    the `d2t`/`t2d` buffers that map it to the target's ids; its final `norm` (when it has
    one) and LM head start from the target's (`init_from_target`)."""

    config: FeatureHeadConfig

    def _add_lm_head(self) -> None:
        """The LM head over the draft vocabulary and its maps (the first ids until
        `set_draft_vocab`)."""
        config = self.config
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        vocab = default_vocab(config.draft_vocab_size, config.vocab_size)  # until set
        self.register_buffer("d2t", vocab.d2t)
        self.register_buffer("t2d", vocab.t2d)

    def _add_confidence(self) -> None:
        """With `confidence_head`, a block drafter's confidence (DSpark's): one logit per drafted
        position from the states its LM head scores (`acceptance_logits`)."""
        if self.config.confidence_head:
            self.confidence = Linear(self.config.hidden_size, 1, bias=True)
            nn.init.zeros_(self.confidence.weight)  # a chance of 1/2 everywhere to start
            nn.init.zeros_(self.confidence.bias)

    def acceptance_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[...] fp32 logits of hidden states [..., h] (what `logits` takes): the sigmoid of
        position k's is the predicted chance that its drafted token is accepted once every
        position before it was (the drafter multiplies them: `drafters.block`)."""
        if not self.config.confidence_head:
            raise ValueError(f"{type(self).__name__}: the head has no confidence head: train one "
                             f"with confidence_head=true")
        return self.confidence(self._scored_states(hidden)).squeeze(-1).float()

    def _scored_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The states the LM head reads of what the head's forward returns (here: the same)."""
        return hidden

    @property
    def draft_vocab(self) -> DraftVocab | None:
        """The draft vocabulary the head scores, None when it scores the target's whole one."""
        return DraftVocab(self.d2t, self.t2d) if self.config.owns_lm_head else None

    def target_logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None
                      ) -> torch.Tensor:
        """[..., vocab_size] fp32 scores over the target's vocabulary (-inf outside a draft
        vocabulary)."""
        logits = self.logits(hidden, lm_head)
        vocab = self.draft_vocab
        return logits if vocab is None else vocab.scatter(logits)

    def set_draft_vocab(self, vocab: DraftVocab) -> FeatureHead:
        config = self.config
        set_head_vocab(type(self).__name__, self, vocab,
                       config.draft_vocab_size if config.owns_lm_head else None, config.vocab_size)
        return self

    @torch.no_grad()
    def init_from_target(self, target: Transformer) -> FeatureHead:
        """Start the final norm from the target's and, with a draft vocabulary, the LM head
        from the target's rows of it (a head without a norm of its own, EAGLE-1, reads the
        target's LM head: nothing to do)."""
        norm = getattr(self, "norm", None)
        if norm is not None:
            start_from_target(norm, getattr(self, "lm_head", None), target, self.draft_vocab)
        return self


def head_types() -> dict[str, type[Head]]:
    """Every head class defined so far, by class name (subclasses of subclasses too)."""
    found, todo = {}, list(Head.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def vocab_scores(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[..., V] fp32: lm_head over hidden [..., h] as one 2-D product. A strided input that
    needs grad (a block's slots cut from its root) would otherwise be multiplied batch by
    batch against the weight broadcast to each: five times slower on a CPU, backward too."""
    scores = lm_head(hidden.reshape(-1, hidden.shape[-1]))  # [n, V]: n may be 0
    return scores.view(*hidden.shape[:-1], scores.shape[-1]).float()


@torch.no_grad()
def start_from_target(norm: nn.Module, lm_head: nn.Module | None, target: Transformer,
                      vocab: DraftVocab | None) -> None:
    """A head's final norm from what the target's multiplies by (w, or Gemma's 1 + w) and,
    with a draft vocabulary, its LM head from the target's rows of it."""
    norm.weight.copy_(target.norm.gain())
    if vocab is not None:
        weight = dense_weight(target.lm_head)  # [V, h] (a quantized head's dequantized)
        lm_head.weight.copy_(weight[vocab.target_ids.to(weight.device)])


# ---- what the heads' losses share -------------------------------------------------------------


@dataclass
class LossOutput:
    """loss: the scalar to minimise; metrics: plain floats to log (same keys every call)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean of values [B, T] over rows [B, T] (0, graph kept, when no row counts)."""
    weights = rows.float()
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def agreement(logits: torch.Tensor, teacher_logits: torch.Tensor, rows: torch.Tensor) -> float:
    """Share of the counted rows where both argmaxes agree (0 when no row counts)."""
    return hits(logits, teacher_logits.argmax(-1), rows)


def hits(logits: torch.Tensor, wanted: torch.Tensor, rows: torch.Tensor | None = None
          ) -> float:
    """Share of the counted rows (None: all) where the argmax of logits is `wanted` (0 when
    none counts)."""
    same = logits.detach().argmax(-1) == wanted
    rows = torch.ones_like(same) if rows is None else rows
    return float((same & rows).sum()) / max(float(rows.sum()), 1.0)


def masked_cross_entropy(
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
    loss = masked_mean(bce, rows)
    error = masked_mean((torch.sigmoid(logits.detach().float()) - target).abs(), rows)
    return LossOutput(loss, {f"{prefix}confidence_loss": float(loss.detach()),
                             f"{prefix}confidence_error": float(error)})
