"""EAGLE drafting in static shapes, on the device: what `EagleDrafter` runs when the target
runs static steps (CUDA graphs on CUDA; `cuda_graphs=True` elsewhere runs the same code
eagerly) and children are chosen (greedy decoding, or `sampled_children=False`).

It builds the tree `EagleDrafter`'s host-side growth builds (the same nodes in the same
order), but as tensor ops over fixed widths, reading nothing back to the host:

- the head's cache is written at slot tensors, and each forward attends over every slot
  under a mask built on the device (`selfspec.step.SlotView`);
- the committed pairs are fed padded to one width (the most a step can commit), their
  count a device value; a longer feed (after the prefill) runs eagerly;
- a static tree feeds each level's parents at fixed slots and takes each node's token from
  its parent's ranking (`ranked_on_device`);
- an EAGLE-2 tree feeds a frontier of exactly top_k nodes per level. A level's top_k x top_k
  children are scored in float64 (the host growth sums Python floats), the next frontier is
  the best top_k by a stable sort (ties by creation order), and the pool's best
  `total_tokens` are kept in creation order: a `DeviceTree`, whose parents the decode loop
  reads back with the target's argmax in the step's one host read.

On CUDA the feed of the committed pairs and the growth are captured once each (per drafter
and cache size) and replayed every step.
"""

from __future__ import annotations

import torch

from selfspec.drafters.ranking import ranked_on_device
from selfspec.heads.eagle import EagleHead
from selfspec.kv_cache import KVCache
from selfspec.model import Transformer
from selfspec.step import CapturedSteps, SlotView
from selfspec.tree import Tree


class StaticEagleDraft:
    """One EAGLE drafter's static drafting for one target, head cache and graphs included:
    `consume(tokens, feature, start)` feeds the committed pairs, `grow()` drafts."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, head: EagleHead, target: Transformer, shape: Tree | tuple[int, int, int],
                 max_slots: int) -> None:
        self.head, self.target = head, target
        weight = head.fc.weight
        self.device = weight.device
        config = head.config
        self.cache = KVCache(1, 1, config.num_kv_heads, max_slots, config.head_dim,
                             dtype=weight.dtype, device=weight.device)
        self.growth = (_StaticTree(shape, self.device) if isinstance(shape, Tree)
                       else _DynamicTree(*shape))
        self.width = self.growth.max_depth + 1  # the most pairs one step commits
        self._slots = torch.arange(max_slots, device=self.device)
        self._tokens = torch.zeros(self.width, dtype=torch.long, device=self.device)
        self._feature = torch.zeros(self.width, config.hidden_size, dtype=weight.dtype,
                                    device=self.device)
        self._start = torch.zeros(1, dtype=torch.long, device=self.device)  # committed before
        self._count = torch.ones(1, dtype=torch.long, device=self.device)  # pairs fed now
        self._root = torch.zeros(config.hidden_size, dtype=weight.dtype, device=self.device)
        self._steps = CapturedSteps(self.device)

    def fits(self, head: EagleHead, target: Transformer, shape, max_slots: int) -> bool:
        same = self.growth.shape == (shape if not isinstance(shape, Tree) else shape.parents)
        return (head is self.head and target is self.target and same
                and self.cache.max_slots >= max_slots and head.fc.weight.device == self.device
                and head.fc.weight.dtype == self.cache.k.dtype)

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
            self._root.copy_(out[0, -1])
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
        self._root.copy_(out.index_select(0, self._count - 1)[0])
        return self._root

    # ---- the draft ------------------------------------------------------------------------

    def grow(self, committed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft after `committed` cached pairs: its tokens [N] and, for an EAGLE-2 tree,
        its parents [N] (None: the static tree's)."""
        self._start.fill_(committed)
        return self._steps.run("grow", lambda: self.growth.run(self))

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
        return self.head.target_logits(self._root, self.target.lm_head)[None]


