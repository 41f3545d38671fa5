"""Lookahead decoding (Fu et al. 2024) as a drafter: no training, no second model.

The target runs Jacobi iterations over a window of W future positions in the same forward
that verifies the draft. The window holds N - 1 levels of guesses (level j, column i stands at
i + j positions after the root); each step the target's argmax at the last level becomes a new
level, and every column's trajectory (its N - 1 levels and the new guess) is an n-gram for the
pool, keyed by its first token. The draft is up to G pooled n-grams that start with the root,
merged into a tree of at most G (N - 1) nodes and verified by the shared verifier; the window
rides along as `ExtraRows`, which no node sees and which are never accepted, so verification
is exact whatever the window holds. Candidates are chosen, not sampled (q = None): exact in
law at any temperature.

The window's rows attend, besides the committed cache, to the root and along their column's
trajectory: row (j, i) sees level 0's columns 0..i (column 0 is the root) and its own column's
levels 1..j; with W = 15, N = 5, G = 15 (the paper's 7B setting) that is W - 1 + W (N - 2) = 59
extra rows a step, affordable on a GPU, where verifying 64 rows costs ~1.2 one-row forwards.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from selfspec.checks import check_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext, ExtraRows
from selfspec.tree import Tree

_WINDOW_SEED = 0  # the window starts from prompt tokens picked by this seed (reproducible)


class NgramPool:
    """The n-grams the Jacobi trajectories produced: for each first token, its `size` most
    recent distinct continuations (N - 1 tokens each), newest first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._after: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: tuple[int, ...]) -> None:
        seen = self._after.setdefault(gram[0], [])
        if gram[1:] in seen:
            seen.remove(gram[1:])
        seen.insert(0, gram[1:])
        del seen[self.size:]

    def continuations(self, first: int) -> list[tuple[int, ...]]:
        return self._after.get(first, [])


class LookaheadDrafter:
    """window (W): the Jacobi window's columns; ngram (N): the n-gram size, N - 1 levels of
    guesses and drafts N - 1 deep (at most `depth` deep when given); candidates (G): the most
    n-grams verified a step; pool_size: continuations kept per first token (default G)."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, window: int = 4, ngram: int = 4, candidates: int = 4,
                 depth: int | None = None, pool_size: int | None = None) -> None:
        for name, value, low in (("window", window, 1), ("ngram", ngram, 3),
                                 ("candidates", candidates, 1), ("depth", depth or 1, 1),
                                 ("pool_size", pool_size or 1, 1)):
            check_count(name, value, low, owner="LookaheadDrafter")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.depth = min(depth or ngram - 1, ngram - 1)
        self.pool_size = pool_size or candidates
        self._offsets, self._mask = window_layout(window, ngram)
        self.max_nodes = candidates * self.depth + len(self._offsets)
        self._levels: list[list[int]] = []
        self._pool = NgramPool(self.pool_size)
        self._length = 0  # the context's length at the last draft

    def begin(self, setup: DecodeSetup) -> None:
        prompt = setup.prompt.tolist()
        generator = torch.Generator().manual_seed(_WINDOW_SEED)
        picks = torch.randint(len(prompt), (self.ngram - 1, self.window), generator=generator)
        self._levels = [[prompt[i] for i in row] for row in picks.tolist()]
        self._pool = NgramPool(self.pool_size)
        self._length = 0

    def propose(self, context: DraftContext) -> Draft:
        tokens = context.tokens
        if context.extra_logits is not None:
            self._advance(context.extra_logits, len(tokens) - self._length)
        self._length = len(tokens)
        root = int(tokens[-1])  # the one host read of the step
        self._levels[0][0] = root  # the window's first column starts at the root
        draft = self._candidates(root, tokens.device)
        return replace(draft, extra=self._window_rows(tokens.device))

    def _advance(self, extra_logits: torch.Tensor, emitted: int) -> None:
        """Take the last level's new guesses, pool each column's trajectory as an n-gram, and
        slide the window by the tokens the step emitted."""
        guesses = extra_logits[-self.window:].argmax(dim=-1).tolist()  # [W] the new level
        for column, guess in enumerate(guesses):
            self._pool.add((*(level[column] for level in self._levels), guess))
        self._levels = [*self._levels[1:], guesses]
        for _ in range(emitted - 1):  # more tokens emitted: slide further, reusing level 0
            self._levels = [*self._levels[1:], list(self._levels[0])]

    def _candidates(self, root: int, device: torch.device) -> Draft:
        """The pooled n-grams after root, cut to `depth` tokens, merged into one tree."""
        grams = [gram[:self.depth] for gram in self._pool.continuations(root)]
        paths = dict.fromkeys(gram[:d] for gram in grams[:self.candidates]
                              for d in range(1, len(gram) + 1))
        if not paths:
            return Draft(Tree.chain(0), torch.empty(0, dtype=torch.long, device=device))
        return Draft.from_paths(list(paths), device=device)

    def _window_rows(self, device: torch.device) -> ExtraRows:
        """Level 0's columns 1..W-1 (its column 0 is the root), then levels 1..N-2."""
        rows = self._levels[0][1:] + [t for level in self._levels[1:] for t in level]
        return ExtraRows(torch.tensor(rows, dtype=torch.long, device=device),
                         self._offsets.to(device), self._mask.to(device))


def window_layout(window: int, ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The window rows' position offsets [R] and mask [R, 1 + R] (column 0: the root), in
    `_window_rows` order: row (j, i) stands at i + j and sees level 0's columns 0..i and its
    column's levels 1..j (a causal trajectory i + j + 1 tokens long)."""
    cells = [(0, i) for i in range(1, window)] + [
        (j, i) for j in range(1, ngram - 1) for i in range(window)]
    index = {(0, 0): 0} | {cell: r + 1 for r, cell in enumerate(cells)}
    mask = torch.zeros(len(cells), len(cells) + 1, dtype=torch.bool)
    for r, (j, i) in enumerate(cells):
        seen = [(0, c) for c in range(i + 1)] + [(level, i) for level in range(1, j + 1)]
        mask[r, [index[cell] for cell in seen]] = True
    offsets = torch.tensor([i + j for j, i in cells], dtype=torch.long)
    return offsets, mask
