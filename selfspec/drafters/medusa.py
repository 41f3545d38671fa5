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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.ranking import ranked as _ranked
from selfspec.heads.io import check_sizes
from selfspec.heads.medusa import MedusaHeads
from selfspec.tree import Tree


class MedusaDrafter:
    """Proposes `tree` filled from the heads' rankings.

    tree: a `Tree` or Medusa choices such as `[[0], [1], [0, 0]]`; its depth must not exceed
    the number of heads (node depth d uses head d-1).
    """

    target_layers: tuple[int, ...] = ()  # only last_hidden is needed, which always comes

    def __init__(self, heads: MedusaHeads, tree: Tree | Sequence[Sequence[int]]):
        self.heads = heads
        self._lm_head = None  # the target's, set by begin (heads that share it read it)
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

    def begin(self, setup: DecodeSetup) -> None:
        _check_target("MedusaDrafter", self.heads, setup)
        self._lm_head = setup.target.lm_head

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if self.tree.num_nodes == 0:
            return Draft.empty()
        logits = _root_logits(self.heads, self._lm_head, context, self.tree.max_depth)  # [depth, V]
        if logits is None:
            return Draft.empty()  # no hidden state yet (one-token prompt before any forward)
        ranked = _ranked(logits, self._ranks)  # [depth, ranks] output ids, most likely first
        tokens = ranked[self._head_of.to(ranked.device), self._rank_of.to(ranked.device)]  # [N]
        tokens = self.heads.target_ids(tokens)
        return Draft(self.tree, tokens.to(context.features.last_hidden.device))


class MedusaProductDrafter:
    """Proposes, each step, the best prefix-closed tree of the heads' top-k products.

    Head d-1 contributes its top_k tokens with their probabilities (softmax of its logits);
    a root-to-node path scores the product of its heads' probabilities. The draft is the
    `max_nodes` best paths, ordered by (score desc, depth asc, rank path lexicographic): a
    parent never scores below its child and always comes first, so the chosen set is
    prefix-closed and the order topological, ties included.

    depth: how many heads to use (None = all). `max_nodes` on the instance is capped at the
    size of the full product tree, top_k + top_k^2 + ... + top_k^depth.
    """

    target_layers: tuple[int, ...] = ()  # only last_hidden is needed, which always comes

    def __init__(
        self, heads: MedusaHeads, top_k: int, max_nodes: int, depth: int | None = None
    ) -> None:
        depth = heads.config.num_heads if depth is None else depth
        _check_product_arguments(heads, top_k, max_nodes, depth)
        self.heads, self.top_k, self.depth = heads, top_k, depth
        self._lm_head = None  # the target's, set by begin (heads that share it read it)
        self.max_nodes = min(max_nodes, sum(top_k**d for d in range(1, depth + 1)))

    def begin(self, setup: DecodeSetup) -> None:
        _check_target("MedusaProductDrafter", self.heads, setup)
        self._lm_head = setup.target.lm_head

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        logits = _root_logits(self.heads, self._lm_head, context, self.depth)  # [depth, V]
        if logits is None:
            return Draft.empty()  # no hidden state yet (one-token prompt before any forward)
        ranked = _ranked(logits, self.top_k)  # [depth, k] token ids, most likely first
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(1, ranked)  # [depth, k]
        # The tree is built on the CPU: it holds at most max_nodes nodes.
        parents, level, rank = _best_product_paths(log_probs.cpu(), self.max_nodes)
        tokens = self.heads.target_ids(ranked[level.to(ranked.device), rank.to(ranked.device)])
        tree = Tree.from_parents(parents.tolist())
        return Draft(tree, tokens.to(context.features.last_hidden.device))


# ---- shared by both modes -------------------------------------------------------------------


def _root_logits(heads: MedusaHeads, lm_head: torch.nn.Module | None, context: DraftContext,
                 depth: int) -> torch.Tensor | None:
    """[depth, V] logits of heads 0..depth-1 at the state that produced the root, or None
    before the target's first forward (no hidden state yet). lm_head: the target's (used by
    heads that share it)."""
    if context.features is None:
        return None
    hidden = context.features.last_hidden[-1]  # [H] the state that produced the root
    weight = next(heads.parameters(), None)
    weight = lm_head.weight if weight is None else weight
    return heads(hidden.to(device=weight.device, dtype=weight.dtype), lm_head, count=depth)


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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
    offsets = [0] + [len(lv[1]) for lv in levels[:-1]]
    offsets = torch.tensor(offsets).cumsum(0)  # [depth] where each level starts in the list
    parent = torch.cat(  # [M] index into the list, -1 for the root
        [lv[2] + offsets[d - 1] if d else lv[2] for d, lv in enumerate(levels)]
    )
    # Stable sort on score alone: the list is already in (depth asc, lexicographic) order.
    chosen = torch.sort(score, descending=True, stable=True).indices[:max_nodes]  # [N]
    position = torch.full((len(score) + 1,), -1, dtype=torch.long)  # [M + 1], last = root
    position[chosen] = torch.arange(len(chosen))
    parents = position[parent[chosen]]  # parent -1 indexes the root's slot, which stays -1
    return parents, level[chosen], rank[chosen]


def _expand_levels(
    log_probs: torch.Tensor, max_nodes: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per level d, its best (at most) max_nodes paths in lexicographic rank-path order, as
    (score [F], rank [F], parent [F]): parent indexes level d-1's list (-1 on level 0)."""
    depth, k = log_probs.shape
    levels = []
    score = torch.zeros(1, dtype=log_probs.dtype)  # [1] the root
    for d in range(depth):
        # Row-major flattening of [parents, ranks] is lexicographic, since parents are.
        candidates = (score[:, None] + log_probs[d][None, :]).flatten()  # [F * k]
        best = torch.sort(candidates, descending=True, stable=True).indices[:max_nodes]
        best = best.sort().values  # back to lexicographic order for the next level
        parent = best // k if d else torch.full_like(best, -1)
        score = candidates[best]
        levels.append((score, best % k, parent))
    return levels
