"""EAGLE drafting in static shapes, on the device: what `EagleDrafter` runs when the target
runs static steps (CUDA graphs on CUDA; `cuda_graphs=True` elsewhere runs the same code
eagerly), for chosen children and for sampled children.

A draft's shape is a `StaticShape` (a fixed tree) or a `DynamicShape` (EAGLE-2), each
knowing its depth, its width and how many nodes it drafts. For either, this module builds the
tree `EagleDrafter`'s host-side growth builds (the same nodes in the same order), but as
tensor ops over fixed widths, reading nothing back to the host:

- the head's cache is written at slot tensors, and each forward attends over every slot
  under a mask built on the device (`selfspec.step.SlotView`);
- the committed pairs are fed padded to one width (the most a step can commit), their
  count a device value; a longer feed (after the prefill) runs eagerly;
- a static tree feeds each level's parents at fixed slots and takes each node's token from
  its parent's ranking (`ranked_on_device`), or its parent's draws;
- an EAGLE-2 tree feeds its frontier per level. Chosen: every frontier node gets top_k
  children, scored in float64 (the host growth sums Python floats), the next frontier is
  the best top_k by a stable sort (ties by creation order), and the pool's best
  `total_tokens` are kept in creation order. Sampled: the budget is spent while growing,
  by the plan both growths follow (`level_plan`), and every node is kept. Either is a
  `DeviceTree`, whose parents the decode loop reads back in the step's one host read;
- sampled children are Gumbel-top-k draws (`gumbel_top`), one row of uniforms per parent, as
  the host growth draws them; a node its law cannot supply is no node (`DeviceTree.valid`).

On CUDA the feed of the committed pairs and the growth are captured once each (per drafter,
cache size and law) and replayed every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.heads.eagle import EagleHead
from selfspec.model import Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.ranking import ranked_on_device
from selfspec.sampling import SamplingParams, gumbel_top, logits_to_probs
from selfspec.step import CapturedSteps, SlotView, weights_of
from selfspec.tree import Tree


@dataclass(frozen=True)
class StaticShape:
    """A static tree (EAGLE-1; `Tree.chain(k)` for a chain): node (r1, ..., rd) is the
    rd-th candidate of its parent's head output."""

    tree: Tree

    @property
    def depth(self) -> int:
        return self.tree.max_depth

    @property
    def width(self) -> int:
        """The most children a node has."""
        return self.tree.max_children

    @property
    def nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def fed(self) -> int:
        """The draft nodes the head runs on in a step: those with children."""
        return sum(1 for i in range(self.nodes) if self.tree.children_of(i))

    def growth(self, device: torch.device, sampled: bool) -> _StaticGrowth:
        """Its growth in static shapes."""
        return _StaticGrowth(self.tree, device)


@dataclass(frozen=True)
class DynamicShape:
    """An EAGLE-2 dynamic tree: a frontier of the `top_k` best nodes grown `depth` levels,
    `total_tokens` nodes kept (see `level_plan`)."""

    total_tokens: int
    depth: int
    top_k: int

    @property
    def width(self) -> int:
        """The most children a node has."""
        return self.top_k

    @property
    def nodes(self) -> int:
        """The most nodes a draft keeps."""
        return min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2)

    @property
    def fed(self) -> int:
        """The most draft nodes the head runs on in a step: each level's frontier."""
        return (self.depth - 1) * self.top_k

    def growth(self, device: torch.device, sampled: bool) -> _DynamicGrowth:
        """Its growth in static shapes."""
        return _DynamicGrowth(self, device, sampled)


EagleShape = StaticShape | DynamicShape


