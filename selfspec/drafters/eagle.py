"""EAGLE drafting over an EAGLE-1 or EAGLE-3 head: static trees and chains (EAGLE-1) or a
dynamic tree per step (EAGLE-2), in one drafter.

The head keeps a KV cache of its own over the committed context: position t holds the pair
(the target's feature f_t, token t+1). Each step it consumes only the pairs the target's last
forward committed (`DraftContext.features`, from the verification forward of the accepted
path: no extra target pass); its output at the last pair predicts the feature after the root.
A draft node at depth d then reads (its parent's predicted feature, its token) at position
root + d - 1, attending to the committed context and to its own ancestors; the draft's slots
are dropped again before the target verifies.

- Static tree (`tree=`: a `Tree` or Medusa-style choices; `Tree.chain(k)` for a chain): node
  (r1, ..., rd) gets the rd-th candidate of its parent's head output.
- Dynamic tree (`total_tokens`, `depth`, `top_k`; EAGLE-2): the root's top_k children form
  the frontier; each further step runs the head on the frontier, scores its top_k children
  each by cumulative log-probability and keeps the best top_k of them as the next frontier,
  until the tree is `depth` deep. Every node made is then pooled and the `total_tokens` best
  by score are kept: a parent never scores below its child and comes first, so the kept set
  is prefix-closed and in topological order.

Children are chosen deterministically (top-k, q=None) at greedy decoding, and drawn without
replacement from the head's warped law (q passed on) when sampling, which accepts more there
(tiny target, T=1: tau 1.76 against 1.15 for chosen children); `sampled_children=False` chooses
them at every temperature, which the shared verifier keeps exact too.
The verifier is exact for sampled children only if how many children a node gets is decided
before they are drawn: so in that mode a dynamic tree spends its `total_tokens` budget while
it grows (frontier nodes by score, top_k children each, until the budget runs out) instead of
pooling and cutting afterwards, which would keep or drop a drawn token by its own probability.
Children are drawn by Gumbel-top-k (`sampling.gumbel_top`), one row of uniforms per parent.

Where the target runs static steps, the same trees grow in static shapes on the device
(`selfspec.drafters.eagle_static`), and this module's host-side growth is the reference its
tests compare them with. So that the two build the same trees, the host grows the levels
the static draft plans from the shape alone (`level_plan`): a child that a law cannot supply
(a top-k or top-p cut, or an underflow) is missing with its subtree, and its budget is not
spent elsewhere. Each level's children are drawn from one block of uniforms, a row per
planned parent, as the static draft draws them.

`draft_vocab` (EAGLE-1 heads): the head's features go through only the K rows of the target's
LM head that a draft vocabulary keeps (the head's K most frequent training tokens), -inf
elsewhere, as EAGLE-3's own LM head scores its draft vocabulary: a cheaper draft whose tokens
outside the vocabulary are never proposed. It drafts on the host path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from selfspec.checks import is_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.eagle_static import (
    DynamicShape,
    EagleShape,
    StaticEagleDraft,
    StaticShape,
    level_plan,
)
from selfspec.heads.draft_vocab import DraftVocab, check_vocab_covers
from selfspec.heads.eagle import EagleHead
from selfspec.heads.io import check_fused_target
from selfspec.model import Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.ranking import ranked
from selfspec.sampling import gumbel_top, logits_to_probs
from selfspec.step import padded_slots
from selfspec.tree import DeviceTree, Tree


@dataclass
class _Node:
    token: int  # target vocabulary id
    parent: int  # node index, -1 = the root
    depth: int  # 1 for the root's children
    score: float  # cumulative log-probability of its path under the head
    law: int = -1  # index into _Growth.laws it was drawn from; -1 = chosen deterministically


@dataclass
class _Growth:
    """One draft in the making: its nodes, the laws sampled children were drawn from, and the
    head's outputs (predicted feature [h], logits [V]) at the root (-1) and the fed nodes."""

    hidden: dict[int, torch.Tensor]
    logits: dict[int, torch.Tensor]
    nodes: list[_Node] = field(default_factory=list)
    laws: list[torch.Tensor] = field(default_factory=list)
    slot: dict[int, int] = field(default_factory=dict)  # fed node -> head cache slot

    def add(self, token: int, parent: int, score: float, law: int) -> int:
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes.append(_Node(token, parent, depth, score, law))
        return len(self.nodes) - 1

    def best(self, candidates: Sequence[int], count: int) -> list[int]:
        """The `count` best nodes by score, ties by index (parents before children)."""
        return sorted(candidates, key=lambda i: (-self.nodes[i].score, i))[:count]


