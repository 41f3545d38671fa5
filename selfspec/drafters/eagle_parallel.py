"""P-EAGLE drafting: an EAGLE-3 head trained with `parallel=K` drafts up to K tokens in one
forward (`selfspec.heads.eagle`).

Each step the head's cache takes the pairs the target just committed (as `EagleDrafter`'s
does), and in the same forward k - 1 mask pairs (the target's embedding of the mask token,
the learned `mask_hidden`) ride at the next k - 1 positions, causally: the last committed
pair's output scores the first drafted token and mask pair j the (j + 1)-th, laws q_1..q_k
none of which depends on a drafted token. The mask pairs' keys are cut off again, so the
cache holds the committed context alone.

From those laws the draft is a chain or DDTree's best-first tree, made as DFlash makes its
own (`selfspec.drafters.dflash.BlockShape`: chosen tokens at greedy, draws without replacement
from each position's law when sampling), which keeps the verifier exact for the same reason:
a position's law does not depend on the tokens above it. It drafts eagerly, also where the
target runs static steps (a static, captured form is not built); there a tree stays a
`DeviceTree`, read with the target's argmax in the step's one host read.
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.dflash import BlockShape, block_draft
from selfspec.drafters.eagle import committed_pairs
from selfspec.heads.eagle import EagleHead
from selfspec.heads.io import check_fused_target
from selfspec.model.kv_cache import KVCache
from selfspec.sampling import SamplingParams


class ParallelEagleDrafter:
    """Drafts k = num_draft_tokens tokens (default: the head's K) from one forward of a
    P-EAGLE head, as a chain, or as the best-first tree of `tree_nodes` nodes at most k
    deep."""

    def __init__(self, head: EagleHead, num_draft_tokens: int | None = None, *,
                 tree_nodes: int | None = None, sampled_children: bool = True) -> None:
        most = head.config.parallel
        if most < 2:
            raise ValueError("ParallelEagleDrafter: the head drafts one token a forward "
                             "(parallel=1); draft it with EagleDrafter, or train one with "
                             "eagle.parallel=K")
        k = most if num_draft_tokens is None else num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            raise ValueError(f"ParallelEagleDrafter: num_draft_tokens must be in 1..{most} (the "
                             f"head drafts up to {most} tokens a forward), got {k!r}")
        self.head, self.k, self.sampled_children = head, k, bool(sampled_children)
        self.shape = BlockShape.checked("ParallelEagleDrafter", k, tree_nodes,
                                        head.config.output_vocab_size)
        self.max_nodes = self.shape.max_nodes
        self.target_layers: tuple[int, ...] = tuple(head.config.target_layers)
        self._cache: KVCache | None = None
        self._committed = 0  # head cache slots holding committed pairs

    def begin(self, setup: DecodeSetup) -> None:
        check_fused_target("ParallelEagleDrafter", self.head.config, setup.target)
        self._target, self._generator = setup.target, setup.generator
        self._sampling = setup.sampling
        self._committed = 0
        self._on_device = setup.static_steps  # trees left for the step's one host read
        config = self.head.config
        self._cache = KVCache.reused(self._cache, 1, config.num_kv_heads,
                                     setup.max_length + self.k, config.head_dim,
                                     self.head.fc.weight)

    @property
    def law(self) -> SamplingParams | None:
        """The warping tokens are drawn under (None: chosen, the top tokens)."""
        sampling = self._sampling
        return None if sampling.greedy or not self.sampled_children else sampling

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None:
            return Draft.empty()  # no target features yet (one-token prompt, first step)
        start, tokens, feature = committed_pairs(self.head, context, self._committed,
                                                 "ParallelEagleDrafter")
        weight, count = self.head.fc.weight, len(tokens)
        mask_embed = self._target.embed_tokens(
            torch.tensor(self.head.config.mask_token_id, device=weight.device))
        masks, mask_feature = self.head.mask_pairs(mask_embed, self.k - 1)
        embeds = torch.cat([self._target.embed_tokens(tokens), masks]).to(weight)  # [A + k-1, h]
        features = torch.cat([feature, mask_feature.to(weight)])
        positions = torch.arange(start, start + count + self.k - 1, device=weight.device)
        out = self.head(embeds[None], features[None], positions, self._cache)[0]
        self._committed = start + count
        self._cache.truncate(self._committed)  # the mask pairs' keys: dropped again
        logits = self.head.target_logits(out[count - 1:], self._target.lm_head)  # [k, V]
        return block_draft(self.shape.draft(logits, self.law, self._generator), self.shape,
                           on_device=self._on_device)
