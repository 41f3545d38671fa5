"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): match the longest suffix of the context
in suffix trees over this generation's own tokens and over a store of the target's earlier
answers, and draft the continuation the matched occurrences followed most often, scored by
frequency, as a chain or a best-first tree whose size grows with the match length.

The trees are represented by the occurrences they count: a node of the suffix tree (a token
path P of at most `max_depth` tokens) counts the places where P occurs in the indexed
sequences, and its children are the tokens that followed them. Sibling order is the one a
suffix tree kept up to date token by token has: more occurrences first; between equal counts,
the child that reached its count last comes first, and among children seen once the first
seen comes first. A token's estimated probability is its path's count over the matched
suffix's count (the matched suffix's occurrences at the end of a sequence count too)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext

SMALL = 48  # occurrences up to which children are grouped in plain Python


class SuffixIndex:
    """Token sequences, each growing at its end, held as one array of slots in the order the
    tokens were appended (a slot's index is its time), each linked to the previous and next
    slot of its sequence: what suffix trees of depth `max_depth` over them count, with every
    lookup a vectorised pass over the occurrences."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"SuffixIndex: max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.clear()

    def clear(self) -> None:
        """Drop every sequence (an empty index)."""
        self._tokens = np.empty(256, dtype=np.int64)  # [capacity]
        self._prev = np.empty(256, dtype=np.int64)  # the sequence's slot before; -1 at its start
        self._next = np.empty(256, dtype=np.int64)  # the sequence's slot after; -1 at its end
        self.num_tokens = 0
        self._firsts: list[int] = []  # each sequence's first slot (-1: empty)
        self._lasts: list[int] = []  # each sequence's last slot (-1: empty)

    def start(self, tokens: Sequence[int] = ()) -> int:
        """A new sequence (its id), holding `tokens`."""
        self._firsts.append(-1)
        self._lasts.append(-1)
        self.extend(len(self._lasts) - 1, tokens)
        return len(self._lasts) - 1

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq`."""
        for token in tokens:
            slot = self._slot()
            last = self._lasts[seq]
            self._tokens[slot], self._prev[slot], self._next[slot] = int(token), last, -1
            if last >= 0:
                self._next[last] = slot
            else:
                self._firsts[seq] = slot
            self._lasts[seq] = slot

    def _slot(self) -> int:
        if self.num_tokens == len(self._tokens):  # full: double every array
            for name in ("_tokens", "_prev", "_next"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.empty_like(old)]))
        self.num_tokens += 1
        return self.num_tokens - 1

    @property
    def sequences(self) -> list[list[int]]:
        """Every sequence's tokens, in the order they were started (a read for inspection)."""
        out = []
        for slot in self._firsts:
            tokens = []
            while slot >= 0:
                tokens.append(int(self._tokens[slot]))
                slot = int(self._next[slot])
            out.append(tokens)
        return out

    def matches(self, context: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """For each match length m = 1, 2, ... while the last m tokens of `context` occur
        (m < len(context), m < max_depth): (m, the slots where those occurrences end)."""
        tokens = self._tokens[:self.num_tokens]
        ends = np.flatnonzero(tokens == int(context[-1]))  # [occurrences]
        firsts = ends  # where each occurrence starts
        found = []
        for m in range(1, min(len(context), self.max_depth)):
            if m > 1:
                before = self._prev[firsts]
                keep = before >= 0
                keep[keep] = tokens[before[keep]] == int(context[-m])
                ends, firsts = ends[keep], before[keep]
            if len(ends) == 0:
                break
            found.append((m, ends))
        return found

    def children(self, ends: np.ndarray, room: int) -> Children:
        """The tokens that followed the occurrences ending at `ends`, in sibling order (none
        when the node is `room` = 0 tokens from the tree's depth)."""
        after = self._next[ends] if room > 0 else ends[:0]
        after = after[after >= 0]  # [followed occurrences]
        if len(after) <= SMALL:
            return self._few_children(after)
        tokens, group, counts = np.unique(self._tokens[after], return_inverse=True,
                                          return_counts=True)
        latest = np.full(len(tokens), -1, dtype=np.int64)
        np.maximum.at(latest, group, after)  # when each child reached its count
        # More occurrences first; at equal counts, the one that reached its count last first;
        # among single occurrences, the earliest first.
        order = np.lexsort((np.where(counts > 1, -latest, latest), -counts))
        return Children(tokens[order].tolist(), counts[order].tolist(), order, group, after)

    def _few_children(self, after: np.ndarray) -> Children:
        """`children` of a few occurrences, in plain Python (numpy's per-call cost dominates
        there); the same order."""
        first: dict[int, int] = {}  # token -> its group
        group, counts, latest = [], [], []
        for slot, token in zip(after.tolist(), self._tokens[after].tolist(), strict=True):
            g = first.setdefault(token, len(first))
            if g == len(counts):
                counts.append(0)
                latest.append(slot)
            counts[g] += 1
            latest[g] = max(latest[g], slot)
            group.append(g)
        order = sorted(range(len(counts)), key=lambda g: (
            -counts[g], -latest[g] if counts[g] > 1 else latest[g]))
        tokens = list(first)
        return Children([tokens[g] for g in order], [counts[g] for g in order],
                        np.array(order, dtype=np.int64), np.array(group, dtype=np.int64), after)


@dataclass(frozen=True)
class Children:
    """A node's children in sibling order: tokens, counts, and where each child's own
    occurrences end (`places(i)`, computed when asked)."""

    tokens: list[int]
    counts: list[int]
    order: np.ndarray  # sibling i is group order[i]
    group: np.ndarray  # each followed occurrence's group
    after: np.ndarray  # each followed occurrence's next slot

    def places(self, i: int) -> np.ndarray:
        return self.after[self.group == self.order[i]]


class SuffixStore(SuffixIndex):
    """The global store: the target's answers (prompts left out), each learnt token by token as
    it is committed, for the generations that follow and for a batch's other rows. The caller
    owns it: a sweep's row shares one across its prompts, a batch across its rows; it grows
    without bound (no eviction)."""

    shared_by_forks = True  # a batch's rows write to one store, each its own sequence


@dataclass(frozen=True)
class SuffixSettings:
    """How much to draft from a match of m tokens (arctic-inference's parameters): at most
    min(num_draft_tokens, int(max_spec_factor * m + max_spec_offset)) tokens, each with an
    estimated probability of at least min_token_prob; a chain (the likeliest child each time)
    or, with tree=True, the likeliest tokens best first."""

    num_draft_tokens: int = 8
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    tree: bool = False

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"SuffixSettings: num_draft_tokens must be >= 1, got "
                             f"{self.num_draft_tokens}")
        if self.max_spec_factor < 0 or not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"SuffixSettings: need max_spec_factor >= 0 and min_token_prob in "
                             f"[0, 1], got {self.max_spec_factor}, {self.min_token_prob}")

    def budget(self, match: int) -> int:
        """The most tokens a match of `match` tokens may draft (1e-6: a product such as
        0.1 * 30 meant as a whole number still rounds down to it)."""
        scaled = int(match * self.max_spec_factor + self.max_spec_offset + 1e-6)
        return max(0, min(self.num_draft_tokens, scaled))


