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

from dataclasses import dataclass

import torch

from selfspec.checks import is_count, is_int_in
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.heads.dflash import DFlashHead
from selfspec.heads.io import check_fused_target
from selfspec.model import Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.ranking import ranked_on_device
from selfspec.sampling import SamplingParams, gumbel_top, logits_to_probs, sample_rows
from selfspec.step import CapturedSteps, SlotView, padded_slots, weights_of
from selfspec.tree import DeviceTree, Tree


class DFlashDrafter:
    """Drafts k = num_draft_tokens tokens (default: the block's B - 1) from one forward of a
    DFlash head, as a chain, or as the best-first tree of `tree_nodes` nodes at most k deep."""

    def __init__(self, head: DFlashHead, num_draft_tokens: int | None = None, *,
                 tree_nodes: int | None = None, sampled_children: bool = True) -> None:
        block = head.config.block_size
        k = block - 1 if num_draft_tokens is None else num_draft_tokens
        if not is_int_in(k, range(1, block)):
            raise ValueError(f"DFlashDrafter: num_draft_tokens must be in 1..{block - 1} (the "
                             f"head's block of {block} slots drafts up to {block - 1}), got {k!r}")
        self.head, self.k, self.sampled_children = head, k, bool(sampled_children)
        self.shape = BlockShape.checked("DFlashDrafter", k, tree_nodes,
                                        head.config.output_vocab_size)
        self.max_nodes = self.shape.max_nodes
        self.target_layers: tuple[int, ...] = tuple(head.config.target_layers)
        self._cache: KVCache | None = None
        self._committed = 0  # head cache slots holding committed context
        self._static: StaticDFlashDraft | None = None
        self._use_static = False

    def begin(self, setup: DecodeSetup) -> None:
        check_fused_target("DFlashDrafter", self.head.config, setup.target)
        self._target, self._generator = setup.target, setup.generator
        self._sampling = setup.sampling
        self._committed = 0
        self._use_static = setup.static_steps
        slots = setup.max_length + self.head.config.block_size
        if self._use_static:
            if self._static is None or not self._static.fits(self, setup.target,
                                                              padded_slots(slots)):
                self._static = StaticDFlashDraft(self, setup.target, padded_slots(slots))
            return
        config = self.head.config
        self._cache = KVCache.reused(self._cache, config.num_layers, config.num_kv_heads, slots,
                                     config.head_dim, self.head.fc.weight)

    @property
    def law(self) -> SamplingParams | None:
        """The warping children are drawn under (None: chosen, the top tokens)."""
        sampling = self._sampling
        return None if sampling.greedy or not self.sampled_children else sampling

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
        return block_draft(drafted, self.shape, on_device=self._use_static)

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
        logits = self.head.target_logits(hidden[0, 1:self.k + 1], self._target.lm_head)
        return self.shape.draft(logits, self.law, self._generator)

def block_tokens(root: int | torch.Tensor, config, device: torch.device) -> torch.Tensor:
    """[B] the block's token ids: the root, then the mask token."""
    block = torch.full((config.block_size,), config.mask_token_id, dtype=torch.long,
                       device=device)
    block[0] = root
    return block


def block_draft(drafted: Drafted, shape: BlockShape, on_device: bool) -> Draft:
    """The draft of one block's laws: a chain, a device tree (on_device, in static steps: read
    with the target's argmax), or a tree read here, its nodes a sampled law could not supply
    left out."""
    if drafted.parents is None:
        return Draft(Tree.chain(shape.k), drafted.tokens, drafted.q)
    tree = DeviceTree(drafted.parents, shape.k, drafted.valid, shape.width)
    sampled = drafted.q is not None
    if on_device:
        return Draft(tree, drafted.tokens, drafted.q, without_replacement=sampled)
    if not sampled:  # chosen: every row a node
        return Draft(tree.on_host(drafted.parents.tolist()), drafted.tokens)
    host, kept = tree.nodes_on_host(drafted.parents.tolist(), drafted.valid.tolist())
    rows = torch.tensor(kept, dtype=torch.long, device=drafted.tokens.device)
    return Draft(host, drafted.tokens.index_select(0, rows), drafted.q.index_select(0, rows),
                 without_replacement=True)


# ---- chains and trees from the per-position laws ---------------------------------------------


