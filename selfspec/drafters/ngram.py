"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n-gram,
in the context or, with a `LookupCorpus`, in text the target wrote before (REST-style
retrieval from a datastore)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext


class LookupCorpus:
    """Continuations seen in a corpus of token sequences (e.g. the target's own answers to
    training prompts), for every n-gram of min_ngram..max_ngram tokens: the continuation most
    often seen after it, up to `length` tokens, built token by token (the most frequent next
    token, then the most frequent one after it among the occurrences that agreed so far).

    A continuation ends where the occurrences behind it fall below `min_count` or where its
    next token is the choice of less than `min_share` of them, so a draft is long only where
    the corpus agrees with itself. Built once, in memory; a lookup is one dict read."""

    def __init__(self, sequences: Iterable[Sequence[int]], *, max_ngram: int = 3,
                 min_ngram: int = 1, length: int = 8, min_count: int = 1,
                 min_share: float = 0.0):
        if not 1 <= min_ngram <= max_ngram or length < 1 or min_count < 1 \
                or not 0.0 <= min_share < 1.0:
            raise ValueError(f"LookupCorpus: need 1 <= min_ngram <= max_ngram, length >= 1, "
                             f"min_count >= 1 and 0 <= min_share < 1, got {min_ngram}, "
                             f"{max_ngram}, {length}, {min_count}, {min_share}")
        self.max_ngram, self.min_ngram, self.length = max_ngram, min_ngram, length
        self.min_count, self.min_share = min_count, min_share
        self.sequences = [list(map(int, s)) for s in sequences]
        self.num_tokens = sum(len(s) for s in self.sequences)
        self._table = self._build()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, ngram: Sequence[int]) -> tuple[int, ...]:
        """The continuation seen after exactly this n-gram; () when it was not seen."""
        return self._table.get(tuple(ngram), ())

    def continuation(self, suffix: Sequence[int]) -> tuple[int, ...]:
        """What the corpus continues the longest n-gram ending `suffix` with (max_ngram down
        to min_ngram); () when no n-gram of it was seen."""
        for n in range(min(self.max_ngram, len(suffix)), self.min_ngram - 1, -1):
            found = self.get(suffix[len(suffix) - n:])
            if found:
                return found
        return ()

    def _build(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        occurrences: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        for s, seq in enumerate(self.sequences):
            for end in range(1, len(seq)):  # an n-gram ending before `end`, followed by seq[end]
                for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                    occurrences[tuple(seq[end - n:end])].append((s, end))
        table = {}
        for key, places in occurrences.items():
            path = self._majority_path(places)
            if path:
                table[key] = path
        return table

    def _majority_path(self, places: list[tuple[int, int]]) -> tuple[int, ...]:
        if len(places) == 1 and self.min_count == 1:  # most n-grams: nothing to vote on
            s, e = places[0]
            return tuple(self.sequences[s][e:e + self.length])
        path = []
        for depth in range(self.length):
            nexts = [(s, e) for s, e in places if e + depth < len(self.sequences[s])]
            if len(nexts) < self.min_count:
                break
            votes = Counter(self.sequences[s][e + depth] for s, e in nexts)
            token, count = votes.most_common(1)[0]
            if count < self.min_share * len(nexts):
                break
            path.append(token)
            places = [(s, e) for s, e in nexts if self.sequences[s][e + depth] == token]
        return tuple(path)


class NgramDrafter:
    """Training-free drafter: match the last `max_ngram`..`min_ngram` tokens earlier in the
    context and copy up to `num_draft_tokens` tokens that followed; with a `corpus`, an n-gram
    the context does not hold is looked up there (at each n the context is asked first: it
    knows this answer's names and numbers). Drafts are deterministic (q=None), so
    verification stays exact at any temperature."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 corpus: LookupCorpus | None = None):
        if num_draft_tokens < 1:
            raise ValueError(f"NgramDrafter: num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.corpus = corpus
        self.max_nodes = num_draft_tokens

    def begin(self, setup: DecodeSetup) -> None:
        pass  # stateless: everything it needs is in the context

    def propose(self, context: DraftContext) -> Draft:
        tokens = context.tokens  # [L]
        # One host read of the last few tokens, for the corpus's dict (a CPU-side index).
        suffix = tokens[-self.max_ngram:].tolist() if self.corpus is not None else []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = _last_match(tokens, n)
            if start is not None:
                return Draft.chain(tokens[start : start + self.num_draft_tokens])
            if self.corpus is not None:
                found = self.corpus.get(suffix[len(suffix) - n:])
                if found:
                    return Draft.chain(list(found[: self.num_draft_tokens]))
        return Draft.empty()


def _last_match(tokens: torch.Tensor, n: int) -> int | None:
    """Index just after the most recent earlier occurrence of the last n tokens, or None."""
    windows = tokens[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
    hits = torch.nonzero((windows == tokens[-n:]).all(dim=1)).flatten()
    return None if hits.numel() == 0 else int(hits[-1]) + n