@dataclass
class SuffixDraft:
    """A speculation: tokens, each node's parent (-1: the root), each token's estimated
    probability (its count over the match's); score: their sum, kept as (sum of counts,
    the match's count) so that equal scores compare equal."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    total: int = 1  # the matched suffix's count
    match: int = 0

    @property
    def probs(self) -> list[float]:
        return [c / self.total for c in self.counts]

    @property
    def score(self) -> float:
        return sum(self.counts) / self.total

    def at_least(self, other: SuffixDraft) -> bool:
        """score >= other's score, exactly."""
        return sum(self.counts) * other.total >= sum(other.counts) * self.total


def speculate(index: SuffixIndex, context: Sequence[int], settings: SuffixSettings
              ) -> SuffixDraft:
    """The best-scored draft over every match length (a longer match wins a tie)."""
    context = context[-index.max_depth:]
    draw = _tree if settings.tree else _chain
    best: SuffixDraft | None = None
    for match, ends in reversed(index.matches(context)):  # longest first: it wins ties
        budget = settings.budget(match)
        if best is not None and best.at_least(SuffixDraft(counts=[1] * budget)):
            break  # a draft of `budget` tokens scores at most `budget`; shorter matches no more
        draft = draw(index, ends, budget, index.max_depth - match, settings.min_token_prob)
        if best is None or not best.at_least(draft):
            best, best.match = draft, match
    return best if best is not None else SuffixDraft()


