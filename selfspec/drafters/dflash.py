"""DFlash drafting: one forward of the block drafter gives a law per position, and the draft is
a chain or a tree made from those laws (`selfspec.heads.dflash`).

Each step the head's cache takes the keys and values of the rows the target just committed
(their fused features, `DraftContext.features`), then one forward runs over [the root,
mask x (B - 1)] at the root's position and the next B - 1, bidirectionally, and its slots
1..k score the k tokens after the root: laws q_1..q_k, none of which depends on a drafted
token. The block's own keys are then cut off again, so the cache holds the committed context
alone: after verification it grows by the accepted rows' features, whatever was rejected.

- Chain (`tree_nodes=None`): each position's top token (greedy; q=None), or one draw from each
  position's warped law (T > 0; q = the laws).
- Tree (`tree_nodes=N`): DDTree's best-first tree over the laws. A node is a rank tuple
  (r_1..r_d): the r_i-th most likely token of position i, scored by the sum of their
  log-probabilities; the N best form the tree (prefix-closed: a parent outscores its child, a
  rank its successor). Chosen tokens (q=None) at greedy, or with `sampled_children=False`.
  Sampling with `sampled_children` (the default), the same shape is planned from the warped
  laws alone, then each node's children are drawn without replacement from the law of their
  position (Gumbel-top-k, a row of uniforms per parent): how many children a node gets is fixed
  before any draw, and a position's law does not depend on the tokens above it, so the
  verifier's recursive rejection sampling with q = those laws (`without_replacement`) keeps the
  output exact.

Everything after the consumed context is tensor work of fixed shape with nothing read back, so
the one function serves both ways of drafting: eagerly over a growing cache, and, where the
target runs static steps, as one captured step over a persistent cache (`StaticDFlashDraft`),
the committed rows fed padded to a fixed width. A tree is then a `DeviceTree` whose parents the
loop reads with the target's argmax in the step's one host read; eagerly it is read here.
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.block import BlockDrafter, Drafted
from selfspec.heads.dflash import DFlashHead
from selfspec.model import Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.step import CapturedSteps, SlotView, padded_slots, weights_of


class DFlashDrafter(BlockDrafter):
    """Drafts k = num_draft_tokens tokens (default: the block's B - 1) from one forward of a
    DFlash head, as a chain, or as the best-first tree of `tree_nodes` nodes at most k deep;
    with `confidence_threshold` (a head with a confidence head) only the positions (a chain's,
    a tree's depths) whose cumulative predicted acceptance is at least it (`drafters.block`)."""

    head: DFlashHead
    _static: StaticDFlashDraft | None

    @staticmethod
    def most_tokens(head: DFlashHead) -> tuple[int, str]:
        block = head.config.block_size
        return block - 1, f"the head's block of {block} slots drafts up to {block - 1}"

    def begin(self, setup: DecodeSetup) -> None:
        self._begin(setup)
        slots = setup.max_length + self.head.config.block_size
        if self._use_static:
            if self._static is None or not self._static.fits(self, setup.target,
                                                              padded_slots(slots)):
                self._static = StaticDFlashDraft(self, setup.target, padded_slots(slots))
            return
        config = self.head.config
        self._cache = KVCache.reused(self._cache, config.num_layers, config.num_kv_heads, slots,
                                     config.head_dim, self.head.fc.weight)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None:
            return Draft.empty()  # no target features yet (a one-token prompt's first step)
        start, streams = self._committed_rows(context)
        root = context.token_list()[-1]
        if self._use_static:
            self._committed = start + len(streams[0])
            drafted = self._static.draft(streams, start, root, self._generator)
        else:
            drafted = self._draft_eagerly(streams, start, root)
        return self._proposal(drafted, on_device=self._use_static)

    def _committed_rows(self, context: DraftContext) -> tuple[int, tuple[torch.Tensor, ...]]:
        """The first position of the rows the target just committed, and their streams."""
        features, length = context.features, len(context.tokens)
        start = length - 1 - len(features.tokens)
        if start != self._committed:
            raise RuntimeError(
                f"DFlashDrafter: its cache holds {self._committed} positions but the target's "
                f"features start at position {start}: call begin() before each generation and "
                f"pass every step's features")
        return start, features.hidden

    def _draft_eagerly(self, streams: tuple[torch.Tensor, ...], start: int, root: int
                       ) -> Drafted:
        weight, cache = self.head.fc.weight, self._cache
        count = streams[0].shape[0]
        positions = torch.arange(start, start + count, device=weight.device)
        context = self.head.context(tuple(s.to(weight) for s in streams))  # [A, h]
        self.head.write_context(context[None], positions, cache)
        self._committed = cache.length
        block = block_tokens(root, self.head.config, weight.device)
        hidden = self.head(self._target.embed_tokens(block)[None].to(weight),
                           start + count + torch.arange(len(block), device=weight.device), cache)
        cache.truncate(self._committed)  # the block's own keys: dropped again
        states = hidden[0, 1:self.k + 1]  # [k, h]
        logits = self.head.target_logits(states, self._target.lm_head)
        return self._with_confidence(self.shape.draft(logits, self.law, self._generator), states)

def block_tokens(root: int | torch.Tensor, config, device: torch.device) -> torch.Tensor:
    """[B] the block's token ids: the root, then the mask token."""
    block = torch.full((config.block_size,), config.mask_token_id, dtype=torch.long,
                       device=device)
    block[0] = root
    return block


# ---- static steps ------------------------------------------------------------------------------


class StaticDFlashDraft:
    """A DFlash drafter's drafting in static shapes over a persistent cache, for one target:
    `draft(streams, start, root)` feeds the committed rows (padded to the most one step
    commits, k + 1; their count a device value) and runs the block, in one step captured on
    CUDA (`CapturedSteps`) and replayed every step. The padding rows write slots the block
    writes over, and nothing past the committed context is ever attended to but the block."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, drafter: DFlashDrafter, target: Transformer, max_slots: int) -> None:
        head, config = drafter.head, drafter.head.config
        self.drafter, self.target, self.law = drafter, target, drafter.law
        self.weights = weights_of(head, target)
        weight = head.fc.weight
        self.device = weight.device
        self.cache = KVCache(config.num_layers, 1, config.num_kv_heads, max_slots,
                             config.head_dim, dtype=weight.dtype, device=self.device)
        self.width = drafter.k + 1  # the most rows one step commits
        self._steps = CapturedSteps(self.device, draws=self.law is not None)
        self._slots = torch.arange(max_slots, device=self.device)
        self._rows = torch.arange(self.width, device=self.device)
        self._block = torch.arange(config.block_size, device=self.device)
        self._streams = torch.zeros(self.width, config.feature_size, dtype=weight.dtype,
                                    device=self.device)
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)  # committed before
        self._count = torch.ones(1, dtype=torch.long, device=self.device)  # rows fed now
        self._tokens = block_tokens(0, config, self.device)

    def fits(self, drafter: DFlashDrafter, target: Transformer, max_slots: int) -> bool:
        return (drafter.head is self.drafter.head and drafter.shape == self.drafter.shape
                and target is self.target and drafter.law == self.law
                and drafter.confidence_threshold == self.drafter.confidence_threshold
                and self.cache.max_slots >= max_slots
                and weights_of(drafter.head, target) == self.weights)

    def draft(self, streams: tuple[torch.Tensor, ...], start: int, root: int,
              generator: torch.Generator | None) -> Drafted:
        """The draft after the rows committed at positions start.. (their streams); a captured
        step's outputs, copied (the next step rewrites them)."""
        head, count = self.drafter.head, streams[0].shape[0]
        if count > self.width:  # the prompt, after the prefill: once, eagerly
            positions = torch.arange(start, start + count, device=self.device)
            self.cache.length = start
            head.write_context(head.context(tuple(s.to(self._streams) for s in streams))[None],
                               positions, self.cache)
            start, count = start + count, 0
        else:
            self._streams[:count].copy_(torch.cat(streams, dim=-1))
        self._start.fill_(start)
        self._count.fill_(count)
        self._tokens[:1].fill_(root)
        return self._steps.run("draft", self._draft,
                               generator if self.law is not None else None).cloned()

    def _draft(self) -> Drafted:
        head, drafter = self.drafter.head, self.drafter
        slots = self._start + self._rows  # [W]: rows past count write slots the block rewrites
        width = head.config.target_hidden_size or head.config.hidden_size
        context = head.context(self._streams.split(width, dim=-1))[None]  # [1, W, h]
        head.write_context(context, slots, SlotView(self.cache, slots))
        committed = self._start + self._count  # [1]
        block = committed + self._block  # [B] the block's slots and positions
        mask = (self._slots < committed)[None].repeat(len(block), 1)  # [B, S]
        mask.scatter_(1, block[None].expand(len(block), -1), True)  # and the whole block
        embeds = self.target.embed_tokens(self._tokens)[None].to(context)
        hidden = head(embeds, block, SlotView(self.cache, block), mask=mask)
        states = hidden[0, 1:drafter.k + 1]  # [k, h]
        logits = head.target_logits(states, self.target.lm_head)
        return drafter._with_confidence(
            drafter.shape.draft(logits, self.law, self._steps.generator), states)
