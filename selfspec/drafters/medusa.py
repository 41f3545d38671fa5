"""Medusa drafting: a static tree of top-ranked candidates from the Medusa heads.

Every head reads the target's last committed hidden state once; the node with choices path
(r1, ..., rd) gets the r_d-th most likely token of head d-1. Candidates are chosen, not
sampled (q=None), so the shared verifier keeps the target's law exactly at every temperature.
Medusa's lossy "typical acceptance" is deliberately not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
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
        self.tree = tree if isinstance(tree, Tree) else Tree.from_paths(tree)
        self.max_nodes = self.tree.num_nodes
        _check_tree(self.tree, heads)
        self._head_of = self.tree.depth - 1  # [N] which head ranks each node
        self._rank_of = torch.tensor([c[-1] for c in self.tree.choices], dtype=torch.long)  # [N]

    def begin(self, setup: DecodeSetup) -> None:
        target, ours = setup.target.config, self.heads.config
        for key in ("hidden_size", "vocab_size"):
            if getattr(target, key) != getattr(ours, key):
                raise ValueError(
                    f"MedusaDrafter: the heads have {key} {getattr(ours, key)}, the target "
                    f"{getattr(target, key)}: load heads trained for this target"
                )

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None or self.tree.num_nodes == 0:
            return Draft.empty()  # no hidden state yet (one-token prompt before any forward)
        hidden = context.features.last_hidden[-1]  # [H] the state that produced the root
        weight = next(self.heads.parameters())
        logits = self.heads(hidden.to(device=weight.device, dtype=weight.dtype))  # [K, V]
        # Stable: equal logits rank by token id, the same rule as logits_to_probs' cut-offs.
        ranked = torch.sort(logits[: self.tree.max_depth], dim=-1, descending=True, stable=True)
        ranked = ranked.indices  # [depth, V] token ids, most likely first
        tokens = ranked[self._head_of.to(ranked.device), self._rank_of.to(ranked.device)]  # [N]
        return Draft(self.tree, tokens.to(hidden.device))


def _check_tree(tree: Tree, heads: MedusaHeads) -> None:
    config = heads.config
    if tree.max_depth > config.num_heads:
        raise ValueError(
            f"MedusaDrafter: the tree is {tree.max_depth} deep but there are only "
            f"{config.num_heads} Medusa heads (depth d uses head d-1); use a tree of depth "
            f"<= {config.num_heads} or heads with num_heads >= {tree.max_depth}"
        )
    worst = max((c[-1] for c in tree.choices), default=0)
    if worst >= config.vocab_size:
        raise ValueError(
            f"MedusaDrafter: the tree asks for candidate rank {worst}, but the vocabulary has "
            f"only {config.vocab_size} tokens; use ranks < {config.vocab_size}"
        )
