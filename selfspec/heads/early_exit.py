"""Early exits from a frozen target's layer E (LayerSkip-style drafting; Kangaroo's adapter).

An exit turns the residual stream after the target's first E layers into next-token logits
through the target's own LM head (used, never owned):

- `norm`: the target's final RMSNorm and LM head on layer E as they are. Nothing to train:
  the honest baseline every trained exit must beat.
- `adapter` (Kangaroo): RMSNorm, one attention layer with its own K/V cache over the
  committed context, a residual, RMSNorm, then the target's LM head; no MLP. It starts as the
  `norm` exit (zero attention output, the target's final norm weights: `init_from_target`)
  and learns the target's final law (`exit_loss` below: forward KL, or another
  `selfspec.divergences` objective).

A head records its exit layer: a head for one E never drafts from another (the drafter and
`from_config.methods.early_exit.load_early_exit` refuse it). Trainable modules only: no
decoding logic here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from selfspec.checks import is_count
from selfspec.divergences import Divergence, forward_kl, target_log_probs
from selfspec.heads.base import (
    AttentionShape,
    Head,
    LossOutput,
    agreement,
    masked_cross_entropy,
    masked_mean,
)
from selfspec.heads.io import check_sizes
from selfspec.model import (
    Attention,
    ModelConfig,
    RMSNorm,
    Rope,
    Transformer,
)

EXIT_KINDS = ("norm", "adapter")


@dataclass(frozen=True, kw_only=True)
class ExitConfig(AttentionShape):
    """kind: `norm` or `adapter`; exit_layer: E, the number of target layers the exit reads
    after (1 <= E < the target's layer count, checked by `for_target` and the drafter);
    the rest are the target's sizes (the adapter's attention is shaped like the target's)."""

    kind: str
    exit_layer: int

    def __post_init__(self) -> None:
        if self.kind not in EXIT_KINDS:
            raise ValueError(f"ExitConfig: kind must be one of {', '.join(EXIT_KINDS)} "
                             f"(norm: the target's final norm on layer E; adapter: Kangaroo's "
                             f"trained adapter), got {self.kind!r}")
        check_exit_layer(self.exit_layer, None)

    @classmethod
    def for_target(cls, target: ModelConfig, exit_layer: int, kind: str = "adapter"
                   ) -> ExitConfig:
        """An exit after `exit_layer` layers of `target`, sized like it."""
        check_exit_layer(exit_layer, target.num_layers)
        return cls(kind=kind, exit_layer=exit_layer, **AttentionShape.of_target(target))

    def layer_config(self) -> ModelConfig:
        """The adapter attention's shape as a ModelConfig (one layer, no MLP used)."""
        return self.one_layer()


def check_exit_layer(exit_layer, num_layers: int | None) -> None:
    """E must be an integer in [1, num_layers): at least one layer drafts, at least one is
    left for verification to start at."""
    upper = "num_layers" if num_layers is None else str(num_layers)
    if not is_count(exit_layer) or (num_layers is not None and exit_layer >= num_layers):
        raise ValueError(f"exit layer E must be an integer in [1, {upper}) (E=0 drafts with no "
                         f"layer, E={upper} leaves none to verify with), got {exit_layer!r}")


class ExitHead(Head):
    """`forward(hidden, positions, cache)`: the normed state the target's LM head reads, from
    the residual stream after layer E; `logits(...)` adds the LM head. The adapter's K/V
    cache (KVCache-like, one layer) holds the committed context's entries."""

    config_class = ExitConfig

    def __init__(self, config: ExitConfig) -> None:
        super().__init__()
        self.config = config
        if config.kind == "adapter":
            layer = config.layer_config()
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.self_attn = Attention(layer, layer_idx=0)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.rope = Rope.of(layer)

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] the residual stream after layer E
        positions: torch.Tensor,  # [T]
        cache=None,
        *,
        target_norm: nn.Module,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, H] what the LM head reads. The norm exit applies target_norm; the adapter
        its own layers (writing and advancing `cache` when given; `mask` [T, T] or
        [T, past + T] among them, default causal)."""
        if self.config.kind == "norm":
            return target_norm(hidden)
        cos, sin, attn_mask = self.rope_and_mask(hidden, positions, cache, mask)
        out = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn_mask, cache)
        if cache is not None:
            cache.advance(hidden.shape[1])
        return self.norm(out)

    def logits(self, hidden: torch.Tensor, positions: torch.Tensor, target: Transformer,
               cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, V] fp32 exit logits through the target's LM head."""
        normed = self(hidden, positions, cache, target_norm=target.norm, mask=mask)
        return target.logits_of(normed.to(target.lm_head.weight.dtype))

    def init_from_target(self, target: Transformer) -> ExitHead:
        """Start the adapter as the norm exit: zero attention output, the target's final norm
        weights (so training can only improve on the baseline's starting point)."""
        if self.config.kind == "adapter":
            with torch.no_grad():
                self.self_attn.o_proj.weight.zero_()
                self.norm.weight.copy_(target.norm.gain())  # Gemma's scale by 1 + w
        return self


def check_exit_target(who: str, head: ExitHead, target: Transformer) -> None:
    """Refuse an exit for another target (sizes) or an E the target cannot exit at."""
    ours, theirs = head.config, target.config
    check_sizes(who, "the exit head has", ours, target,
                "load an exit head trained for this target")
    try:
        check_exit_layer(ours.exit_layer, theirs.num_layers)
    except ValueError as error:
        raise ValueError(f"{who}: {error} for this {theirs.num_layers}-layer target") from None


# ---- loss -------------------------------------------------------------------------------------


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
    soft_loss = masked_mean(divergence(exit_rows, law), rows)
    kl = soft_loss if divergence is forward_kl else masked_mean(forward_kl(exit_rows, law), rows)
    metrics = {"soft_loss": float(soft_loss.detach()), "kl": float(kl.detach()),
               "top1": agreement(exit_rows, teacher, rows)}
    if hard_weight == 0:
        return LossOutput(soft_loss, metrics)
    hard, _ = masked_cross_entropy(exit_rows, tokens[:, 1:], rows)
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