def _chain(index: SuffixIndex, ends: np.ndarray, budget: int, room: int,
           min_prob: float) -> SuffixDraft:
    """The likeliest child, then its likeliest child, ... while probable enough."""
    draft, total = SuffixDraft(total=len(ends)), len(ends)
    while len(draft.tokens) < budget:
        children = index.children(ends, room - len(draft.tokens))
        if not children.tokens or children.counts[0] / total < min_prob:
            break
        ends = children.places(0)
        draft.parents.append(len(draft.tokens) - 1)
        draft.tokens.append(children.tokens[0])
        draft.counts.append(children.counts[0])
    return draft


def _tree(index: SuffixIndex, ends: np.ndarray, budget: int, room: int,
          min_prob: float) -> SuffixDraft:
    """The likeliest tokens best first (ties: first pushed first), each after its parent."""
    draft, total = SuffixDraft(total=len(ends)), len(ends)
    # (-count, push order, parent node, its depth, the siblings, which one): a max-heap by count
    heap: list[tuple[int, int, int, int, Children, int]] = []
    order = itertools.count()

    def push_children(parent: int, ends: np.ndarray, depth: int) -> None:
        children = index.children(ends, room - depth)
        for i, count in enumerate(children.counts):
            if count / total < min_prob:
                break  # siblings come most frequent first
            heapq.heappush(heap, (-count, next(order), parent, depth + 1, children, i))

    push_children(-1, ends, 0)
    while heap and len(draft.tokens) < budget:
        negative, _, parent, depth, children, i = heapq.heappop(heap)
        draft.parents.append(parent)
        draft.tokens.append(children.tokens[i])
        draft.counts.append(-negative)
        push_children(len(draft.tokens) - 1, children.places(i), depth)
    return draft


class SuffixDrafter:
    """Suffix decoding: the better-scored of two speculations (this generation's own at a tie),
    one over this generation's tokens (its prompt and what it committed) and one over
    `store`, the target's answers learnt so far (this one's included, as it grows). Drafts are
    chosen (q=None), so verification stays exact at any temperature.

    The drafter writes to the store the tokens each step committed, on its next proposal, and
    the last step's when the loop says the generation stopped (`finish`); the store is the
    caller's (`SuffixStore`): share one across the generations that should learn from each
    other. `last` is the last speculation, with its scores."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, store: SuffixStore, settings: SuffixSettings = SuffixSettings()):
        self.store, self.settings = store, settings
        self.max_nodes = settings.num_draft_tokens
        self._local: SuffixIndex | None = None
        self._answer = -1  # its sequence in the store
        self._seen = 0  # tokens of the context indexed so far
        self.last: SuffixDraft | None = None

    def begin(self, setup: DecodeSetup) -> None:
        prompt = setup.prompt.tolist()
        self._local = SuffixIndex(self.store.max_depth)
        self._local.start(prompt)
        self._answer = self.store.start()
        self._seen = len(prompt)

    def propose(self, context: DraftContext) -> Draft:
        if self._local is None:
            raise RuntimeError("SuffixDrafter: begin() a generation before propose()")
        tokens = context.token_list()
        self._learn(tokens[self._seen:])
        self._seen = len(tokens)
        ours = speculate(self._local, tokens, self.settings)
        theirs = speculate(self.store, tokens, self.settings)
        self.last = ours if ours.at_least(theirs) else theirs
        return _as_draft(self.last, context.tokens.device)

    def finish(self, tokens: Sequence[int]) -> None:
        """The generation stopped with `tokens`: learn what its last step committed."""
        if self._local is not None:
            self._learn(tokens[self._seen:])
            self._seen = len(tokens)

    def forget(self) -> None:
        """Empty the store (shared with this drafter's forks) and this generation's index."""
        self.store.clear()
        self._local, self._answer, self._seen = None, -1, 0

    def _learn(self, committed: Sequence[int]) -> None:
        self._local.extend(0, committed)
        self.store.extend(self._answer, committed)


def _as_draft(draft: SuffixDraft, device: torch.device) -> Draft:
    if not draft.tokens:
        return Draft.chain(torch.empty(0, dtype=torch.long, device=device))
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens, draft.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return Draft.from_paths(paths, device)
