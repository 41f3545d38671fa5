"""A drafter that knows the answer: the target's own greedy continuation, proposed in chunks.

With a perfect drafter every draft token is accepted (tau = k + 1 until the end), so its
speedup over plain decoding is the ceiling of the decode loop on this machine: it should sit
near tau / c(k + 1) (see `selfspec.costs`). Greedy decoding only.
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import DecodeSetup, Draft, DraftContext


class OracleDrafter:
    """Proposes the next num_draft_tokens tokens of plain greedy decoding (computed once per
    generation, in `begin`, outside the timed loop)."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) \
                or num_draft_tokens < 1:
            raise ValueError(f"OracleDrafter: num_draft_tokens must be an integer >= 1, "
                             f"got {num_draft_tokens!r}")
        self.num_draft_tokens = self.max_nodes = num_draft_tokens
        self._answer: list[int] = []
        self._prompt_length = 0

    def begin(self, setup: DecodeSetup) -> None:
        from selfspec.decode import generate  # decode imports the drafter protocol

        if not setup.sampling.greedy:
            raise ValueError("OracleDrafter replays greedy decoding: use temperature 0")
        room = setup.max_length - len(setup.prompt) - self.max_nodes - 1
        self._answer = generate(setup.target, setup.prompt, max_new_tokens=room).tokens
        self._prompt_length = len(setup.prompt)

    def propose(self, context: DraftContext) -> Draft:
        done = len(context.tokens) - self._prompt_length  # tokens generated so far
        chunk = self._answer[done : done + self.num_draft_tokens]
        return Draft.chain(torch.tensor(chunk, dtype=torch.long, device=context.tokens.device))
