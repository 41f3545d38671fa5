"""Block drafting: the pieces every drafter shares whose one forward gives a law per position,
none depending on a drafted token (DFlash's block, P-EAGLE's mask pairs, PARD's masks; docs/
design.md, "Seams").

From the k laws a draft is a chain (each position's top token, or one draw from each warped
law) or DDTree's best-first tree (`BlockShape`, `best_first_tree`): a node is a rank tuple
(r_1..r_d), the r_i-th most likely token of position i, scored by the sum of their
log-probabilities, the N best forming the tree. Sampling, the shape is planned from the warped
laws alone and each node's children are then drawn without replacement from their position's
law, so the verifier with q = those laws (`without_replacement`) keeps the output exact. All of
it is tensor work of fixed shape with nothing read back: it runs eagerly or in a captured
static step alike (`Drafted`, turned into a `Draft` by `block_draft`).

`BlockDrafter` holds what a drafter over a head's fused target states keeps besides (DFlash,
P-EAGLE): the draft's length and shape, its head cache's committed positions, and the law its
tokens are drawn under.

Confidence-sized drafts (DSpark's confidence head, `confidence_threshold`): the head gives
each position k the predicted chance c_k that its token is accepted once every position before
it was; the draft proposed keeps the positions whose cumulative chance c_1 x ... x c_k is at
least the threshold (at least one): a chain's first ones, a tree's nodes that deep (whole
depths, so every sibling set stays whole). The cut depends on the head's states alone, never
on a drafted token or a draw, and the verifier checks whatever is proposed: the output stays
exact. A chain's length is read back to the host (one read more a step in static shapes); a
tree's cut marks its deeper rows as no nodes (`DeviceTree.valid`), read with its parents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.checks import is_count, is_int_in, is_number
from selfspec.drafters.base import DecodeSetup, Draft
from selfspec.heads.io import check_fused_target
from selfspec.model.kv_cache import KVCache
from selfspec.ranking import ranked_on_device
from selfspec.sampling import SamplingParams, gumbel_top, logits_to_probs, sample_rows
from selfspec.tree import DeviceTree


class BlockDrafter:
    """What DFlash's and P-EAGLE's drafters share: k = num_draft_tokens, the `shape` of a
    draft (a chain, or a best-first tree of `tree_nodes` nodes at most k deep), the head's
    fused target layers, its cache of committed positions (eager) or its static drafting
    (`_static`), and the `law` its tokens are drawn under."""

    def __init__(self, head: Any, num_draft_tokens: int | None = None, *,
                 tree_nodes: int | None = None, sampled_children: bool = True,
                 confidence_threshold: float | None = None) -> None:
        most, why = self.most_tokens(head)
        k = most if num_draft_tokens is None else num_draft_tokens
        if not is_int_in(k, range(1, most + 1)):
            raise ValueError(f"{type(self).__name__}: num_draft_tokens must be in 1..{most} "
                             f"({why}), got {k!r}")
        self.head, self.k, self.sampled_children = head, k, bool(sampled_children)
        self.shape = BlockShape.checked(type(self).__name__, k, tree_nodes,
                                        head.config.output_vocab_size)
        self.confidence_threshold = checked_confidence(type(self).__name__, head,
                                                       confidence_threshold)
        self.max_nodes = self.shape.max_nodes
        self.target_layers: tuple[int, ...] = tuple(head.config.target_layers)
        self._cache: KVCache | None = None
        self._committed = 0  # head cache slots holding committed context
        self._static: Any = None  # drafting in static shapes, kept across generations
        self._use_static = False

    @staticmethod
    def most_tokens(head: Any) -> tuple[int, str]:
        """The most tokens one forward of `head` drafts (num_draft_tokens' default and
        bound), and where that bound comes from, for the refusal of a larger one."""
        raise NotImplementedError

    def _begin(self, setup: DecodeSetup) -> None:
        """A generation's start: the target checked against the head, its settings kept, the
        head's cache empty."""
        check_fused_target(type(self).__name__, self.head.config, setup.target)
        self._target, self._generator = setup.target, setup.generator
        self._sampling = setup.sampling
        self._committed = 0
        self._use_static = setup.static_steps

    @property
    def law(self) -> SamplingParams | None:
        """The warping tokens are drawn under (None: chosen, the top tokens)."""
        sampling = self._sampling
        return None if sampling.greedy or not self.sampled_children else sampling

    def _with_confidence(self, drafted: Drafted, states: torch.Tensor) -> Drafted:
        """The draft with its positions' cumulative confidence, of the k states [k, h] its
        laws were scored from, when the drafter sizes its drafts by it (tensor work only)."""
        if self.confidence_threshold is not None:
            drafted.confidence = cumulative_acceptance(self.head.acceptance_logits(states))
        return drafted

    def _proposal(self, drafted: Drafted, on_device: bool) -> Draft:
        """The draft proposed: cut where its cumulative confidence falls below the threshold
        (a chain's length, `confident_length`; a tree's depth, `Drafted.within`), or the whole
        draft."""
        threshold = self.confidence_threshold
        if threshold is not None and drafted.parents is None and not on_device:
            drafted = drafted.cut(confident_length(drafted.confidence, threshold))
        elif threshold is not None:  # in static steps a chain is cut as a one-wide tree is,
            # on the device: its length is read back with the target's argmax, not before
            drafted = drafted.as_tree().within(confident_depth(drafted.confidence, threshold))
        return block_draft(drafted, self.shape, on_device)