@dataclass
class Drafted:
    """One draft as tensors: tokens [N]; parents [N] and valid [N] (None: a chain); q [N, V]
    the law each token was drawn from (None: chosen)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    def cloned(self) -> Drafted:
        """A copy of each tensor: a captured step rewrites its outputs at its next replay."""
        return Drafted(*(None if t is None else t.clone()
                         for t in (self.tokens, self.q, self.parents, self.valid)))


@dataclass(frozen=True)
class BlockShape:
    """What a draft of k positions looks like: a chain (nodes None) or a best-first tree of
    `nodes` nodes over a vocabulary of `vocab` tokens, whose nodes are the `width` top
    candidates of their position (a node has at most that many children)."""

    k: int
    nodes: int | None
    vocab: int

    @classmethod
    def checked(cls, drafter: str, k: int, nodes, vocab: int) -> BlockShape:
        """The shape, its `nodes` checked: null (a chain) or an integer >= 1."""
        if nodes is not None and not is_count(nodes):
            raise ValueError(f"{drafter}: tree_nodes must be null (a chain) or an integer >= 1, "
                             f"got {nodes!r}")
        return cls(k, nodes, vocab)

    @property
    def width(self) -> int:
        return min(self.nodes or 1, self.vocab)

    @property
    def max_nodes(self) -> int:
        """k for a chain; a tree's nodes, or as many rank tuples as there are if fewer."""
        if self.nodes is None:
            return self.k
        tuples, level = 0, 1
        for _ in range(self.k):
            level *= self.width
            tuples += level
            if tuples >= self.nodes:
                return self.nodes
        return tuples

    def draft(self, logits: torch.Tensor, law: SamplingParams | None,
              generator: torch.Generator | None) -> Drafted:
        """The draft from the block's logits [k, V]: chosen tokens (law None) or draws from
        the laws warped by `law`; static shapes, nothing read back."""
        laws = None if law is None else logits_to_probs(logits, law, static=True)  # [k, V]
        if self.nodes is None:
            if laws is None:
                return Drafted(logits.argmax(dim=-1))  # lowest id on ties, as the ranking
            return Drafted(sample_rows(laws, generator), laws)
        scores = torch.log_softmax(logits.double(), dim=-1) if laws is None else laws.double().log()
        ranked = ranked_on_device(logits if laws is None else laws, self.width)  # [k, width]
        tree = best_first_tree(scores.gather(1, ranked), self.nodes, self.max_nodes)
        if laws is None:
            # Chosen ranks lie within the scored vocabulary: every node has a finite score.
            return Drafted(ranked[tree.depths - 1, tree.ranks], None, tree.parents)
        return _sampled_children(tree, laws, self.width, generator)


@dataclass
class BlockTree:
    """A best-first tree as tensors, nodes in topological order: parents [N] (-1: the root),
    depths [N] (1..k), ranks [N] (which candidate of its position's law), valid [N] (a path
    of positive probability)."""

    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    valid: torch.Tensor


def best_first_tree(scores: torch.Tensor, beam: int, nodes: int) -> BlockTree:
    """The `nodes` best rank tuples, a tuple scoring the sum of its ranks' scores:
    scores [k, R] the log-probabilities of each position's R top tokens, best first.

    DDTree pops them from a heap one by one (a popped tuple pushes its first child and its
    next sibling); here, in fixed shapes, depth d keeps its `beam` best tuples (each of the
    beam kept at depth d - 1 extended by each of the R ranks), and the pool of all depths gives
    the `nodes` best. Both find the same set when beam >= nodes: the best tuples of any depth
    lie among that depth's best `beam`, whose parents are the best a depth above. Ties go to
    the shallower tuple, then the earlier made, so a parent precedes its child and every kept
    child's parent is kept. Slots of a beam wider than its depth's tuples score -inf."""
    k, ranks = scores.shape
    device = scores.device
    first = torch.full((beam,), float("-inf"), dtype=scores.dtype, device=device)
    first[: min(beam, ranks)] = scores[0, :beam]
    kept, parents = [first], [torch.full((beam,), -1, dtype=torch.long, device=device)]
    made = [torch.arange(beam, device=device).clamp(max=ranks - 1)]
    for depth in range(1, k):
        candidates = (kept[-1][:, None] + scores[depth][None, :]).flatten()  # [beam * R]
        order = torch.sort(candidates, descending=True, stable=True).indices[:beam]
        kept.append(candidates[order])
        parents.append((depth - 1) * beam + order // ranks)  # pool index of the parent
        made.append(order % ranks)
    pool = torch.cat(kept)  # [k * beam], depth by depth
    pick = torch.sort(pool, descending=True, stable=True).indices[:nodes]  # [N]
    node_of = torch.full_like(pool, -1, dtype=torch.long)
    node_of[pick] = torch.arange(len(pick), device=device)
    parent_pool = torch.cat(parents)[pick]
    return BlockTree(parents=torch.where(parent_pool >= 0, node_of[parent_pool.clamp(min=0)], -1),
                     depths=pick // beam + 1, ranks=torch.cat(made)[pick],
                     valid=pool[pick] > float("-inf"))


def _sampled_children(tree: BlockTree, laws: torch.Tensor, width: int,
                      generator: torch.Generator | None) -> Drafted:
    """The tree's tokens drawn: each node's (and the root's) children are its first draws,
    without replacement, from the law of the position below it, its child of rank r taking
    draw r (`gumbel_top`: a row of uniforms per parent, `width` draws). A draw the law could
    not supply, and everything below it, is no node."""
    k = laws.shape[0]
    below = torch.cat([tree.depths.new_zeros(1), tree.depths]).clamp(max=k - 1)  # [N + 1]
    tokens, drawn = gumbel_top(laws[below], width, generator)  # [N + 1, W] each
    row = tree.parents + 1  # [N] each node's parent's row (0: the root)
    valid = drawn[row, tree.ranks] & tree.valid
    for _ in range(k - 1):  # a node is valid when it and every ancestor were drawn
        valid = valid & torch.where(tree.parents >= 0, valid[tree.parents.clamp(min=0)], True)
    return Drafted(tokens[row, tree.ranks], laws[tree.depths - 1], tree.parents, valid)


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
        logits = head.target_logits(hidden[0, 1:drafter.k + 1], self.target.lm_head)
        return drafter.shape.draft(logits, self.law, self._steps.generator)
