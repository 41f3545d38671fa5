"""Drafting with the target's own multi-token-prediction (MTP) modules (DeepSeek-V3's NextN,
Qwen3-Next's and Qwen3.5's `mtp`, GLM-4.5, MiMo): no training, no second model.

An MTP module at position t reads the embedding of token t+1 and the target's normed last
hidden state h_t and predicts token t+2, as an EAGLE-1 head reads the pair (token t+1,
feature f_t): so the module drafts through the EAGLE drafter's machinery (`EagleDrafter`:
its own KV cache over the committed pairs, chains, static trees and EAGLE-2 dynamic trees,
chosen or sampled children, static drafting), `MtpHead` presenting the module as a head.
Step j reads step j - 1's output and its token, as EAGLE does: deeper than the target has
modules, the module is applied again to its own output. A target with several modules drafts
with its first at every depth (module i > 0 reads module i - 1's states over the committed
context, which this drafter does not keep).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.drafters.base import DecodeSetup
from selfspec.drafters.eagle import EagleDrafter
from selfspec.model import Transformer
from selfspec.tree import Tree


@dataclass(frozen=True)
class MtpHeadConfig:
    """What `EagleDrafter` reads of a head's config, for a target's MTP module: an EAGLE-1-like
    head (the target's last hidden state, the whole vocabulary) of the target's sizes, its
    cache's entries as the target's (`ModelConfig.cache_dims`: MLA's roped key and latent)."""

    hidden_size: int
    vocab_size: int
    num_kv_heads: int
    head_dim: int
    value_dim: int | None = None
    version: int = 1
    target_layers: tuple[int, ...] = ()
    target_hidden_size: int | None = None

    @property
    def output_vocab_size(self) -> int:
        return self.vocab_size


class MtpHead(nn.Module):
    """A target's MTP module `index` as a draft head: `forward(embeds, feature, positions,
    cache, mask)` -> the states handed to the next step [B, T, h]; `target_logits` scores
    them. The module stays the target's (its weights are not copied)."""

    def __init__(self, target: Transformer, index: int = 0) -> None:
        super().__init__()
        config = target.config
        if not config.mtp_modules:
            raise ValueError("MtpDrafter: the target has no MTP modules; load a checkpoint that "
                             "ships them (DeepSeek-V3 NextN layers or Qwen3-Next mtp.* weights) "
                             "or give the model config arch.mtp_modules and arch.mtp_layout")
        self.config = MtpHeadConfig(config.hidden_size, config.vocab_size, *config.cache_dims)
        self.index = index
        self.module = target.mtp[index]
        self._target = (target,)  # not a submodule: the head never owns the target

    @property
    def target(self) -> Transformer:
        return self._target[0]

    @property
    def fc(self) -> nn.Module:
        """The module's input projection (its weight's device and dtype are the head's)."""
        return self.module.proj

    def target_feature(self, last_hidden: torch.Tensor, hidden: tuple[torch.Tensor, ...] = ()
                       ) -> torch.Tensor:
        """[..., h] what the module reads of the target: its normed last hidden state."""
        return last_hidden

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                cache=None, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.target.mtp_forward(self.index, embeds, feature, positions, cache, mask)

    def target_logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None
                      ) -> torch.Tensor:
        """[..., V] fp32 scores of the module's outputs (its own head or the target's: the
        lm_head passed is not needed)."""
        return self.target.mtp_logits(self.index, hidden)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """`target_logits`, under the name the EAGLE-1 objective scores a head's outputs by
        (`from_config.methods.mtp.MtpObjective` fine-tunes the module as it trains a head)."""
        return self.target_logits(hidden, lm_head)


class MtpDrafter(EagleDrafter):
    """Drafts with `target`'s first MTP module: a static tree (`tree`; `Tree.chain(k)` for a
    chain of k) or an EAGLE-2 dynamic tree (`total_tokens`, `depth`, `top_k`) from its top
    tokens, children chosen at greedy and drawn from its law when sampling (as `EagleDrafter`
    does). It drafts for the target it was built from (its modules are that target's)."""

    def __init__(
        self,
        target: Transformer,
        tree: Tree | Sequence[Sequence[int]] | None = None,
        *,
        total_tokens: int | None = None,
        depth: int | None = None,
        top_k: int | None = None,
        sampled_children: bool = True,
    ) -> None:
        super().__init__(MtpHead(target), tree, total_tokens=total_tokens, depth=depth,
                         top_k=top_k, sampled_children=sampled_children)

    def begin(self, setup: DecodeSetup) -> None:
        if setup.target is not self.head.target:
            raise ValueError("MtpDrafter: it drafts with the MTP modules of the target it was "
                             "built from; build it from the target that verifies "
                             "(MtpDrafter(target, ...))")
        super().begin(setup)
