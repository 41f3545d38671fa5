"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n-gram."""

from __future__ import annotations

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext


class NgramDrafter:
    """Training-free drafter: match the last `max_ngram`..`min_ngram` tokens earlier in the
    context and copy up to `num_draft_tokens` tokens that followed. Drafts are deterministic
    (q=None), so verification stays exact at any temperature."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if num_draft_tokens < 1:
            raise ValueError(f"NgramDrafter: num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_nodes = num_draft_tokens

    def begin(self, setup: DecodeSetup) -> None:
        pass  # stateless: everything it needs is in the context

    def propose(self, context: DraftContext) -> Draft:
        tokens = context.tokens  # [L]
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = _last_match(tokens, n)
            if start is not None:
                return Draft.chain(tokens[start : start + self.num_draft_tokens])
        return Draft.empty()


def _last_match(tokens: torch.Tensor, n: int) -> int | None:
    """Index just after the most recent earlier occurrence of the last n tokens, or None."""
    windows = tokens[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a successor
    hits = torch.nonzero((windows == tokens[-n:]).all(dim=1)).flatten()
    return None if hits.numel() == 0 else int(hits[-1]) + n
