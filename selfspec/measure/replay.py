"""A drafter's tau at temperature 0 from a recorded greedy answer, without decoding.

Greedy speculative decoding emits exactly plain greedy decoding's tokens, so each step's
accepted length is fixed by the answer: the longest draft path that the answer continues.
Replaying a drafter over a recorded answer therefore gives the tau (and acceptance by depth)
that `generate` would measure, without a verification forward per step. One teacher-forced
forward over prompt + answer supplies every target state a drafter reads (Medusa's last hidden
state, EAGLE's features); lookup drafters read only tokens. Trying a tree size, a corpus or a
merge order then costs seconds instead of a sweep. Timings are not replayed: speed comes from
eval/sweep.py.

The recording runs past the answer's end (`record_greedy`'s lookahead), so a last step that
drafts beyond an end-of-turn token is judged as the decode loop judges it (the loop's target
forward sees those positions too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.decode import generate
from selfspec.drafters.base import (
    DecodeSetup,
    DraftContext,
    Drafter,
    LearningDrafter,
    TargetFeatures,
)
from selfspec.files import write_atomically
from selfspec.metrics import GenerationStats
from selfspec.model import ModelOutput, Transformer
from selfspec.model.fingerprint import cache_key, weights_fingerprint
from selfspec.sampling import SamplingParams
from selfspec.tree import host_tree
from selfspec.verify import verify_greedy

LOOKAHEAD = 16  # greedy tokens recorded past the answer's end (deeper drafts: judged unaccepted)


@dataclass(frozen=True)
class GreedyRecord:
    """Plain greedy decoding of one prompt: `tokens` runs past the answer's end, and the first
    `answer_length` of them are what decoding emits (up to its stop token or token budget)."""

    prompt: list[int]
    tokens: list[int]
    answer_length: int

    @property
    def answer(self) -> list[int]:
        return self.tokens[: self.answer_length]


def cached_records(target: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   stop_ids: Sequence[int] = (), cache_dir: str | Path | None = None
                   ) -> list[GreedyRecord]:
    """`record_greedy` of every prompt, written once to cache_dir (JSON) and read back by later
    runs, keyed by the target's weights and these settings (as the training answers are)."""
    key = cache_key("greedy", weights_fingerprint(target), [list(p) for p in prompts],
                    max_new_tokens, list(stop_ids), LOOKAHEAD)
    path = None if cache_dir is None else Path(cache_dir) / f"{key}-greedy.json"
    if path is not None and path.is_file():
        return [GreedyRecord(**r) for r in json.loads(path.read_text())]
    records = [record_greedy(target, p, max_new_tokens, stop_ids) for p in prompts]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps([asdict(r) for r in records]))
    return records


def record_greedy(target: Transformer, prompt: Sequence[int], max_new_tokens: int,
                  stop_ids: Sequence[int] = (), lookahead: int = LOOKAHEAD) -> GreedyRecord:
    """Plain greedy decoding of `prompt`, continued `lookahead` tokens past its end."""
    tokens = generate(target, list(prompt), max_new_tokens=max_new_tokens + lookahead).tokens
    stops = [i + 1 for i, t in enumerate(tokens[:max_new_tokens]) if t in stop_ids]
    length = stops[0] if stops else max_new_tokens
    return GreedyRecord(list(prompt), tokens, length)


@torch.inference_mode()
def replay(target: Transformer, drafter: Drafter, record: GreedyRecord) -> GenerationStats:
    """The counters `generate(target, prompt, drafter=drafter)` would record at temperature 0
    (no timings): each step's draft is accepted along the longest path the recording continues.
    Drafters that run the target's early layers (early exit) are refused: their drafts live in
    the target's KV cache, which a replay does not keep; so are drafts with extra rows
    (Lookahead's window), whose logits only the loop's forward computes."""
    prompt, tokens = record.prompt, record.tokens
    device = target.embed_tokens.weight.device
    sequence = torch.tensor(prompt + tokens, device=device)  # moved once, sliced every step
    states = target(sequence[None, :-1], torch.arange(len(sequence) - 1, device=device),
                    return_hidden=drafter.target_layers)
    drafter.begin(DecodeSetup(target, sequence[: len(prompt)], SamplingParams(), None,
                              len(sequence) + drafter.max_nodes + 1))
    stats, done, fed = GenerationStats(), 0, 0  # fed: rows whose states reached the drafter
    while done < record.answer_length:
        length = len(prompt) + done  # committed tokens; the last is the step's root
        features = _rows(states, sequence, fed, length - 1)
        draft = drafter.propose(DraftContext(sequence[:length], features))
        if draft.early is not None or draft.extra is not None:  # only the loop runs them
            what = "the target's early layers" if draft.early is not None else "extra rows"
            raise ValueError(f"replay: {type(drafter).__name__} drafted with {what}, which only "
                             f"the decode loop verifies: measure it there (eval/sweep.py)")
        expected = _expected_after_nodes(draft.token_paths(), tokens[done:])
        tree = host_tree(draft.tree)
        accepted = verify_greedy(tree, draft.tokens.tolist(), expected).num_accepted
        stats.record_step(tree.num_nodes, tree.max_depth, accepted, position=done)
        fed, done = length - 1, min(done + accepted + 1, record.answer_length)
    stats.new_tokens = done
    if isinstance(drafter, LearningDrafter):  # as the loop tells it when the row stops
        drafter.finish(prompt + record.answer)
    return stats


def _expected_after_nodes(paths: list[tuple[int, ...]], ahead: list[int]) -> list[int]:
    """The target's greedy token after the root and after each node: the recording's next
    token where the node's path is the recording's, -1 (never a token) elsewhere."""
    def after(path: tuple[int, ...]) -> int:
        depth = len(path)
        on_answer = tuple(ahead[:depth]) == path and depth < len(ahead)
        return ahead[depth] if on_answer else -1

    return [ahead[0], *map(after, paths)]


def _rows(states: ModelOutput, sequence: torch.Tensor, start: int, end: int) -> TargetFeatures:
    """The target's states at rows [start, end): what the loop's last forward committed."""
    return TargetFeatures(tokens=sequence[start:end], last_hidden=states.last_hidden[0, start:end],
                          hidden=tuple(h[0, start:end] for h in states.hidden))
