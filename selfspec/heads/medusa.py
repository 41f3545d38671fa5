"""Medusa heads (Cai et al. 2024): K extra LM heads on the target's last hidden state.

Head k reads the target's normed final hidden state at position t and predicts the token at
t + k + 2 (the target's own LM head predicts t + 1). Each head is `num_layers` residual blocks
followed by a vocabulary projection: its own (Medusa-1's released heads), or the target's frozen
LM head shared by all heads (`shared_lm_head`, as the later Medusa releases do), computed for
every head in one matmul. Trainable modules only: decoding lives in
`selfspec.drafters.medusa`; the loss is `medusa_loss` below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from selfspec.checks import check_count, is_int_in
from selfspec.divergences import Divergence, forward_kl, target_log_probs
from selfspec.heads.base import Head, LossOutput, agreement, masked_cross_entropy, masked_mean
from selfspec.heads.draft_vocab import (
    DraftVocab,
    default_vocab,
    narrowed,
    set_head_vocab,
)
from selfspec.model import Linear  # nn.Linear with the CPU's faster few-row products


@dataclass(frozen=True)
class MedusaConfig:
    """hidden_size, vocab_size: the target's; num_heads: K (head k predicts t + k + 2);
    num_layers: residual blocks per head; draft_vocab_size: the heads score only that many
    target tokens (`selfspec.heads.draft_vocab`), None = the whole vocabulary; shared_lm_head: the
    heads end in the target's LM head (pass it to `forward`) instead of their own."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int | None = None
    shared_lm_head: bool = False

    def __post_init__(self) -> None:
        minimum = {"hidden_size": 1, "vocab_size": 1, "num_heads": 1, "num_layers": 0}
        for name, least in minimum.items():
            check_count(name, getattr(self, name), least, owner="MedusaConfig")
        size = self.draft_vocab_size
        if size is not None and not is_int_in(size, range(1, self.vocab_size + 1)):
            raise ValueError(f"MedusaConfig: draft_vocab_size must be null or an integer in "
                             f"[1, {self.vocab_size}] (the target's vocab_size), got {size!r}")
        if not isinstance(self.shared_lm_head, bool):
            raise ValueError(f"MedusaConfig: shared_lm_head must be true or false, got "
                             f"{self.shared_lm_head!r}")
        if self.shared_lm_head and size is not None:
            raise ValueError("MedusaConfig: a shared LM head is the target's, which scores the "
                             "whole vocabulary: set draft_vocab_size to null or give the heads "
                             "their own LM heads (shared_lm_head=false)")

    @property
    def output_size(self) -> int:
        """How many tokens each head scores."""
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); the linear starts at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # SiLU(bias) would shift a fresh head otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: its own residual blocks, then its own [V, H] projection (none when the heads
    share the target's LM head)."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        # A fresh block per layer: `[ResBlock(h)] * n` would share one block's weights.
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_layers))
        self.lm_head = (None if config.shared_lm_head else
                        Linear(config.hidden_size, config.output_size, bias=False))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] the state this head's projection reads."""
        for block in self.blocks:
            hidden = block(hidden)
        return hidden

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.features(hidden))  # [..., V]


class MedusaHeads(Head):
    """K Medusa heads: `forward(hidden [..., H]) -> logits [..., K, V']`, V' = the draft
    vocabulary's size when the config has one (then `draft_vocab` maps ids), else V."""

    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(MedusaHead(config) for _ in range(config.num_heads))
        if config.draft_vocab_size is not None:
            vocab = default_vocab(config.draft_vocab_size, config.vocab_size)
            self.register_buffer("d2t", vocab.d2t)
            self.register_buffer("t2d", vocab.t2d)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        return None if self.config.draft_vocab_size is None else DraftVocab(self.d2t, self.t2d)

    def set_draft_vocab(self, vocab: DraftVocab) -> MedusaHeads:
        """Score these target tokens (before `init_from_lm_head`, which copies their rows)."""
        set_head_vocab("MedusaHeads", self, vocab, self.config.draft_vocab_size,
                       self.config.vocab_size)
        return self

    @torch.no_grad()
    def narrowed(self, counts: torch.Tensor, size: int) -> MedusaHeads:
        """A copy that scores only the `size` tokens of this vocabulary most frequent in
        `counts` [V] (each projection keeps their rows): smaller heads to ship, whose logits
        on the tokens kept are these heads' own."""
        if self.config.shared_lm_head:
            raise ValueError("MedusaHeads.narrowed: these heads share the target's LM head; "
                             "they have no projection of their own to narrow")
        whole = self.config.vocab_size  # the first V of V ids: every id
        vocab, rows = narrowed(self.draft_vocab or default_vocab(whole, whole), counts, size)
        weight = next(self.parameters())
        smaller = MedusaHeads(replace(self.config, draft_vocab_size=size))
        smaller.to(device=weight.device, dtype=weight.dtype).set_draft_vocab(vocab)
        for new, old in zip(smaller.heads, self.heads, strict=True):
            new.blocks.load_state_dict(old.blocks.state_dict())
            new.lm_head.weight.copy_(old.lm_head.weight[rows.to(weight.device)])
        return smaller

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of the heads' output indices (the same ids without a draft vocab)."""
        vocab = self.draft_vocab
        return ids if vocab is None else vocab.target_ids[ids]

    def labels(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """(labels, mask) for the loss: target ids as output indices, and tokens outside the
        draft vocabulary masked out (the heads cannot propose them)."""
        vocab = self.draft_vocab
        if vocab is None:
            return tokens, loss_mask
        ids, kept = vocab.draft_ids(tokens)
        return ids, loss_mask.bool() & kept

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None,
                count: int | None = None) -> torch.Tensor:
        """[..., K, V'] logits; lm_head: the target's, which shared-LM-head heads need; count:
        run only the first count heads (a draft k deep reads k), K = count."""
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"MedusaHeads: hidden states have size {hidden.shape[-1]}, the heads expect "
                f"{self.config.hidden_size}: pass the target's last_hidden [..., hidden]"
            )
        heads = self.heads[:count]
        if not self.config.shared_lm_head:
            return torch.stack([head(hidden) for head in heads], dim=-2)  # [..., K, V]
        if lm_head is None:
            raise ValueError("MedusaHeads: these heads share the target's LM head: pass "
                             "lm_head=target.lm_head")
        states = torch.stack([head.features(hidden) for head in heads], dim=-2)
        return lm_head(states)  # [..., K, V]: one matmul for all heads

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> MedusaHeads:
        """Copy the target's LM head weight [V, H] into every head's projection (Medusa-1);
        with a draft vocabulary, the rows of its tokens.

        Copies, never shares: each head keeps its own storage and trains apart. Heads that share
        the target's LM head have nothing to copy.
        """
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"MedusaHeads.init_from_lm_head: weight has shape {list(weight.shape)}, expected "
                f"[vocab_size, hidden_size] = {list(expected)}; pass target.lm_head.weight"
            )
        if self.config.shared_lm_head:
            return self
        rows = weight if self.draft_vocab is None else weight[self.draft_vocab.target_ids]
        for head in self.heads:
            head.lm_head.weight.copy_(rows)
        return self