class EagleDrafter:
    """Drafts with an EAGLE head over a static tree (`tree`) or an EAGLE-2 dynamic tree
    (`total_tokens`, `depth`, `top_k`); see the module docstring. `shape` holds which: a
    `StaticShape` or a `DynamicShape`.

    depth counts tree levels: the deepest node is `depth` tokens after the root, and the head
    runs `depth` times per step (once over the newly committed pairs, then per level).
    """

    def __init__(
        self,
        head: EagleHead,
        tree: Tree | Sequence[Sequence[int]] | None = None,
        *,
        total_tokens: int | None = None,
        depth: int | None = None,
        top_k: int | None = None,
        sampled_children: bool = True,
        draft_vocab: DraftVocab | None = None,
    ) -> None:
        if draft_vocab is not None and head.config.version != 1:
            raise ValueError("EagleDrafter: draft_vocab restricts an EAGLE-1 head to rows of the "
                             "target's LM head; an EAGLE-3 head scores its own draft vocabulary")
        self.head, self.sampled_children = head, bool(sampled_children)
        self.draft_vocab, self._rows = draft_vocab, None
        self.target_layers: tuple[int, ...] = tuple(head.config.target_layers)
        self.shape: EagleShape = (_static_shape(head, tree, (total_tokens, depth, top_k))
                                  if tree is not None
                                  else _dynamic_shape(head, total_tokens, depth, top_k))
        self.max_nodes = self.shape.nodes
        self._cache: KVCache | None = None
        self._committed = 0  # head cache slots holding committed pairs
        self._static: StaticEagleDraft | None = None  # drafting in static shapes, kept
        self._use_static = False

    def begin(self, setup: DecodeSetup) -> None:
        check_fused_target("EagleDrafter", self.head.config, setup.target)
        self._target, self._generator = setup.target, setup.generator
        self._sampling = setup.sampling
        self._sampled = self.sampled_children and not setup.sampling.greedy
        self._committed = 0
        # where the target runs static steps (a draft vocabulary drafts eagerly)
        self._use_static = setup.static_steps and self.draft_vocab is None
        if self.draft_vocab is not None:
            weight = self.head.fc.weight
            self._rows = vocab_rows(setup.target, self.draft_vocab).to(weight)
            self.draft_vocab = self.draft_vocab.to(weight.device)
        if self._use_static:
            self._begin_static(setup)
            return
        config = self.head.config
        self._cache = KVCache.reused(self._cache, 1, config.num_kv_heads,
                                     setup.max_length + self.shape.fed, config.head_dim,
                                     self.head.fc.weight,
                                     getattr(config, "value_dim", None))  # an MTP head's

    def _begin_static(self, setup: DecodeSetup) -> None:
        slots = padded_slots(setup.max_length + self.shape.fed)
        sampling = setup.sampling if self._sampled else None
        if self._static is None or not self._static.fits(self.head, setup.target, self.shape,
                                                          slots, sampling):
            self._static = StaticEagleDraft(self.head, setup.target, self.shape, slots,
                                            sampling)

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None:
            return Draft.empty()  # no target features yet (one-token prompt, first step)
        if self._use_static:
            return self._propose_static(context)
        hidden, logits = self._consume(context)
        growth = _Growth(hidden={-1: hidden}, logits={-1: logits})
        if isinstance(self.shape, StaticShape):
            keep = self._grow_static(growth, self.shape.tree)
        else:
            keep = self._grow_dynamic(growth, self.shape)
        self._cache.truncate(self._committed)  # drop the draft's own slots
        return self._draft(growth, keep)

    def _propose_static(self, context: DraftContext) -> Draft:
        """The same draft, in static shapes on the device (`selfspec.drafters.eagle_static`)."""
        start, tokens, feature = committed_pairs(self.head, context, self._committed,
                                                 "EagleDrafter")
        self._static.consume(tokens, feature, start)
        self._committed = start + len(tokens)
        # A captured step's outputs, copied: the next step rewrites them.
        grown = self._static.grow(self._committed, self._generator)
        tokens = grown.tokens.clone()
        if grown.parents is None:  # chosen children of the static tree
            return Draft(self.shape.tree, tokens)
        drawn = None if grown.drawn is None else grown.drawn.clone()
        tree = DeviceTree(grown.parents.clone(), self.shape.depth, drawn, self.shape.width)
        if grown.q is None:
            return Draft(tree, tokens)
        return Draft(tree, tokens, grown.q.clone(), without_replacement=True)

    # ---- the committed context ----------------------------------------------------------------

    def _consume(self, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pairs the target just committed; returns the head's predicted feature [h]
        and logits [V] after the root."""
        start, tokens, feature = committed_pairs(self.head, context, self._committed,
                                                 "EagleDrafter")
        count, weight = len(tokens), self.head.fc.weight
        positions = torch.arange(start, start + count, device=weight.device)
        embeds = self._target.embed_tokens(tokens)[None].to(weight)  # [1, A, h]
        out = self.head(embeds, feature[None], positions, self._cache)[0]  # [A, h]
        self._committed = self._cache.length
        return out[-1], self._scores(out[-1])

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., V] the head's scores over the target vocabulary; with a draft vocabulary only
        its K rows of the target's LM head are computed (-inf elsewhere)."""
        if self._rows is None:
            return self.head.target_logits(hidden, self._target.lm_head)
        return self.draft_vocab.scatter(F.linear(hidden, self._rows).float())

    # ---- growing a tree ------------------------------------------------------------------------

    def _grow_static(self, growth: _Growth, tree: Tree) -> list[int]:
        """Fill the static tree level by level; returns the nodes made (all kept). A sampled
        node whose rank its parent's law cannot supply is missing, with its subtree."""
        made = {-1: -1}  # tree node -> growth node
        for depth in range(1, tree.max_depth + 1):
            planned = [-1] if depth == 1 else [  # the nodes above that have children
                i for i in range(tree.num_nodes)
                if len(tree.choices[i]) == depth - 1 and tree.children_of(i)]
            counts = [max(tree.choices[c][-1] for c in tree.children_of(p)) + 1
                      for p in planned]
            found = self._level_children(growth, [made.get(p) for p in planned], counts)
            for parent, children in zip(planned, found, strict=True):
                for kid in tree.children_of(parent):
                    if (rank := tree.choices[kid][-1]) < len(children):
                        made[kid] = growth.add(*_scored(growth, made[parent], children[rank]))
            level = [made[i] for i in range(tree.num_nodes) if i in made
                     and len(tree.choices[i]) == depth and tree.children_of(i)]
            if level and depth < tree.max_depth:
                self._feed(growth, level)
        return list(range(len(growth.nodes)))

    def _grow_dynamic(self, growth: _Growth, shape: DynamicShape) -> list[int]:
        """EAGLE-2: grow the levels of `level_plan` from a top_k frontier; returns the nodes
        kept."""
        frontier: list[int] = [-1]
        plan = level_plan(shape.total_tokens, shape.depth, shape.top_k, self._sampled)
        for depth, counts in enumerate(plan, start=1):
            if depth > 1:
                self._feed(growth, frontier)
            counts = [c for c in counts if c]
            # A frontier shorter than planned (a law supplied fewer children) leaves gaps.
            planned = [*frontier, *[None] * (len(counts) - len(frontier))][: len(counts)]
            found = self._level_children(growth, planned, counts)
            level = [growth.add(*_scored(growth, parent, child))
                     for parent, children in zip(planned, found, strict=True)
                     for child in children]
            frontier = growth.best(level, shape.top_k)
            if not frontier:
                break
        if self._sampled:
            return list(range(len(growth.nodes)))
        return sorted(growth.best(range(len(growth.nodes)), shape.total_tokens))

    def _level_children(self, growth: _Growth, parents: list[int | None], counts: list[int]
                        ) -> list[list[tuple[int, float, int]]]:
        """Up to counts[j] children of each of a level's planned parents, as (token,
        log-probability, law index): the head's top tokens (law -1), or tokens drawn without
        replacement from its warped law. A planned parent that is missing (None) gets none;
        sampled, it still takes its row of the level's uniforms, drawn as one block
        (`gumbel_top`), as the static draft draws them, so that the two draw alike."""
        if not self._sampled:
            return [[] if parent is None else self._chosen(growth, parent, count)
                    for parent, count in zip(parents, counts, strict=True)]
        laws = [None if parent is None else logits_to_probs(growth.logits[parent],
                                                             self._sampling)
                for parent in parents]
        filler = torch.ones_like(growth.logits[-1])  # a missing parent's row, drawn and dropped
        tokens, drawn = gumbel_top(torch.stack([filler if law is None else law for law in laws]),
                                   max(counts), self._generator)
        found = []
        for row, (law, count) in enumerate(zip(laws, counts, strict=True)):
            if law is None:
                found.append([])
                continue
            growth.laws.append(law)
            picked = tokens[row, :count][drawn[row, :count]].tolist()
            log_probs = law[picked].double().log().tolist()
            found.append([(t, lp, len(growth.laws) - 1)
                          for t, lp in zip(picked, log_probs, strict=True)])
        return found

    def _chosen(self, growth: _Growth, parent: int, count: int) -> list[tuple[int, float, int]]:
        """The head's `count` top tokens after `parent`, with their log-probabilities."""
        logits = growth.logits[parent]  # [V]
        ids = ranked(logits[None], count)[0]  # [count]
        log_probs = torch.log_softmax(logits, dim=-1)[ids]
        return [(t, lp, -1) for t, lp in zip(ids.tolist(), log_probs.tolist(), strict=True)]

    def _feed(self, growth: _Growth, nodes: list[int]) -> None:
        """Run the head on `nodes` (each reading its parent's predicted feature) in one pass,
        each attending to the committed context and its own ancestors; keeps their outputs."""
        weight, past = self.head.fc.weight, self._cache.length
        picked = [growth.nodes[i] for i in nodes]
        tokens = torch.tensor([n.token for n in picked], device=weight.device)  # [n]
        feature = torch.stack([growth.hidden[n.parent] for n in picked])[None]  # [1, n, h]
        positions = torch.tensor([self._committed - 1 + n.depth for n in picked],
                                 device=weight.device)
        embeds = self._target.embed_tokens(tokens)[None].to(weight)  # [1, n, h]
        mask = self._tree_mask(growth, nodes, past)
        out = self.head(embeds, feature, positions, self._cache, mask=mask)[0]  # [n, h]
        logits = self._scores(out)  # [n, V]
        for row, node in enumerate(nodes):
            growth.slot[node] = past + row
            growth.hidden[node], growth.logits[node] = out[row], logits[row]

    def _tree_mask(self, growth: _Growth, nodes: list[int], past: int) -> torch.Tensor:
        """[n, past + n] bool: the committed slots, each node's ancestors' slots, itself."""
        mask = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool)
        mask[:, : self._committed] = True
        for row, node in enumerate(nodes):
            mask[row, past + row] = True
            parent = growth.nodes[node].parent
            while parent >= 0:
                mask[row, growth.slot[parent]] = True
                parent = growth.nodes[parent].parent
        return mask.to(self.head.fc.weight.device)

    def _draft(self, growth: _Growth, keep: list[int]) -> Draft:
        """The kept nodes (increasing indices: topological) as a Draft."""
        index = {node: i for i, node in enumerate(keep)}
        index[-1] = -1
        nodes = [growth.nodes[i] for i in keep]
        device = self.head.fc.weight.device
        tokens = torch.tensor([n.token for n in nodes], dtype=torch.long, device=device)
        tree = Tree.from_parents([index[n.parent] for n in nodes])
        if not self._sampled or not nodes:
            return Draft(tree, tokens)
        q = torch.stack([growth.laws[n.law] for n in nodes])  # [N, V]
        return Draft(tree, tokens, q, without_replacement=True)


