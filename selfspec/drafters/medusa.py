"""Medusa drafting: candidates from the Medusa heads, in one of two modes.

Every head reads the target's last committed hidden state once; head k ranks the token k + 1
places after the root (node depth d uses head d-1).

- `MedusaDrafter` (static tree, Medusa "choices"): the node with choices path (r1, ..., rd)
  gets the r_d-th most likely token of head d-1.
- `MedusaProductDrafter` (dynamic tree, "from top-k products"): each step, the tree of the
  `max_nodes` most likely root-to-node paths of the Cartesian product of the heads' top-k
  lists, a path scoring the product of its per-head probabilities. Enough nodes give the full
  product tree of the original Medusa; fewer give its best prefix-closed subset.

Candidates are chosen, not sampled (q=None), so the shared verifier keeps the target's law
exactly at every temperature. Medusa's lossy "typical acceptance" is deliberately not
implemented.

Where the target runs static steps (`DecodeSetup.static_steps`), both draft in static shapes
on the device, reading nothing back: the root's state goes into a fixed buffer and the heads,
the ranking (`ranked_on_device`) and the tree's tokens (the products' tree as a `DeviceTree`)
run as one step, captured on CUDA (`selfspec.step.CapturedSteps`). The drafts are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.checks import is_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.heads.io import check_sizes
from selfspec.heads.medusa import MedusaHeads
from selfspec.ranking import ranked as _ranked
from selfspec.ranking import ranked_on_device
from selfspec.step import CapturedSteps, weights_of
from selfspec.tree import DeviceTree, Tree


class _HeadsDrafter:
    """What both Medusa drafters share: the heads, checked against the target at `begin`, and
    the target's LM head and static root drafting they read."""

    heads: MedusaHeads
    target_layers: tuple[int, ...] = ()  # only last_hidden is needed, which always comes

    def begin(self, setup: DecodeSetup) -> None:
        _check_target(type(self).__name__, self.heads, setup)
        self._lm_head = setup.target.lm_head
        self._static = _StaticRoot.kept(self._static, self.heads,
                                        self._lm_head, setup.static_steps)


class MedusaDrafter(_HeadsDrafter):
    """Proposes `tree` filled from the heads' rankings.

    tree: a `Tree` or Medusa choices such as `[[0], [1], [0, 0]]`; its depth must not exceed
    the number of heads (node depth d uses head d-1).
    """

    def __init__(self, heads: MedusaHeads, tree: Tree | Sequence[Sequence[int]]):
        self.heads = heads
        self._lm_head = None  # the target's, set by begin (heads that share it read it)
        self._static: _StaticRoot | None = None  # drafting in static shapes, kept
        self.tree = tree if isinstance(tree, Tree) else Tree.from_paths(tree)
        self.max_nodes = self.tree.num_nodes
        _check_depth(
            "MedusaDrafter",
            "the tree is",
            self.tree.max_depth,
            heads,
            f"use a tree of depth <= {heads.config.num_heads} or heads with num_heads >= "
            f"{self.tree.max_depth}",
        )
        worst = max((c[-1] for c in self.tree.choices), default=0)
        _check_rank(
            "MedusaDrafter",
            "the tree asks for",
            worst,
            heads,
            f"use ranks < {heads.config.output_size}",
        )
        self._head_of = self.tree.depth - 1  # [N] which head ranks each node
        self._rank_of = torch.tensor([c[-1] for c in self.tree.choices], dtype=torch.long)  # [N]
        self._ranks = worst + 1  # how many candidates per head the tree uses

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        hidden = _root_state(self.heads, self._lm_head, context)
        if self.tree.num_nodes == 0 or hidden is None:
            return Draft.empty()  # no hidden state yet (one-token prompt before any forward)
        if self._static is not None:
            (tokens,) = self._static.run(hidden, lambda h: (self._tokens(h, ranked_on_device),))
        else:
            tokens = self._tokens(hidden, _ranked)
        return Draft(self.tree, tokens.to(context.features.last_hidden.device))

    def _tokens(self, hidden: torch.Tensor, rank) -> torch.Tensor:
        """[N] the tree's tokens: node (r1, ..., rd) gets head d-1's rank-rd token."""
        logits = self.heads(hidden, self._lm_head, count=self.tree.max_depth)  # [depth, V]
        ranked = rank(logits, self._ranks)  # [depth, ranks] output ids, most likely first
        if self._head_of.device != ranked.device:  # moved once: a captured step may not copy
            self._head_of, self._rank_of = (t.to(ranked.device) for t in (self._head_of,
                                                                         self._rank_of))
        tokens = ranked[self._head_of, self._rank_of]  # [N]
        return self.heads.target_ids(tokens)


