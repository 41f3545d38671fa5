"""Layer-skip self-speculation (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024):
the target drafts with a set of its own layers skipped, and verification runs every layer.

The cache. Drafting runs in the target's own KV cache (`DecodeSetup.target_cache`; on CUDA
the static steps' persistent cache, which the draft's eager forwards write like any cache), as
Draft & Verify shares it. The committed prefix's K/V there are the full model's, so every
draft token attends to exact states of the context. Drafting k tokens feeds the root, then
each drafted token but the last, one at a time at slots [length, length + k): the layers that
run write their K/V there (the skipped layers write nothing; nothing reads their slots while
drafting, since those layers do not run), and later draft tokens attend to them. When the
chain is drafted the cache's length is set back to what it was, so the draft leaves nothing
valid behind. The verification forward over [root, draft...] then writes every layer's K/V at
those same slots, overwriting the draft's, and its commit keeps the accepted rows only, as
for any draft. The draft writes into no other cache.

Sampling. Greedy drafts take the skipping model's argmax (q None). Otherwise each token is
drawn, with the generation's generator, from the skipping model's law warped by the one
warping function (`selfspec.sampling.logits_to_probs`), and those laws are the draft's q, so
verification stays exact.

The adaptive search (SWIFT-style, `SkipSearch`): the skip set is searched during each
generation by a hill climb over sets of the same size among the middle layers 1..L-2 (the
first and last layers always run). The generation alternates windows of `window` steps: one
runs the current set and measures its score, the next runs a neighbour (one skipped layer
swapped for one running layer, both drawn from a `random.Random(seed)`), which replaces the
current set if its score over its window is strictly higher. A score is tokens per unit of
cost: the mean tokens a step emitted (accepted drafts + 1) over the step's cost in target
forwards, 1 (verification) + k x (layers run / L) (the draft). Every set the climb compares
has the same size, so the cost is the same and the score ranks by acceptance. Each
generation starts the climb afresh from the start set with the seed's generator: the sets it
drafts with depend only on the generation's own acceptance.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch

from selfspec.checks import check_count, is_int_in
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.model.recurrent_cache import refuse_partial_forwards
from selfspec.sampling import logits_to_probs, sample


def middle_layers(num_layers: int) -> range:
    """The layers a skip set may search over: all but the first and the last."""
    return range(1, num_layers - 1)


def every_other_middle_layer(num_layers: int) -> frozenset[int]:
    """The default skip set: every other middle layer from the last one down, L - 2, L - 4,
    ... (about half the middle; layer 1, right after the first, runs when L is even)."""
    return frozenset(middle_layers(num_layers)[::-2])


def check_skip_layers(skip_layers: Iterable[int], num_layers: int, adaptive: bool,
                      who: str = "LayerSkipDrafter: skip_layers") -> frozenset[int]:
    """A skip set for a num_layers-layer target: distinct layer ids in [0, L), in 1..L-2 when
    it starts an adaptive search; anything else is a clear error naming `who`."""
    ids = list(skip_layers)
    low, high = (1, num_layers - 2) if adaptive else (0, num_layers - 1)
    bad = [i for i in ids if not is_int_in(i, range(low, high + 1))]
    if bad or len(set(ids)) != len(ids):
        what = "the middle layers" if adaptive else "the layers"
        raise ValueError(f"{who}: give distinct layer ids in {low}..{high} ({what} of the "
                         f"{num_layers}-layer target), got {ids}")
    return frozenset(ids)


class SkipSearch:
    """The adaptive hill climb over skip sets (the module's docstring): `active` is the set to
    draft with now, `record` takes each step's accepted draft tokens."""

    def __init__(self, start: frozenset[int], num_layers: int, num_draft_tokens: int,
                 window: int, seed: int) -> None:
        self.current, self.trial = start, None  # trial: the neighbour on trial, if any
        self.num_layers, self.num_draft_tokens, self.window = num_layers, num_draft_tokens, window
        self.current_score: float | None = None
        self.adopted: list[frozenset[int]] = []  # every neighbour that won, in order
        self._rng = random.Random(seed)
        self._accepted: list[int] = []  # the running window's accepted counts

    @property
    def active(self) -> frozenset[int]:
        return self.current if self.trial is None else self.trial

    def record(self, accepted: int) -> None:
        self._accepted.append(accepted)
        if len(self._accepted) < self.window:
            return
        score = self.score(self.active, self._accepted)
        self._accepted = []
        if self.trial is None:  # the current set's window: its fresh score, then a trial
            self.current_score, self.trial = score, self._neighbour()
            return
        if score > self.current_score:
            self.current = self.trial
            self.adopted.append(self.trial)
        self.trial = None  # the next window measures the current set again

    def score(self, skip: frozenset[int], accepted: list[int]) -> float:
        """Tokens per step over the step's cost in target forwards (verification + draft)."""
        tokens = 1 + sum(accepted) / len(accepted)
        runs = (self.num_layers - len(skip)) / self.num_layers
        return tokens / (1 + self.num_draft_tokens * runs)

    def _neighbour(self) -> frozenset[int] | None:
        """The current set with one skipped middle layer swapped for one running middle
        layer (None: nothing to swap)."""
        middle = set(middle_layers(self.num_layers))
        skipped, running = sorted(self.current & middle), sorted(middle - self.current)
        if not skipped or not running:
            return None
        out, into = self._rng.choice(skipped), self._rng.choice(running)
        return (self.current - {out}) | {into}


class LayerSkipDrafter:
    """Drafts a chain of num_draft_tokens tokens with the target minus skip_layers (None:
    every other middle layer, L - 2, L - 4, ... down to 1 or 2), in the target's own cache (the
    module's docstring). adaptive: search the skip set during each generation, starting from
    skip_layers, over windows of `window` steps, neighbours drawn from `seed`."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, skip_layers: Iterable[int] | None = None, num_draft_tokens: int = 4,
                 adaptive: bool = False, window: int = 8, seed: int = 0) -> None:
        for name, value in (("num_draft_tokens", num_draft_tokens), ("window", window)):
            check_count(name, value, owner="LayerSkipDrafter")
        if not isinstance(adaptive, bool):
            raise ValueError(f"LayerSkipDrafter: adaptive must be True or False, got {adaptive!r}")
        self.start = None if skip_layers is None else tuple(skip_layers)
        self.num_draft_tokens, self.max_nodes = num_draft_tokens, num_draft_tokens
        self.adaptive, self.window, self.seed = adaptive, window, seed
        self.search: SkipSearch | None = None
        self._fixed: frozenset[int] = frozenset()
        self._last_length: int | None = None  # the history's length at the last draft

    @property
    def skip_layers(self) -> frozenset[int]:
        """The set the next draft skips."""
        return self._fixed if self.search is None else self.search.active

    def begin(self, setup: DecodeSetup) -> None:
        refuse_partial_forwards("LayerSkipDrafter", setup.target.config.linear_layers)
        if setup.target_cache is None:
            raise ValueError("LayerSkipDrafter drafts in the target's own KV cache "
                             "(DecodeSetup.target_cache), which only the decode loop "
                             "(selfspec.generate) passes: measure it there")
        num_layers = setup.target.config.num_layers
        start = (every_other_middle_layer(num_layers) if self.start is None
                 else check_skip_layers(self.start, num_layers, self.adaptive))
        self._fixed, self.search = start, None
        if self.adaptive:
            self.search = SkipSearch(start, num_layers, self.num_draft_tokens, self.window,
                                     self.seed)
        self._target, self._cache = setup.target, setup.target_cache
        self._sampling, self._generator = setup.sampling, setup.generator
        self._last_length = None

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        self._observe(context)
        skip, base, token = self.skip_layers, self._cache.length, int(context.tokens[-1])
        tokens, laws = [], []
        for step in range(self.num_draft_tokens):
            probs = logits_to_probs(self._skipping_forward(token, base + step, skip),
                                    self._sampling)  # [V]
            token = self._draw(probs)
            tokens.append(token)
            laws.append(probs)
        self._roll_back(base)
        return self._chain(tokens, laws)

    def _observe(self, context: DraftContext) -> None:
        """Hand the last draft's accepted count to the search: the step emitted the accepted
        drafts and one token of the target's."""
        length = len(context.tokens)
        if self.search is not None and self._last_length is not None:
            self.search.record(length - self._last_length - 1)
        self._last_length = length

    def _skipping_forward(self, token: int, position: int, skip: frozenset[int]
                          ) -> torch.Tensor:
        """[V] the skipping model's logits after `token` at `position`, its running layers'
        K/V written in the target's cache at the next slot (= position: a chain's cache is
        the plain history)."""
        device = self._target.embed_tokens.weight.device
        ids = torch.tensor([[token]], device=device)  # [1, 1]
        positions = torch.tensor([position], device=device)  # [1]
        return self._target(ids, positions, self._cache, skip_layers=skip).logits[0, -1]

    def _draw(self, probs: torch.Tensor) -> int:
        """A token from the draft's law probs [V] (its argmax when greedy: one-hot)."""
        return sample(probs, self._generator)

    def _roll_back(self, base: int) -> None:
        """Free the drafted slots: verification writes every layer's K/V there."""
        self._cache.truncate(base)

    def _chain(self, tokens: list[int], laws: list[torch.Tensor]) -> Draft:
        q = None if self._sampling.greedy else torch.stack(laws)  # [k, V]
        device = self._target.embed_tokens.weight.device
        return Draft.chain(torch.tensor(tokens, device=device), q)