def vocab_rows(target: Transformer, vocab: DraftVocab) -> torch.Tensor:
    """[K, h] the target's LM-head rows of a draft vocabulary (a quantized head dequantized:
    only drafts read them)."""
    check_vocab_covers(vocab, target.config.vocab_size)
    head = target.lm_head
    weight = head.dense_weight() if hasattr(head, "dense_weight") else head.weight
    return weight[vocab.to(weight.device).target_ids].detach()


def committed_pairs(head: EagleHead, context: DraftContext, committed: int, name: str
                    ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The pairs the target just committed: their first position, tokens t+1 [A] and the
    head's features f_t [A, h]. committed: the positions the drafter's cache holds, which must
    be where they start."""
    features, length = context.features, len(context.tokens)
    count = len(features.tokens)
    start = length - 1 - count  # the history position of the first committed row
    if start != committed:
        raise RuntimeError(
            f"{name}: its cache holds {committed} positions but the target's features start at "
            f"position {start}: call begin() before each generation and pass every step's "
            f"features")
    weight = head.fc.weight
    tokens = context.tokens[length - count:].to(weight.device)  # [A] tokens t+1
    feature = head.target_feature(features.last_hidden, features.hidden).to(weight)
    return start, tokens, feature


def _scored(growth: _Growth, parent: int, child: tuple[int, float, int]
            ) -> tuple[int, int, float, int]:
    """(token, parent, cumulative score, law) for _Growth.add."""
    token, log_prob, law = child
    base = 0.0 if parent < 0 else growth.nodes[parent].score
    return token, parent, base + log_prob, law


# ---- checks (all before any generation) ----------------------------------------------------


def _static_shape(head: EagleHead, tree: Tree | Sequence[Sequence[int]], dynamic: tuple
                  ) -> StaticShape:
    if any(value is not None for value in dynamic):
        raise ValueError("EagleDrafter: pass either tree (a static tree) or total_tokens, depth "
                         "and top_k (an EAGLE-2 dynamic tree), not both")
    tree = tree if isinstance(tree, Tree) else Tree.from_paths(tree)
    worst, vocab = max((c[-1] for c in tree.choices), default=0), head.config.output_vocab_size
    if worst >= vocab:
        raise ValueError(f"EagleDrafter: the tree asks for candidate rank {worst}, but the head "
                         f"scores only {vocab} tokens; use ranks < {vocab}")
    return StaticShape(tree)


def _dynamic_shape(head: EagleHead, total_tokens, depth, top_k) -> DynamicShape:
    for name, value in (("total_tokens", total_tokens), ("depth", depth), ("top_k", top_k)):
        if not is_count(value):
            raise ValueError(f"EagleDrafter: {name} must be an integer >= 1, got {value!r} "
                             f"(or pass tree= for a static tree)")
    if total_tokens < depth:
        raise ValueError(f"EagleDrafter: total_tokens ({total_tokens}) < depth ({depth}): a "
                         f"tree {depth} deep needs at least {depth} nodes; raise total_tokens "
                         f"or lower depth")
    vocab = head.config.output_vocab_size
    if top_k > vocab:
        raise ValueError(f"EagleDrafter: top_k ({top_k}) exceeds the {vocab} tokens the head "
                         f"scores; pass top_k <= {vocab}")
    return DynamicShape(total_tokens, depth, top_k)
