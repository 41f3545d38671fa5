"""What a generation measures: acceptance, mean accepted length tau, speed, and where the
time of a step goes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# The timed phases of a generation, in loop order: the prefill (once per generation), then per
# step the draft, the verification forward (building its inputs included), turning its logits
# into probabilities, verification (plain decoding: sampling the token), and the commit (the
# cache commit, the target features for the drafter, reading the tokens back, stop checks).
PHASES = ("prefill", "draft", "forward", "probs", "verify", "commit")
# What no phase covers: setup before the prefill (the cache, drafter.begin) and whatever a
# caller's timer adds around generate.
OTHER = "other"
# tau against position in the answer: steps, and the tokens they yielded, counted by the span
# of this many new tokens each step started in (long answers: does acceptance hold up?)
POSITION_SPAN = 128


@dataclass
class GenerationStats:
    """Counters of one `generate` call; the derived figures are properties.

    tau counts the bonus/corrected token: plain decoding has tau = 1.
    position_drafted[d] / position_accepted[d]: steps whose draft reached depth d+1, and
    those that accepted a token at that depth. steps_by_span[s] / tokens_by_span[s]: steps
    that started at new tokens [s * POSITION_SPAN, (s + 1) * POSITION_SPAN) of the answer, and
    the tokens they yielded (accepted drafts plus the target's own).
    """

    new_tokens: int = 0
    steps: int = 0  # verification forwards of the target
    target_forwards: int = 0  # steps plus the prefill
    drafted: int = 0  # draft nodes proposed
    accepted: int = 0  # draft tokens accepted
    accept_histogram: list[int] = field(default_factory=list)  # steps by tokens accepted
    nodes_histogram: list[int] = field(default_factory=list)  # steps by rows drafts added
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    steps_by_span: list[int] = field(default_factory=list)
    tokens_by_span: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0  # measured even when the other phases are not (see decode.py)
    prefill_time_s: float = 0.0
    forward_time_s: float = 0.0
    probs_time_s: float = 0.0
    verify_time_s: float = 0.0
    commit_time_s: float = 0.0
    split_steps: int = 0  # steps whose every phase was timed (generate's split_time)
    # Verification forwards of the loop: a batch's steps, which its rows share (one row's
    # steps: as many as it took part in); for one prompt, steps.
    loop_steps: int = 0

    def record_step(self, draft_nodes: int, draft_depth: int, num_accepted: int,
                    rows: int | None = None, position: int | None = None) -> None:
        """rows: what the draft added to the verification forward (its nodes, and extra rows
        such as Lookahead's window; default: the nodes), which sizes the forward's cost.
        position: the new tokens of the answer before this step (None: not counted by span)."""
        if position is not None:
            _bump(self.steps_by_span, position // POSITION_SPAN)
            _bump(self.tokens_by_span, position // POSITION_SPAN, by=num_accepted + 1)
        self.steps += 1
        self.target_forwards += 1
        self.drafted += draft_nodes
        self.accepted += num_accepted
        _bump(self.accept_histogram, num_accepted)
        _bump(self.nodes_histogram, draft_nodes if rows is None else rows)
        for depth in range(draft_depth):
            _bump(self.position_drafted, depth)
            _bump(self.position_accepted, depth, by=int(depth < num_accepted))

    def merge(self, other: GenerationStats) -> None:
        """Add another generation's counters to these (a pass over many prompts)."""
        for name in ("new_tokens", "steps", "target_forwards", "drafted", "accepted",
                     "wall_time_s", "split_steps", "loop_steps",
                     *(f"{p}_time_s" for p in PHASES)):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accept_histogram", "nodes_histogram", "position_drafted",
                     "position_accepted", "steps_by_span", "tokens_by_span"):
            counts, more = getattr(self, name), getattr(other, name)
            counts.extend([0] * (len(more) - len(counts)))
            for i, value in enumerate(more):
                counts[i] += value

    @property
    def tau(self) -> float:
        """Mean tokens a verification step yields (accepted drafts + one target token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted depth (for a chain: over drafted tokens)."""
        drafted_depth = sum(self.position_drafted)
        return self.accepted / drafted_depth if drafted_depth else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        pairs = zip(self.position_accepted, self.position_drafted, strict=True)
        return [accepted / drafted for accepted, drafted in pairs]

    @property
    def tau_by_position(self) -> list[float | None]:
        """tau of the steps that started in each span of POSITION_SPAN new tokens (None: a
        span no step started in)."""
        pairs = zip(self.tokens_by_span, self.steps_by_span, strict=True)
        return [tokens / steps if steps else None for tokens, steps in pairs]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def nodes_per_step(self) -> float:
        """Mean draft nodes a step proposed (a step's verification forward feeds one more)."""
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def time_split(self) -> dict[str, dict[str, float]] | None:
        """{phase: {"s_per_step": seconds per verification step, "share": of wall time}} for
        every phase in PHASES and OTHER, the wall time left over by the timed phases (never
        forced to zero). The prefill has its own bucket, spread over the steps like the rest.
        None unless every step was timed phase by phase (see generate's split_time)."""
        if not self.steps or self.split_steps != self.steps or self.wall_time_s <= 0:
            return None
        seconds = {phase: getattr(self, f"{phase}_time_s") for phase in PHASES}
        seconds[OTHER] = self.wall_time_s - sum(seconds.values())
        return {phase: {"s_per_step": s / self.steps, "share": s / self.wall_time_s}
                for phase, s in seconds.items()}

    def as_dict(self) -> dict:
        """Counters and derived figures, for JSON records."""
        return {
            **{k: v for k, v in vars(self).items()},
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "tau_by_position": self.tau_by_position,
            "tokens_per_s": self.tokens_per_s,
            "time_split": self.time_split,
        }


# What a batch's rows share (`generate` gives each row the batch's figures): counted once
# when their stats are merged.
SHARED_BY_ROWS = ("split_steps", "loop_steps", *(f"{p}_time_s" for p in PHASES))


@dataclass(frozen=True)
class TauEstimate:
    """tau over several prompts, pooled (their accepted tokens and steps summed, as
    `GenerationStats.merge` does), with its standard error over prompts: the ratio
    estimator's, by the delta method (NaN with fewer than two prompts). With equal steps per
    prompt it is the standard deviation of the prompts' tau over sqrt(prompts)."""

    tau: float
    standard_error: float
    prompts: int

    @classmethod
    def of(cls, per_prompt: Sequence[GenerationStats]) -> TauEstimate:
        n = len(per_prompt)
        steps = [s.steps for s in per_prompt]
        tokens = [s.accepted + s.steps for s in per_prompt]  # what the steps emitted
        if not sum(steps):
            return cls(0.0, math.nan, n)
        tau = sum(tokens) / sum(steps)
        if n < 2:
            return cls(tau, math.nan, n)
        spread = sum((y - tau * x) ** 2 for y, x in zip(tokens, steps, strict=True))
        return cls(tau, math.sqrt(spread / (n * (n - 1))) / (sum(steps) / n), n)


def describe_split(split: dict[str, dict[str, float]] | None) -> str:
    """A time split as one short line: each phase's share of the wall time in percent."""
    if split is None:
        return "split not measured"
    return " ".join(f"{phase} {100 * split[phase]['share']:.0f}%" for phase in (*PHASES, OTHER))


def _bump(counts: list[int], index: int, by: int = 1) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += by