class _StaticTree:
    """A fixed tree: depth by depth, the parents of the next depth are fed, and node
    (r1, ..., rd) takes the rd-th token of its parent's ranking."""

    def __init__(self, tree: Tree, device: torch.device) -> None:
        self.tree, self.shape, self.max_depth = tree, tree.parents, tree.max_depth
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

    def run(self, draft: StaticEagleDraft) -> tuple[torch.Tensor, None]:
        tokens = torch.zeros(self.tree.num_nodes, dtype=torch.long, device=draft.device)
        logits, hidden = draft.root_logits(), draft._root[None]  # the fed parents' outputs
        for depth, level in enumerate(self.levels, start=1):
            ranked = ranked_on_device(logits, self.ranks)  # [parents, ranks]
            level_tokens = ranked[level.source, level.rank]  # [nodes]
            tokens.index_copy_(0, level.nodes, level_tokens)
            if depth < self.max_depth:
                hidden, logits = draft.feed(level_tokens[level.feeding],
                                            hidden[level.source[level.feeding]], depth,
                                            level.offsets, level.ancestors)
        return tokens, None


class _Level:
    """One depth of a static tree, as index tensors: its nodes, each one's parent among the
    previous depth's fed nodes (source) and rank, which of them are fed, at which draft
    slots, and what the fed ones see."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__.update(tensors)


class _DynamicTree:
    """EAGLE-2: a top_k frontier grown `depth` levels, the best `total_tokens` kept."""

    def __init__(self, total_tokens: int, depth: int, top_k: int) -> None:
        self.shape = self.total_tokens, self.max_depth, self.top_k = total_tokens, depth, top_k

    def run(self, draft: StaticEagleDraft) -> tuple[torch.Tensor, torch.Tensor]:
        k, device = self.top_k, draft.device
        fed = (self.max_depth - 1) * k  # draft slots
        logits = draft.root_logits()  # [1, V]
        tokens = ranked_on_device(logits, k)[0]  # [k] level 1, best first
        scores = torch.log_softmax(logits[0], dim=-1)[tokens].double()
        parents = torch.full((k,), -1, dtype=torch.long, device=device)
        pool = [(tokens, scores, parents)]
        frontier = torch.arange(k, device=device)  # pool indices, best first
        feature = draft._root[None].expand(k, -1)  # each frontier node's parent's prediction
        ancestors = torch.zeros(k, fed, dtype=torch.bool, device=device)
        size = k
        for depth in range(1, self.max_depth):
            own = torch.arange(k, device=device) + (depth - 1) * k  # the frontier's slots
            ancestors = ancestors.clone()
            ancestors[torch.arange(k, device=device), own] = True
            hidden, logits = draft.feed(tokens, feature, depth, own, ancestors)  # [k, h], [k, V]
            ids = ranked_on_device(logits, k)  # [k, k]
            child_scores = scores[:, None] + torch.log_softmax(logits, dim=-1).gather(
                1, ids).double()
            tokens, scores = ids.flatten(), child_scores.flatten()  # [k * k], creation order
            pool.append((tokens, scores, frontier[:, None].expand(k, k).flatten()))
            best = torch.sort(scores, descending=True, stable=True).indices[:k]
            tokens, scores, frontier = tokens[best], scores[best], size + best
            feature, ancestors = hidden[best // k], ancestors[best // k]
            size += k * k
        return _kept(pool, self.total_tokens)


def _kept(pool: list[tuple[torch.Tensor, ...]], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's best `count` nodes by score (ties: first made first), in creation order:
    their tokens and parents among them."""
    tokens, scores, parents = (torch.cat(part) for part in zip(*pool, strict=True))
    keep = torch.sort(torch.sort(scores, descending=True, stable=True).indices[:count]).values
    index = torch.full_like(parents, -1)
    index[keep] = torch.arange(len(keep), device=keep.device)
    kept_parents = parents[keep]
    return tokens[keep], torch.where(kept_parents >= 0, index[kept_parents.clamp(min=0)], -1)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