class MedusaProductDrafter(_HeadsDrafter):
    """Proposes, each step, the best prefix-closed tree of the heads' top-k products.

    Head d-1 contributes its top_k tokens with their probabilities (softmax of its logits);
    a root-to-node path scores the product of its heads' probabilities. The draft is the
    `max_nodes` best paths, ordered by (score desc, depth asc, rank path lexicographic): a
    parent never scores below its child and always comes first, so the chosen set is
    prefix-closed and the order topological, ties included.

    depth: how many heads to use (None = all). `max_nodes` on the instance is capped at the
    size of the full product tree, top_k + top_k^2 + ... + top_k^depth.
    """

    def __init__(
        self, heads: MedusaHeads, top_k: int, max_nodes: int, depth: int | None = None
    ) -> None:
        depth = heads.config.num_heads if depth is None else depth
        _check_product_arguments(heads, top_k, max_nodes, depth)
        self.heads, self.top_k, self.depth = heads, top_k, depth
        self._lm_head = None  # the target's, set by begin (heads that share it read it)
        self._static: _StaticRoot | None = None  # drafting in static shapes, kept
        self.max_nodes = min(max_nodes, sum(top_k**d for d in range(1, depth + 1)))

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        hidden = _root_state(self.heads, self._lm_head, context)
        if hidden is None:
            return Draft.empty()  # no hidden state yet (one-token prompt before any forward)
        device = context.features.last_hidden.device
        if self._static is not None:
            tokens, parents = self._static.run(hidden, lambda h: self._tree(h, ranked_on_device))
            return Draft(DeviceTree(parents.to(device), self.depth), tokens.to(device))
        # Off static steps the tree is built on the CPU: it holds at most max_nodes nodes.
        tokens, parents = self._tree(hidden, _ranked, torch.device("cpu"))
        return Draft(Tree.from_parents(parents.tolist()), tokens.to(device))

    def _tree(self, hidden: torch.Tensor, rank, where: torch.device | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The best paths' tokens [N] and parents [N] (on `where`, default the heads')."""
        logits = self.heads(hidden, self._lm_head, count=self.depth)  # [depth, V]
        ranked = rank(logits, self.top_k)  # [depth, k] token ids, most likely first
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(1, ranked)  # [depth, k]
        where = log_probs.device if where is None else where
        parents, level, rank = _best_product_paths(log_probs.to(where), self.max_nodes)
        tokens = self.heads.target_ids(ranked[level.to(ranked.device), rank.to(ranked.device)])
        return tokens, parents


# ---- shared by both modes -------------------------------------------------------------------


def _root_state(heads: MedusaHeads, lm_head: torch.nn.Module | None, context: DraftContext
                ) -> torch.Tensor | None:
    """[H] the state that produced the root, on the heads' device and in their dtype, or None
    before the target's first forward (no hidden state yet)."""
    if context.features is None:
        return None
    weight = _weight_of(heads, lm_head)
    return context.features.last_hidden[-1].to(device=weight.device, dtype=weight.dtype)


def _weight_of(heads: MedusaHeads, lm_head: torch.nn.Module | None) -> torch.Tensor:
    """A weight the heads read: their own, or the target's LM head's where they share it."""
    weight = next(heads.parameters(), None)
    return lm_head.weight if weight is None else weight