class StaticEagleDraft:
    """One EAGLE drafter's static drafting for one target, head cache and graphs included:
    `consume(tokens, feature, start)` feeds the committed pairs, `grow()` drafts."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, head: EagleHead, target: Transformer, shape: EagleShape,
                 max_slots: int, sampling: SamplingParams | None = None) -> None:
        self.head, self.target, self.shape, self.sampling = head, target, shape, sampling
        self.weights = weights_of(head, target)
        weight = head.fc.weight
        self.device = weight.device
        # Sampled children draw from the steps' own generator, the caller's stream carried
        # through it (`CapturedSteps`), as the host growth draws from the caller's.
        self._steps = CapturedSteps(self.device, draws=sampling is not None)
        self.children = _Children(sampling, self._steps.generator)
        config = head.config
        self.cache = KVCache(1, 1, config.num_kv_heads, max_slots, config.head_dim,
                             dtype=weight.dtype, device=weight.device,
                             value_dim=getattr(config, "value_dim", None))  # an MTP head's
        self.growth = shape.growth(self.device, sampling is not None)
        self.width = shape.depth + 1  # the most pairs one step commits
        self._slots = torch.arange(max_slots, device=self.device)
        self._tokens = torch.zeros(self.width, dtype=torch.long, device=self.device)
        self._feature = torch.zeros(self.width, config.hidden_size, dtype=weight.dtype,
                                    device=self.device)
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)  # committed before
        self._count = torch.ones(1, dtype=torch.long, device=self.device)  # pairs fed now
        # The head's prediction after the last committed pair: the draft's root.
        self.root = torch.zeros(config.hidden_size, dtype=weight.dtype, device=self.device)

    def fits(self, head: EagleHead, target: Transformer, shape: EagleShape, max_slots: int,
             sampling: SamplingParams | None) -> bool:
        return (head is self.head and target is self.target and shape == self.shape
                and sampling == self.sampling and self.cache.max_slots >= max_slots
                and weights_of(head, target) == self.weights)

    # ---- the committed pairs --------------------------------------------------------------

    def consume(self, tokens: torch.Tensor, feature: torch.Tensor, start: int) -> None:
        """Feed the pairs (feature [A, h], token [A]) committed at positions start.. into the
        head's cache; the head's prediction after the last becomes the root's."""
        count = tokens.shape[0]
        if count > self.width:  # the prompt, after the prefill: once, eagerly
            positions = torch.arange(start, start + count, device=self.device)
            embeds = self.target.embed_tokens(tokens)[None].to(self._feature)
            self.cache.length = start
            out = self.head(embeds, feature[None].to(self._feature), positions, self.cache)
            self.root.copy_(out[0, -1])
            return
        self._tokens[:count].copy_(tokens)
        self._feature[:count].copy_(feature)
        self._start.fill_(start)
        self._count.fill_(count)
        self._steps.run("consume", self._consume)

    def _consume(self) -> torch.Tensor:
        rows = torch.arange(self.width, device=self.device)
        slots = self._start + rows  # [W]; rows past count write slots the draft rewrites
        mask = self._slots[None] <= slots[:, None]  # [W, S]: the committed past, causally
        embeds = self.target.embed_tokens(self._tokens)[None].to(self._feature)
        out = self.head(embeds, self._feature[None], slots, SlotView(self.cache, slots),
                        mask=mask)[0]  # [W, h]
        self.root.copy_(out.index_select(0, self._count - 1)[0])
        return self.root

    # ---- the draft ------------------------------------------------------------------------

    def grow(self, committed: int, generator: torch.Generator | None = None) -> _Grown:
        """The draft after `committed` cached pairs (a captured step's outputs: the next
        step rewrites them); sampled children draw from `generator`'s stream."""
        self._start.fill_(committed)
        return self._steps.run("grow", lambda: self.growth.run(self, self.children),
                               generator if self.sampling is not None else None)

    def feed(self, tokens: torch.Tensor, feature: torch.Tensor, depth: int,
             offsets: torch.Tensor, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over n draft nodes at one depth: tokens [n] reading feature [n, h] (their
        parents' predictions), written at draft slots `offsets` [n] after the committed pairs,
        each attending to the committed pairs and to the draft slots `ancestors` [n, F] marks
        (its own included). Returns their predicted features [n, h] and target logits [n, V]."""
        committed = self._start
        slots = committed + offsets  # [n]
        draft = committed + torch.arange(ancestors.shape[1], device=self.device)  # [F]
        mask = (self._slots < committed)[None].repeat(len(offsets), 1)  # [n, S]
        mask.scatter_(1, draft[None].expand_as(ancestors), ancestors)
        positions = (committed - 1 + depth).expand(len(offsets))
        embeds = self.target.embed_tokens(tokens)[None].to(self._feature)
        out = self.head(embeds, feature[None], positions, SlotView(self.cache, slots),
                        mask=mask)[0]
        return out, self.head.target_logits(out, self.target.lm_head)

    def root_logits(self) -> torch.Tensor:
        """[1, V] the head's scores after the root."""
        return self.head.target_logits(self.root, self.target.lm_head)[None]


class _Children:
    """How a parent's children are picked: its top tokens (`law` None: chosen), or distinct
    draws from its warped law by Gumbel-top-k (`gumbel_top`, the host growth's draws)."""

    def __init__(self, sampling: SamplingParams | None, generator: torch.Generator | None
                 ) -> None:
        self.sampling, self.generator = sampling, generator

    @property
    def sampled(self) -> bool:
        return self.sampling is not None

    def pick(self, logits: torch.Tensor, count: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For each row of logits [R, V]: `count` children as tokens [R, count], their
        log-probabilities [R, count] (float64, as the host growth sums them), whether each
        was drawn [R, count] (a law with fewer positive tokens runs out), and the laws [R, V]
        they were drawn from (None when chosen)."""
        if not self.sampled:
            tokens = ranked_on_device(logits, count)
            log_probs = torch.log_softmax(logits, dim=-1).gather(1, tokens).double()
            return tokens, log_probs, torch.ones_like(tokens, dtype=torch.bool), None
        laws = logits_to_probs(logits, self.sampling, static=True)  # [R, V]
        tokens, drawn = gumbel_top(laws, count, self.generator)
        return tokens, laws.gather(1, tokens).double().log(), drawn, laws


class _StaticGrowth:
    """A fixed tree: depth by depth, the parents of the next depth are fed, and node
    (r1, ..., rd) takes the rd-th token of its parent's ranking, or its rd-th draw."""

    def __init__(self, tree: Tree, device: torch.device) -> None:
        self.tree, self.max_depth = tree, tree.max_depth
        self.parents = tree.parents_on(device)  # for a sampled draft's DeviceTree
        self.ranks = max((c[-1] for c in tree.choices), default=0) + 1
        fed = [i for i in range(tree.num_nodes) if tree.children_of(i)]
        slot = {node: i for i, node in enumerate(fed)}  # draft slot of each fed node
        self.levels, previous = [], [-1]  # the previous depth's fed nodes (the root's: -1)
        for depth in range(1, tree.max_depth + 1):
            nodes = [i for i in range(tree.num_nodes) if len(tree.choices[i]) == depth]
            parents = [tree.parents[i] for i in nodes]
            feeding = [i for i in nodes if i in slot]
            ancestors = torch.zeros(len(feeding), len(fed), dtype=torch.bool)
            for row, node in enumerate(feeding):
                ancestors[row, [slot[i] for i in tree.path_to(node)]] = True
            self.levels.append(_Level(
                nodes=_long(nodes, device),
                source=_long([previous.index(p) for p in parents], device),
                rank=_long([tree.choices[i][-1] for i in nodes], device),
                feeding=_long([nodes.index(i) for i in feeding], device),
                offsets=_long([slot[i] for i in feeding], device),
                ancestors=ancestors.to(device)))
            previous = feeding

    def run(self, draft: StaticEagleDraft, children: _Children) -> _Grown:
        n, device = self.tree.num_nodes, draft.device
        tokens = torch.zeros(n, dtype=torch.long, device=device)
        drawn = torch.ones(n, dtype=torch.bool, device=device)
        laws = [] if children.sampled else None
        logits, hidden = draft.root_logits(), draft.root[None]  # the fed parents' outputs
        fed_drawn = drawn[:1]  # whether each fed parent was drawn (the root was)
        for depth, level in enumerate(self.levels, start=1):
            ranked, _, ok, law = children.pick(logits, self.ranks)  # [parents, ranks]
            level_tokens = ranked[level.source, level.rank]  # [nodes]
            level_drawn = ok[level.source, level.rank] & fed_drawn[level.source]
            tokens.index_copy_(0, level.nodes, level_tokens)
            drawn.index_copy_(0, level.nodes, level_drawn)
            if laws is not None:
                laws.append((level.nodes, law[level.source]))
            if depth < self.max_depth:
                hidden, logits = draft.feed(level_tokens[level.feeding],
                                            hidden[level.source[level.feeding]], depth,
                                            level.offsets, level.ancestors)
                fed_drawn = level_drawn[level.feeding]
        q = None
        if laws is not None:
            q = torch.empty(n, laws[0][1].shape[-1], device=device)
            for nodes, rows in laws:
                q.index_copy_(0, nodes, rows)
        if not children.sampled:
            return _Grown(tokens)
        return _Grown(tokens, self.parents, drawn, q)


@dataclass(frozen=True)
class _Level:
    """One depth of a static tree, as index tensors: its nodes [n], each one's parent among
    the previous depth's fed nodes (source [n]) and rank [n], which of them are fed
    (feeding [f], indices into nodes), at which draft slots (offsets [f]), and what the fed
    ones see (ancestors [f, F]: the draft slots of their paths)."""

    nodes: torch.Tensor
    source: torch.Tensor
    rank: torch.Tensor
    feeding: torch.Tensor
    offsets: torch.Tensor
    ancestors: torch.Tensor


@dataclass
class _Grown:
    """A static draft: tokens [N]; parents [N] (None: chosen children of a static tree, whose
    `Tree` is the draft's); drawn [N] (None: every node; else False for a node its law could
    not supply, and below it); q [N, V]: the law each node was drawn from (None: chosen)."""

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    drawn: torch.Tensor | None = None
    q: torch.Tensor | None = None


@dataclass
class _Made:
    """One EAGLE-2 level's children, in creation order: tokens, parents (pool indices),
    alive (drawn, and every ancestor too), cumulative scores and, sampled, their laws."""

    tokens: torch.Tensor
    parents: torch.Tensor
    alive: torch.Tensor
    scores: torch.Tensor
    law: torch.Tensor | None


class _DynamicGrowth:
    """EAGLE-2: a top_k frontier grown `depth` levels. Chosen children: every frontier node
    gets top_k and the pool's best `total_tokens` are kept. Sampled children: the budget is
    spent while growing (frontier nodes by score, top_k children each, until it runs out),
    and every node is kept."""

    def __init__(self, shape: DynamicShape, device: torch.device, sampled: bool) -> None:
        self.total_tokens, self.top_k = shape.total_tokens, shape.top_k
        self.levels = level_plan(shape.total_tokens, shape.depth, shape.top_k, sampled)
        # Each level's children as (frontier row, rank) index tensors, made here: a captured
        # step may not copy from the host.
        self.index = [(_long([j for j, c in enumerate(counts) for _ in range(c)], device),
                       _long([r for c in counts for r in range(c)], device))
                      for counts in self.levels]

    def run(self, draft: StaticEagleDraft, children: _Children) -> _Grown:
        device, levels = draft.device, self.levels
        fed = sum(min(self.top_k, sum(level)) for level in levels[:-1])  # draft slots
        logits, hidden = draft.root_logits(), draft.root[None]  # [1, V], [1, h]
        scores = torch.zeros(1, dtype=torch.float64, device=device)
        frontier = torch.full((1,), -1, dtype=torch.long, device=device)  # pool indices
        alive = torch.ones(1, dtype=torch.bool, device=device)  # drawn, and their ancestors
        ancestors = torch.zeros(1, fed, dtype=torch.bool, device=device)
        pool, size, offset = [], 0, 0
        tokens = feature = None  # the frontier's tokens and features, from depth 2 on
        for depth, counts in enumerate(levels, start=1):
            if depth > 1:  # feed the frontier: its nodes' features predict their children
                width = len(frontier)
                own = torch.arange(width, device=device) + offset
                ancestors = ancestors.clone().scatter_(1, own[:, None], True)
                hidden, logits = draft.feed(tokens, feature, depth - 1, own, ancestors)
                offset += width
            rows = sum(1 for c in counts if c)  # the frontier nodes that get children
            picked, log_probs, drawn, laws = children.pick(logits[:rows], max(counts))
            row, rank = self.index[depth - 1]
            made = drawn[row, rank] & alive[row]
            level = _Made(picked[row, rank], frontier[row], made,
                          torch.where(made, scores[row] + log_probs[row, rank], -torch.inf),
                          None if laws is None else laws[row])
            pool.append(level)
            best = torch.sort(level.scores, descending=True, stable=True).indices
            best = best[:min(self.top_k, len(row))]
            tokens, scores, alive = level.tokens[best], level.scores[best], level.alive[best]
            frontier, feature, ancestors = size + best, hidden[row[best]], ancestors[row[best]]
            size += len(row)
        return _kept(pool, None if children.sampled else self.total_tokens)


def level_plan(total_tokens: int, depth: int, top_k: int, sampled: bool) -> list[list[int]]:
    """EAGLE-2's levels as planned from its shape alone: per level, the children each
    frontier position gets, best first. Chosen: top_k each, the pool cut afterwards. Sampled:
    the `total_tokens` budget spent while growing, as if every law supplied every child asked
    for; a child its law cannot supply is missing, and its budget is not spent again. The
    host growth (`EagleDrafter`) follows the same plan."""
    levels = [[min(top_k, total_tokens) if sampled else top_k]]
    made = levels[0][0]
    for _ in range(1, depth):
        width = min(top_k, sum(levels[-1]))
        if not sampled:
            levels.append([top_k] * width)
            continue
        level = [max(0, min(top_k, total_tokens - made - j * top_k)) for j in range(width)]
        if not any(level):
            break
        levels.append(level)
        made += sum(level)
    return levels


def _kept(pool: list[_Made], count: int | None) -> _Grown:
    """The pool's best `count` nodes by score (ties: first made first), in creation order:
    their tokens and parents among them; None: every node (sampled), drawn and laws too."""
    tokens, scores, parents, alive = (torch.cat([getattr(level, name) for level in pool])
                                      for name in ("tokens", "scores", "parents", "alive"))
    if count is None:  # pool indices are node indices
        return _Grown(tokens, parents, alive, torch.cat([level.law for level in pool]))
    keep = torch.sort(torch.sort(scores, descending=True, stable=True).indices[:count]).values
    index = torch.full_like(parents, -1)
    index[keep] = torch.arange(len(keep), device=keep.device)
    kept_parents = parents[keep]
    return _Grown(tokens[keep],
                  torch.where(kept_parents >= 0, index[kept_parents.clamp(min=0)], -1))


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
