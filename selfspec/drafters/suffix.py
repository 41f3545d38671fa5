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
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext

Place = tuple[int, int]  # (sequence, index of the token just after a match)


class SuffixIndex:
    """Token sequences (each growing at its end) and where each token occurs, with a clock
    that orders every appended token; what suffix trees of depth `max_depth` over them count."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"SuffixIndex: max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.sequences: list[list[int]] = []
        self.times: list[list[int]] = []  # the clock at each token's append
        self.places: dict[int, list[Place]] = defaultdict(list)  # token -> (seq, index + 1)
        self.clock = 0

    def start(self, tokens: Sequence[int] = ()) -> int:
        """A new sequence (its id), holding `tokens`."""
        self.sequences.append([])
        self.times.append([])
        self.extend(len(self.sequences) - 1, tokens)
        return len(self.sequences) - 1

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq`."""
        sequence, times = self.sequences[seq], self.times[seq]
        for token in tokens:
            sequence.append(int(token))
            times.append(self.clock)
            self.clock += 1
            self.places[int(token)].append((seq, len(sequence)))

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def matches(self, context: Sequence[int]) -> list[tuple[int, list[Place]]]:
        """For each match length m = 1, 2, ... while the last m tokens of `context` occur
        (m < len(context), m < max_depth): (m, the places just after each occurrence)."""
        found, places = [], self.places.get(int(context[-1]), [])
        for m in range(1, min(len(context), self.max_depth)):
            if m > 1:
                token = int(context[-m])
                places = [(s, i) for s, i in places if i > m - 1
                          and self.sequences[s][i - m] == token]
            if not places:
                break
            found.append((m, places))
        return found

    def children(self, places: list[Place], room: int) -> list[tuple[int, list[Place]]]:
        """The tokens that followed `places` (a node's occurrences), in sibling order, each with
        its own occurrences' next places; none when the node is `room` = 0 tokens from the
        tree's depth."""
        if room <= 0:
            return []
        grouped: dict[int, list[Place]] = {}
        for s, i in places:
            if i < len(self.sequences[s]):
                grouped.setdefault(self.sequences[s][i], []).append((s, i + 1))
        return sorted(grouped.items(), key=lambda item: self._sibling_key(item[1]))

    def _sibling_key(self, places: list[Place]) -> tuple[int, int]:
        """More occurrences first; at equal counts, the one that reached its count last first;
        among single occurrences, the earliest first."""
        last = max(self.times[s][i - 1] for s, i in places)
        return (-len(places), -last if len(places) > 1 else last)


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
    best = SuffixDraft()
    for match, places in index.matches(context):
        room = index.max_depth - match
        draw = _tree if settings.tree else _chain
        draft = draw(index, places, settings.budget(match), room, settings.min_token_prob)
        if draft.at_least(best):
            best, best.match = draft, match
    return best


def _chain(index: SuffixIndex, places: list[Place], budget: int, room: int,
           min_prob: float) -> SuffixDraft:
    """The likeliest child, then its likeliest child, ... while probable enough."""
    draft, total = SuffixDraft(total=len(places)), len(places)
    while len(draft.tokens) < budget:
        children = index.children(places, room - len(draft.tokens))
        if not children or len(children[0][1]) / total < min_prob:
            break
        token, places = children[0]
        draft.parents.append(len(draft.tokens) - 1)
        draft.tokens.append(token)
        draft.counts.append(len(places))
    return draft


def _tree(index: SuffixIndex, places: list[Place], budget: int, room: int,
          min_prob: float) -> SuffixDraft:
    """The likeliest tokens best first (ties: first pushed first), each after its parent."""
    draft, total = SuffixDraft(total=len(places)), len(places)
    heap: list[tuple[int, int, int, int, list[Place]]] = []  # (-count, order, token, parent,
    pushed = 0                                                #  places), a max-heap by count

    def push_children(parent: int, places: list[Place], depth: int) -> None:
        nonlocal pushed
        for token, after in index.children(places, room - depth):
            if len(after) / total < min_prob:
                break  # siblings come most frequent first
            heapq.heappush(heap, (-len(after), pushed, token, parent, after))
            pushed += 1

    push_children(-1, places, 0)
    depth = [0]  # of each node, the root's first
    while heap and len(draft.tokens) < budget:
        negative, _, token, parent, after = heapq.heappop(heap)
        draft.parents.append(parent)
        draft.tokens.append(token)
        draft.counts.append(-negative)
        depth.append(depth[parent + 1] + 1)
        push_children(len(draft.tokens) - 1, after, depth[-1])
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