def checked_confidence(drafter: str, head: Any, threshold: float | None) -> float | None:
    """The confidence threshold: None (the whole block) or a number in (0, 1), for a head with
    a confidence head."""
    if threshold is None:
        return None
    if not is_number(threshold) or not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"{drafter}: confidence_threshold must lie in (0, 1) (the least "
                         f"cumulative predicted acceptance of a proposed position) or be None, "
                         f"got {threshold!r}")
    if not head.config.confidence_head:
        raise ValueError(f"{drafter}: confidence_threshold needs a head trained with a confidence "
                         f"head (confidence_head=true); this head has none: set it to null")
    return float(threshold)


def cumulative_acceptance(logits: torch.Tensor) -> torch.Tensor:
    """[k] the predicted chance that positions 1..k are all accepted, of the confidence head's
    logits [k] (each position's chance given every one before it was)."""
    return torch.sigmoid(logits.float()).cumprod(dim=0)


def confident_length(cumulative: torch.Tensor, threshold: float) -> int:
    """How many positions to propose: those whose cumulative chance [k] (non-increasing) is at
    least the threshold, and at least one. One host read."""
    return int(confident_depth(cumulative, threshold))


def confident_depth(cumulative: torch.Tensor, threshold: float) -> torch.Tensor:
    """`confident_length` as a device value [] (nothing read back)."""
    return (cumulative >= threshold).sum().clamp(min=1)


def block_draft(drafted: Drafted, shape: BlockShape, on_device: bool) -> Draft:
    """The draft of one block's laws: a chain, a device tree (on_device, in static steps: read
    with the target's argmax), or a tree read here, its rows that are no nodes left out (those
    a sampled law could not supply, or the confidence cut)."""
    if drafted.parents is None:
        return Draft.chain(drafted.tokens, drafted.q)
    tree = DeviceTree(drafted.parents, shape.k, drafted.valid, shape.width)
    sampled = drafted.q is not None
    if on_device:
        return Draft(tree, drafted.tokens, drafted.q, without_replacement=sampled)
    if drafted.valid is None:  # every row a node
        return Draft(tree.on_host(drafted.parents.tolist()), drafted.tokens)
    host, kept = tree.nodes_on_host(drafted.parents.tolist(), drafted.valid.tolist())
    rows = torch.tensor(kept, dtype=torch.long, device=drafted.tokens.device)
    q = drafted.q.index_select(0, rows) if sampled else None
    return Draft(host, drafted.tokens.index_select(0, rows), q, without_replacement=sampled)


@dataclass
class Drafted:
    """One draft as tensors: tokens [N]; parents [N], depths [N] and valid [N] (None: a chain;
    valid None: every row a node); q [N, V] the law each token was drawn from (None: chosen);
    confidence [k] the cumulative predicted acceptance of its positions (None: not asked)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    depths: torch.Tensor | None = None

    def cloned(self) -> Drafted:
        """A copy of each tensor: a captured step rewrites its outputs at its next replay."""
        return Drafted(*(None if t is None else t.clone() for t in
                         (self.tokens, self.q, self.parents, self.valid, self.confidence,
                          self.depths)))

    def within(self, depth: torch.Tensor) -> Drafted:
        """A tree whose rows deeper than `depth` (a device value) are no nodes."""
        shallow = self.depths <= depth  # [N]
        valid = shallow if self.valid is None else self.valid & shallow
        return dataclasses.replace(self, valid=valid)

    def as_tree(self) -> Drafted:
        """A chain as the tree it is (each row the child of the one before); a tree as it is."""
        if self.parents is not None:
            return self
        rows = torch.arange(self.tokens.shape[0], device=self.tokens.device)
        return dataclasses.replace(self, parents=rows - 1, depths=rows + 1)

    def cut(self, n: int) -> Drafted:
        """A chain's first n positions."""
        if self.parents is not None:
            raise ValueError("Drafted.cut: a tree keeps its size; only chains are cut")
        return Drafted(self.tokens[:n], None if self.q is None else self.q[:n],
                       confidence=None if self.confidence is None else self.confidence[:n])


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
            return Drafted(ranked[tree.depths - 1, tree.ranks], None, tree.parents,
                           depths=tree.depths)
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
    return Drafted(tokens[row, tree.ranks], laws[tree.depths - 1], tree.parents, valid,
                   depths=tree.depths)
