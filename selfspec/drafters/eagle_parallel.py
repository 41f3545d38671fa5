"""P-EAGLE drafting: an EAGLE-3 head trained with `parallel=K` drafts up to K tokens in one
forward (`selfspec.heads.eagle`).

Each step the head's cache takes the pairs the target just committed (as `EagleDrafter`'s
does), and in the same forward k - 1 mask pairs (the target's embedding of the mask token,
the learned `mask_hidden`) ride at the next k - 1 positions, causally: the last committed
pair's output scores the first drafted token and mask pair j the (j + 1)-th, laws q_1..q_k
none of which depends on a drafted token. The mask pairs' keys are cut off again, so the
cache holds the committed context alone.

From those laws the draft is a chain or DDTree's best-first tree, made as DFlash makes its
own (`selfspec.drafters.block`: chosen tokens at greedy, draws without replacement
from each position's law when sampling), which keeps the verifier exact for the same reason:
a position's law does not depend on the tokens above it. Where the target runs static steps
(`StaticParallelDraft`) the committed pairs are fed as EAGLE's static draft feeds them (padded
to the most one step commits, their count a device value) and the mask pairs run after them
at positions held on the device, each a step captured on CUDA; the draft, a chain or a
`DeviceTree`, is read with the target's argmax in the step's one host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.block import BlockDrafter, Drafted
from selfspec.drafters.eagle import committed_pairs
from selfspec.drafters.eagle_static import StaticEagleDraft
from selfspec.heads.eagle import EagleHead
from selfspec.model import Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.step import CapturedSteps, SlotView, padded_slots


class ParallelEagleDrafter(BlockDrafter):
    """Drafts k = num_draft_tokens tokens (default: the head's K) from one forward of a
    P-EAGLE head, as a chain, or as the best-first tree of `tree_nodes` nodes at most k
    deep; with `confidence_threshold` (a head with a confidence head) only the positions (a
    chain's, a tree's depths) whose cumulative predicted acceptance is at least it
    (`drafters.block`)."""

    head: EagleHead
    _static: StaticParallelDraft | None

    @staticmethod
    def most_tokens(head: EagleHead) -> tuple[int, str]:
        most = head.config.parallel
        if most < 2:
            raise ValueError("ParallelEagleDrafter: the head drafts one token a forward "
                             "(parallel=1); draft it with EagleDrafter, or train one with "
                             "eagle.parallel=K")
        return most, f"the head drafts up to {most} tokens a forward"

    def begin(self, setup: DecodeSetup) -> None:
        self._begin(setup)
        if self._use_static:
            slots = padded_slots(setup.max_length + 2 * self.k + 1)
            if self._static is None or not self._static.fits(self, setup.target, slots):
                self._static = StaticParallelDraft(self, setup.target, slots)
            return
        config = self.head.config
        self._cache = KVCache.reused(self._cache, 1, config.num_kv_heads,
                                     setup.max_length + self.k, config.head_dim,
                                     self.head.fc.weight)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None:
            return Draft.empty()  # no target features yet (one-token prompt, first step)
        start, tokens, feature = committed_pairs(self.head, context, self._committed,
                                                 "ParallelEagleDrafter")
        if self._use_static:
            self._committed = start + len(tokens)
            drafted = self._static.draft(tokens, feature, start, self._generator)
            return self._proposal(drafted, on_device=True)
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
        states = out[count - 1:]  # [k, h]
        logits = self.head.target_logits(states, self._target.lm_head)  # [k, V]
        drafted = self.shape.draft(logits, self.law, self._generator)
        return self._proposal(self._with_confidence(drafted, states), on_device=False)


@dataclass(frozen=True)
class _PairsOnly:
    """The shape `StaticEagleDraft` feeds committed pairs for (up to depth + 1 a step); it
    grows no tree: P-EAGLE drafts from mask pairs instead."""

    depth: int

    def growth(self, device: torch.device, sampled: bool) -> None:
        return None


class StaticParallelDraft:
    """A P-EAGLE drafter's drafting in static shapes for one target: the committed pairs fed
    by a `StaticEagleDraft` (its cache, its captured step; its root is the head's prediction
    after the last pair, the first drafted law's), then the k - 1 mask pairs at the next
    positions, attending to the committed pairs and causally to each other, in one step of
    their own captured on CUDA. The mask pairs' keys are written past the committed context,
    which the next step's pairs overwrite."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, drafter: ParallelEagleDrafter, target: Transformer, max_slots: int):
        self.drafter, self.target, self.law = drafter, target, drafter.law
        self.pairs = StaticEagleDraft(drafter.head, target, _PairsOnly(drafter.k), max_slots)
        device = self.pairs.device
        masks = drafter.k - 1
        self._steps = CapturedSteps(device, draws=self.law is not None)
        self._rows = torch.arange(masks, device=device)
        self._causal = self._rows[None] <= self._rows[:, None]  # [k - 1, k - 1]
        self._slots = torch.arange(max_slots, device=device)
        self._mask_id = torch.tensor(drafter.head.config.mask_token_id, device=device)
        self._committed = torch.zeros(1, dtype=torch.long, device=device)

    def fits(self, drafter: ParallelEagleDrafter, target: Transformer, max_slots: int) -> bool:
        return (drafter.shape == self.drafter.shape and drafter.law == self.law
                and drafter.confidence_threshold == self.drafter.confidence_threshold
                and self.pairs.fits(drafter.head, target, _PairsOnly(drafter.k), max_slots,
                                    None))

    def draft(self, tokens: torch.Tensor, feature: torch.Tensor, start: int,
              generator: torch.Generator | None) -> Drafted:
        """The draft after the pairs committed at positions start.. (tokens [A], features
        [A, h]); a captured step's outputs, copied (the next step rewrites them)."""
        self.pairs.consume(tokens, feature, start)
        self._committed.fill_(start + len(tokens))
        return self._steps.run("draft", self._draft,
                               generator if self.law is not None else None).cloned()

    def _draft(self) -> Drafted:
        head, drafter = self.drafter.head, self.drafter
        states = self.pairs.root[None]  # [1, h]
        if len(self._rows):
            slots = self._committed + self._rows  # [k - 1] slots and positions
            mask = (self._slots < self._committed)[None].repeat(len(slots), 1)  # [k - 1, S]
            mask.scatter_(1, slots[None].expand(len(slots), -1), self._causal)
            embeds, features = head.mask_pairs(self.target.embed_tokens(self._mask_id),
                                               len(slots))
            out = head(embeds[None].to(states), features[None].to(states), slots,
                       SlotView(self.pairs.cache, slots), mask=mask)[0]  # [k - 1, h]
            states = torch.cat([states, out])
        logits = head.target_logits(states, self.target.lm_head)  # [k, V]
        return drafter._with_confidence(
            drafter.shape.draft(logits, self.law, self._steps.generator), states)
