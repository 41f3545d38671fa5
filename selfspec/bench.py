"""Side-by-side measurement of a drafter against plain decoding of the same target.

Speedup is a ratio of tokens per second measured in the same process on the same prompts,
plain and speculative runs interleaved prompt by prompt so that machine drift hits both; a
warm-up generation is excluded. Next to every speedup stands a repetition measure: a small
model's greedy output can collapse into loops that any drafter predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from selfspec.decode import GenerationResult, generate
from selfspec.drafters.base import Drafter
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams


@dataclass
class RunSummary:
    """Totals of one method over a prompt set."""

    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    accepted: int = 0
    drafted_depth: int = 0
    draft_seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        stats = result.stats
        self.new_tokens += stats.new_tokens
        self.seconds += stats.wall_time_s
        self.steps += stats.steps
        self.accepted += stats.accepted
        self.drafted_depth += sum(stats.position_drafted)
        self.draft_seconds += stats.draft_time_s
        self.outputs.append(result.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Comparison:
    """A drafter against plain decoding: tau counts the bonus token; speedup is the ratio of
    tokens/s; lossless is None when sampling (outputs may then differ and still be exact)."""

    tau: float
    acceptance_rate: float
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float
    draft_time_share: float
    repeated_4gram_share: float
    lossless: bool | None
    prompts: int
    new_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def compare_with_plain(
    target: Transformer,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    seed: int = 0,
) -> Comparison:
    """Generate every prompt with plain decoding and with the drafter, interleaved."""
    if not prompts:
        raise ValueError("compare_with_plain: no prompts to measure on")
    generate(target, prompts[0], max_new_tokens=4)  # warm-up, excluded
    plain, drafted = RunSummary(), RunSummary()
    for i, prompt in enumerate(prompts):
        for summary, method in ((plain, None), (drafted, drafter)):
            g = torch.Generator().manual_seed(seed + i)
            summary.add(generate(target, prompt, drafter=method, sampling=sampling,
                                 max_new_tokens=max_new_tokens, generator=g))
    lossless = plain.outputs == drafted.outputs if sampling.greedy else None
    return Comparison(
        tau=drafted.tau,
        acceptance_rate=drafted.accepted / drafted.drafted_depth if drafted.drafted_depth else 0.0,
        tokens_per_s=drafted.tokens_per_s,
        plain_tokens_per_s=plain.tokens_per_s,
        speedup=drafted.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0,
        draft_time_share=drafted.draft_seconds / drafted.seconds if drafted.seconds else 0.0,
        repeated_4gram_share=repeated_ngram_share(drafted.outputs, 4),
        lossless=lossless,
        prompts=len(prompts),
        new_tokens=drafted.new_tokens,
    )


def repeated_ngram_share(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of n-grams in the outputs that repeat an earlier n-gram of the same output."""
    total = repeated = 0
    for tokens in outputs:
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0