class _StaticRoot:
    """The root's state in a buffer of fixed address, and a drafter's function of it, a step
    captured on CUDA (run as it is elsewhere); the outputs are copies."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, weight: torch.Tensor, reads: tuple) -> None:
        self.hidden = torch.zeros(weight.shape[-1], dtype=weight.dtype, device=weight.device)
        self.steps, self.reads = CapturedSteps(weight.device), reads

    @classmethod
    def kept(cls, kept: _StaticRoot | None, heads: MedusaHeads, lm_head, static: bool
             ) -> _StaticRoot | None:
        """`kept` if it still reads what the heads read now, a new one, or None off static
        steps (a captured step would miss weights replaced, moved or cast since)."""
        if not static:
            return None
        reads = weights_of(heads, lm_head)
        if kept is not None and kept.reads == reads:
            return kept
        return cls(_weight_of(heads, lm_head), reads)

    def run(self, hidden: torch.Tensor, draft) -> tuple[torch.Tensor, ...]:
        self.hidden.copy_(hidden)
        return tuple(t.clone() for t in self.steps.run("draft", lambda: draft(self.hidden)))


def _check_target(drafter: str, heads: MedusaHeads, setup: DecodeSetup) -> None:
    check_sizes(drafter, "the heads have", heads.config, setup.target,
                "load heads trained for this target")


def _check_depth(drafter: str, subject: str, depth: int, heads: MedusaHeads, fix: str) -> None:
    """Node depth d is ranked by head d-1: a draft cannot go deeper than there are heads."""
    num_heads = heads.config.num_heads
    if depth > num_heads:
        raise ValueError(
            f"{drafter}: {subject} {depth} deep but there are only {num_heads} Medusa heads "
            f"(depth d uses head d-1); {fix}"
        )


def _check_rank(drafter: str, subject: str, rank: int, heads: MedusaHeads, fix: str) -> None:
    """A head ranks output_size tokens (its draft vocabulary's, or all): beyond, none exist."""
    vocab_size = heads.config.output_size
    if rank >= vocab_size:
        raise ValueError(
            f"{drafter}: {subject} candidate rank {rank}, but the vocabulary has only "
            f"{vocab_size} tokens; {fix}"
        )


# ---- top-k products ------------------------------------------------------------------------


def _check_product_arguments(heads: MedusaHeads, top_k: int, max_nodes: int, depth: int) -> None:
    name, num_heads = "MedusaProductDrafter", heads.config.num_heads
    for arg, value, fix in [
        ("top_k", top_k, "pass top_k >= 1 (candidates per head)"),
        ("max_nodes", max_nodes, "pass max_nodes >= 1 (the most nodes one draft may have)"),
        ("depth", depth, f"pass 1 <= depth <= {num_heads}, or depth=None for all heads"),
    ]:
        if not is_count(value):
            raise ValueError(f"{name}: {arg} must be an integer >= 1, got {value!r}; {fix}")
    _check_depth(
        name,
        f"depth={depth} asks for a tree",
        depth,
        heads,
        f"pass depth <= {num_heads}, or depth=None for all heads",
    )
    _check_rank(
        name,
        f"top_k={top_k} asks for",
        top_k - 1,
        heads,
        f"pass top_k <= {heads.config.output_size}",
    )


def _best_product_paths(
    log_probs: torch.Tensor, max_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The max_nodes best root-to-node paths of the product of per-head top-k lists.

    log_probs [depth, k]: head d's log-probability of its rank-r candidate. Returns, per chosen
    node in topological order: parents [N] (-1 = root), level [N] (depth - 1, which head) and
    rank [N] (which of that head's candidates).

    A node of the global top max_nodes has fewer than max_nodes better nodes on its own level,
    and its parent is in the global top too; so expanding level by level, keeping each level's
    best max_nodes, loses none of them.
    """
    levels = _expand_levels(log_probs, max_nodes)
    score = torch.cat([lv[0] for lv in levels])  # [M] all kept nodes, by level, lexicographic
    level = torch.cat([torch.full_like(lv[1], d) for d, lv in enumerate(levels)])  # [M]
    rank = torch.cat([lv[1] for lv in levels])  # [M]
    starts = [0]  # where each level starts in the list (host ints: sizes, not values)
    for lv in levels[:-1]:
        starts.append(starts[-1] + len(lv[1]))
    parent = torch.cat(  # [M] index into the list, -1 for the root
        [lv[2] + starts[d - 1] if d else lv[2] for d, lv in enumerate(levels)]
    )
    # Stable sort on score alone: the list is already in (depth asc, lexicographic) order.
    chosen = torch.sort(score, descending=True, stable=True).indices[:max_nodes]  # [N]
    position = torch.full((len(score) + 1,), -1, dtype=torch.long,
                          device=score.device)  # [M + 1], last = root
    position[chosen] = torch.arange(len(chosen), device=score.device)
    parents = position[parent[chosen]]  # parent -1 indexes the root's slot, which stays -1
    return parents, level[chosen], rank[chosen]


def _expand_levels(
    log_probs: torch.Tensor, max_nodes: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per level d, its best (at most) max_nodes paths in lexicographic rank-path order, as
    (score [F], rank [F], parent [F]): parent indexes level d-1's list (-1 on level 0)."""
    depth, k = log_probs.shape
    levels = []
    score = torch.zeros(1, dtype=log_probs.dtype, device=log_probs.device)  # [1] the root
    for d in range(depth):
        # Row-major flattening of [parents, ranks] is lexicographic, since parents are.
        candidates = (score[:, None] + log_probs[d][None, :]).flatten()  # [F * k]
        best = torch.sort(candidates, descending=True, stable=True).indices[:max_nodes]
        best = best.sort().values  # back to lexicographic order for the next level
        parent = best // k if d else torch.full_like(best, -1)
        score = candidates[best]
        levels.append((score, best % k, parent))
    return levels
