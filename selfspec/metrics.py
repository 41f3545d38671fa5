"""What a generation measures: acceptance, mean accepted length tau, speed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Counters of one `generate` call; the derived figures are properties.

    tau counts the bonus/corrected token: plain decoding has tau = 1.
    position_drafted[d] / position_accepted[d]: steps whose draft reached depth d+1, and
    those that accepted a token at that depth.
    """

    new_tokens: int = 0
    steps: int = 0  # verification forwards of the target
    target_forwards: int = 0  # steps plus the prefill
    drafted: int = 0  # draft nodes proposed
    accepted: int = 0  # draft tokens accepted
    accept_histogram: list[int] = field(default_factory=list)  # steps by tokens accepted
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0

    def record_step(self, draft_nodes: int, draft_depth: int, num_accepted: int) -> None:
        self.steps += 1
        self.target_forwards += 1
        self.drafted += draft_nodes
        self.accepted += num_accepted
        _bump(self.accept_histogram, num_accepted)
        for depth in range(draft_depth):
            _bump(self.position_drafted, depth)
            _bump(self.position_accepted, depth, by=int(depth < num_accepted))

    def merge(self, other: GenerationStats) -> None:
        """Add another generation's counters to these (a pass over many prompts)."""
        for name in ("new_tokens", "steps", "target_forwards", "drafted", "accepted",
                     "wall_time_s", "draft_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accept_histogram", "position_drafted", "position_accepted"):
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
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def as_dict(self) -> dict:
        """Counters and derived figures, for JSON records."""
        return {
            **{k: v for k, v in vars(self).items()},
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "tokens_per_s": self.tokens_per_s,
        }


def _bump(counts: list[int], index: int, by: int = 1) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += by
