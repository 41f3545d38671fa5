"""Several deterministic drafters as one: their drafts merged into one tree (a trie of their
root-to-node paths), so a step accepts whichever source guessed right, verified in one
forward. E.g. n-gram lookup (strong where the text repeats itself or the corpus) beside
Medusa heads (a guess at every step)."""

from __future__ import annotations

from collections.abc import Sequence

from selfspec.checks import is_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext, Drafter

Path = tuple[int, ...]  # the tokens from the root down to a node


class UnionDrafter:
    """Proposes the union of `drafters`' drafts: every distinct root-to-node token path of
    any of them, the first drafter's nodes first (in its order), then the next one's new
    ones, up to max_nodes (default: all of them together). The parts must choose their
    tokens (q=None, as n-gram lookup and Medusa do): a merged tree has no single law to
    have sampled from, and the verifier then treats every node as a chosen candidate, which
    keeps the target's law exact at any temperature."""

    def __init__(self, drafters: Sequence[Drafter], max_nodes: int | None = None):
        if len(drafters) < 2:
            raise ValueError(f"UnionDrafter: give at least two drafters to merge, got "
                             f"{len(drafters)}; use the drafter itself otherwise")
        most = sum(d.max_nodes for d in drafters)
        if max_nodes is not None and not is_count(max_nodes):
            raise ValueError(f"UnionDrafter: max_nodes must be an integer >= 1 or None (every "
                             f"node of every part), got {max_nodes!r}")
        self.drafters = tuple(drafters)
        self.max_nodes = most if max_nodes is None else min(max_nodes, most)
        self.target_layers = tuple(sorted({i for d in drafters for i in d.target_layers}))

    def begin(self, setup: DecodeSetup) -> None:
        for drafter in self.drafters:
            drafter.begin(setup)

    def propose(self, context: DraftContext) -> Draft:
        drafts = [drafter.propose(context) for drafter in self.drafters]
        for drafter, draft in zip(self.drafters, drafts, strict=True):
            if draft.q is not None or draft.early is not None:
                raise ValueError(
                    f"UnionDrafter: {type(drafter).__name__} sampled its draft (or ran the "
                    f"target's early layers); only drafters that choose their tokens (n-gram "
                    f"lookup, Medusa, greedy drafts) can be merged")
        device = context.tokens.device
        non_empty = [d for d in drafts if d.tree.num_nodes]
        if len(non_empty) <= 1:  # nothing to merge: pass the one draft through as it is
            only = non_empty[0] if non_empty else Draft.empty()
            return Draft(only.tree, only.tokens.to(device))
        # One host read per part: the trie is built from Python tuples (a few nodes each).
        paths: dict[Path, None] = {}
        for draft in non_empty:
            for path in draft.token_paths():
                if len(paths) == self.max_nodes:
                    break
                paths.setdefault(path)  # a node's parent path was added before it
        return Draft.from_paths(list(paths), device)

