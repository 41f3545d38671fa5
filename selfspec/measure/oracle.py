"""A drafter that knows the answer: the target's own greedy continuation, proposed in chunks.

With a perfect drafter every draft token is accepted (tau = k + 1 until the end), so its
speedup over plain decoding is the ceiling of the decode loop on this machine: it should sit
near tau / c(k + 1) (see `selfspec.measure.costs`). Greedy decoding only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.decode import generate
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext


class OracleDrafter:
    """Proposes the next num_draft_tokens tokens of plain greedy decoding. The answers are
    computed by `prepare` (or, for a prompt it did not see, in `begin`) and kept per target
    and prompt: a timed generation of a prepared prompt only replays its answer."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) \
                or num_draft_tokens < 1:
            raise ValueError(f"OracleDrafter: num_draft_tokens must be an integer >= 1, "
                             f"got {num_draft_tokens!r}")
        self.num_draft_tokens = self.max_nodes = num_draft_tokens
        self._answer: list[int] = []
        self._prompt_length = 0
        self._answers: dict[tuple, list[int]] = {}  # (id(target), prompt) -> greedy answer

    def prepare(self, target, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Compute the greedy answers ahead of the generations that will replay them (which
        `begin` would otherwise do inside the caller's timing)."""
        for prompt in prompts:
            self._answer_for(target, torch.as_tensor(list(prompt)), max_new_tokens)

    def with_draft_tokens(self, num_draft_tokens: int) -> OracleDrafter:
        """An oracle of another draft length that shares these answers."""
        other = OracleDrafter(num_draft_tokens)
        other._answers = self._answers
        return other

    def _answer_for(self, target, prompt: torch.Tensor, length: int) -> list[int]:
        key = (id(target), tuple(prompt.tolist()))
        known = self._answers.get(key, [])
        if len(known) < length:  # greedy answers are prefixes of longer ones
            known = self._answers[key] = generate(target, prompt, max_new_tokens=length).tokens
        return known[:length]

    def begin(self, setup: DecodeSetup) -> None:
        if not setup.sampling.greedy:
            raise ValueError("OracleDrafter replays greedy decoding: use temperature 0")
        room = setup.max_length - len(setup.prompt) - self.max_nodes - 1
        self._answer = self._answer_for(setup.target, setup.prompt, room)
        self._prompt_length = len(setup.prompt)

    def propose(self, context: DraftContext) -> Draft:
        done = len(context.tokens) - self._prompt_length  # tokens generated so far
        chunk = self._answer[done : done + self.num_draft_tokens]
        return Draft.chain(torch.tensor(chunk, dtype=torch.long, device=context.tokens.device))