# ---- loss -------------------------------------------------------------------------------------


def medusa_loss(
    head_logits: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    decay: float = 0.8,
    teacher_logits: torch.Tensor | None = None,
    divergence: Divergence = forward_kl,
) -> LossOutput:
    """Medusa-1 loss: sum over heads k of decay**k * cross-entropy of head k, or, given the
    target's logits, of `divergence` between head k's law and the target's.

    head_logits: [B, T, K, V] head k at position t predicts tokens[t + k + 2] (the target's own
        LM head predicts t + 1), so head k is scored on positions t < T - k - 2.
    tokens: [B, T] the sequence the hidden states were computed on.
    loss_mask: [B, T] bool/0-1, whether a token counts as a *prediction target* (e.g. only
        assistant replies); None = every token.
    teacher_logits: [B, T, V] the target's logits (position i: the law of token i + 1), or
    None: against the tokens. Head k at t then meets the target's law at t + k + 1, and its
    top-1 is agreement with that law's argmax.
    A head with no valid position contributes 0 to the loss and reports 0 for its metrics.
    """
    _check_medusa_inputs(head_logits, tokens, loss_mask, decay)
    if teacher_logits is not None and teacher_logits.shape != head_logits[:, :, 0].shape:
        raise ValueError(f"medusa_loss: teacher_logits must be [B, T, V] = "
                         f"{list(head_logits[:, :, 0].shape)}, got {list(teacher_logits.shape)}")
    batch, length, num_heads, _ = head_logits.shape
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    total = head_logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for k in range(num_heads):
        shift = k + 2
        logits = head_logits[:, : max(length - shift, 0), k]  # [B, T - k - 2, V]
        labels, valid = tokens[:, shift:], mask[:, shift:]  # [B, T - k - 2]
        if teacher_logits is None:
            head_loss, top1 = masked_cross_entropy(logits, labels, valid)
        else:
            teacher = teacher_logits[:, shift - 1: length - 1]  # the laws of tokens t + k + 2
            head_loss = masked_mean(divergence(logits, target_log_probs(teacher)), valid)
            top1 = agreement(logits, teacher, valid)
        total = total + decay**k * head_loss
        metrics[f"medusa/head{k}_loss"] = float(head_loss.detach())
        metrics[f"medusa/head{k}_top1"] = top1
    return LossOutput(total, metrics)


def _check_medusa_inputs(
    head_logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor | None, decay: float
) -> None:
    if head_logits.dim() != 4:
        raise ValueError(
            f"medusa_loss: head_logits must be [B, T, K, V], got shape {list(head_logits.shape)}; "
            f"pass MedusaHeads(hidden [B, T, H])"
        )
    if tokens.shape != head_logits.shape[:2] or tokens.is_floating_point():
        raise ValueError(
            f"medusa_loss: tokens must be integer ids of shape [B, T] = "
            f"{list(head_logits.shape[:2])} (head_logits' first two dims), got "
            f"{tokens.dtype} {list(tokens.shape)}"
        )
    if loss_mask is not None and loss_mask.shape != tokens.shape:
        raise ValueError(
            f"medusa_loss: loss_mask must have the tokens' shape {list(tokens.shape)}, got "
            f"{list(loss_mask.shape)}"
        )
    if not decay > 0:
        raise ValueError(f"medusa_loss: decay must be > 0 (head k weighs decay**k), got {decay}")
