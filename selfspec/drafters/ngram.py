"""Prompt lookup: propose what followed an earlier occurrence of the last n-gram (the most
recent one, or with match="earliest" the first one, vLLM's rule), in the context or, with a
`LookupCorpus`, in text the target wrote before (REST-style retrieval from a datastore), as a
chain or as a small tree of the corpus's likeliest continuations."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext

Path = tuple[int, ...]  # a continuation's first tokens
MATCHES = ("latest", "earliest")  # which earlier occurrence of the context's n-gram to continue


class LookupCorpus:
    """Where each n-gram (min_ngram..max_ngram tokens) of a corpus of token sequences (e.g. the
    target's own answers to training prompts) occurred, and what followed it: counts of the
    continuations (up to `length` tokens) of its last `max_places` occurrences, counted once
    per n-gram on first lookup. No continuation crosses from one sequence into the next."""

    shared_by_forks = True  # read-only once built: a batch's rows share one

    def __init__(self, sequences: Iterable[Sequence[int]], *, max_ngram: int = 3,
                 min_ngram: int = 1, length: int = 8, max_places: int = 4096):
        if not 1 <= min_ngram <= max_ngram or length < 1 or max_places < 1:
            raise ValueError(f"LookupCorpus: need 1 <= min_ngram <= max_ngram, length >= 1 and "
                             f"max_places >= 1, got {min_ngram}, {max_ngram}, {length}, "
                             f"{max_places}")
        self.max_ngram, self.min_ngram, self.length = max_ngram, min_ngram, length
        self.max_places = max_places
        self.sequences = [list(map(int, s)) for s in sequences]
        self.num_tokens = sum(len(s) for s in self.sequences)
        self._places = self._index()
        self._ranked: dict[Path, list[Path]] = {}
        self._majority: dict[Path, Path] = {}

    def __len__(self) -> int:
        return len(self._places)

    def _index(self) -> dict[Path, list[tuple[int, int]]]:
        places: dict[Path, list[tuple[int, int]]] = defaultdict(list)
        for s, seq in enumerate(self.sequences):
            for end in range(1, len(seq)):  # an n-gram ending before `end`, followed by seq[end]
                for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                    places[tuple(seq[end - n:end])].append((s, end))
        return dict(places)

    def counts(self, ngram: Sequence[int]) -> Counter:
        """{continuation prefix: how many occurrences of `ngram` it followed}; empty when the
        n-gram was not seen."""
        counts: Counter = Counter()
        for s, end in self._places.get(tuple(ngram), [])[-self.max_places:]:
            follow = tuple(self.sequences[s][end:end + self.length])
            counts.update(follow[:d] for d in range(1, len(follow) + 1))
        return counts

    def ranked(self, ngram: Sequence[int]) -> list[Path]:
        """The continuation prefixes seen after `ngram`, most frequent first (ties: shorter
        first, then first seen), so every prefix comes before its extensions; ranked once
        per n-gram, on first lookup."""
        key = tuple(ngram)
        if key not in self._ranked:
            counts = self.counts(key)
            self._ranked[key] = sorted(counts, key=lambda path: (-counts[path], len(path)))
        return self._ranked[key]

    def get(self, ngram: Sequence[int]) -> Path:
        """The continuation most often seen after `ngram`, token by token (the most frequent
        next token, then the most frequent one after it among the occurrences that agreed);
        () when the n-gram was not seen. Found once per n-gram: a chain draft asks every step."""
        key = tuple(ngram)
        if key not in self._majority:
            path: Path = ()
            for candidate in self.ranked(key):  # a child never comes before its parent
                if len(candidate) == len(path) + 1 and candidate[:-1] == path:
                    path = candidate
            self._majority[key] = path
        return self._majority[key]

    def longest_match(self, suffix: Sequence[int]) -> int:
        """The longest n (max_ngram down to min_ngram) whose last n tokens of `suffix` were
        seen; 0 when none was."""
        for n in range(min(self.max_ngram, len(suffix)), self.min_ngram - 1, -1):
            if tuple(suffix[len(suffix) - n:]) in self._places:
                return n
        return 0


class NgramDrafter:
    """Training-free drafter: match the last `max_ngram`..`min_ngram` tokens earlier in the
    context and copy up to `num_draft_tokens` tokens that followed (fewer where the context
    ends); `match` picks the occurrence continued: "latest" (the most recent) or "earliest"
    (the first, vLLM's rule: its continuation is the longest one the context holds, where the
    most recent one's is cut short by the context's end in a loop). With a `corpus`, the
    longest n-gram match wins, the context's at equal length (it knows this answer's names
    and numbers). Drafts are deterministic (q=None), so verification stays exact at any
    temperature.

    max_nodes > num_draft_tokens drafts a tree: the context's chain (when it wins), then the
    corpus's continuations of its longest match, most frequent first, up to max_nodes nodes
    and num_draft_tokens deep."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 corpus: LookupCorpus | None = None, max_nodes: int | None = None,
                 match: str = "latest"):
        if num_draft_tokens < 1:
            raise ValueError(f"NgramDrafter: num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        if match not in MATCHES:
            raise ValueError(f"NgramDrafter: match must be one of {MATCHES}, got {match!r}")
        max_nodes = num_draft_tokens if max_nodes is None else max_nodes
        if max_nodes < num_draft_tokens or (max_nodes > num_draft_tokens and corpus is None):
            raise ValueError(f"NgramDrafter: max_nodes ({max_nodes}) must be >= num_draft_tokens "
                             f"({num_draft_tokens}); a tree (more nodes than that) needs a corpus")
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.corpus = corpus
        self.max_nodes = max_nodes
        self.match = match

    def begin(self, setup: DecodeSetup) -> None:
        pass  # stateless: everything it needs is in the context

    def propose(self, context: DraftContext) -> Draft:
        tokens, k = context.tokens, self.num_draft_tokens  # [L]
        matched, chain = self._context_chain(tokens)  # chain [<= k], on the tokens' device
        if self.corpus is None:
            return Draft.chain(chain)
        # One host read of the last few tokens, for the corpus's dicts (a CPU-side index).
        suffix = tokens[-self.corpus.max_ngram:].tolist()
        found = self.corpus.longest_match(suffix)
        if found > matched:
            chain = chain[:0]
        if found == 0 or (len(chain) and self.max_nodes == k):
            return Draft.chain(chain)
        ngram = suffix[len(suffix) - found:]
        if self.max_nodes == k:
            return Draft.chain(torch.tensor(self.corpus.get(ngram)[:k], dtype=torch.long,
                                            device=tokens.device))
        return _tree_draft(_prefixes(tuple(chain.tolist())), self.corpus.ranked(ngram),
                           self.max_nodes, k, tokens.device)

    def _context_chain(self, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(n, what followed the last n tokens at their earlier occurrence `match` picks) for
        the longest n matched; (0, an empty chain) when none was."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = _match_end(tokens, n, earliest=self.match == "earliest")
            if start is not None:
                return n, tokens[start : start + self.num_draft_tokens]
        return 0, tokens[:0]


def _prefixes(chain: Path) -> list[Path]:
    return [chain[:d] for d in range(1, len(chain) + 1)]


def _tree_draft(nodes: list[Path], ranked: list[Path], max_nodes: int, depth: int,
                device: torch.device) -> Draft:
    """`nodes` (prefix-closed), then the continuations in `ranked` order whose parent is in,
    up to max_nodes nodes and `depth` deep."""
    chosen = set(nodes)
    for path in ranked:
        if len(nodes) >= max_nodes:
            break
        if len(path) <= depth and path not in chosen and (len(path) == 1 or path[:-1] in chosen):
            nodes.append(path)
            chosen.add(path)
    nodes.sort(key=len)  # parents before children
    return Draft.from_paths(nodes, device)


def _match_end(tokens: torch.Tensor, n: int, earliest: bool) -> int | None:
    """Index just after the most recent (or the earliest) earlier occurrence of the last n
    tokens, or None."""
    windows = tokens[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
    hits = torch.nonzero((windows == tokens[-n:]).all(dim=1)).flatten()
    if hits.numel() == 0:
        return None
    return int(hits[0 if earliest else -1]) + n
