"""What a target forward costs on the running machine, measured in the same process.

c(N) is the wall time of one target forward over N new tokens (over a cache of a given length)
divided by that of a forward over one token. A speculative step that verifies N draft nodes
costs c(N + 1) plain steps plus its drafting, so tau / (c(N + 1) + draft cost) bounds the
speedup over plain decoding that acceptance alone allows (docs/design.md, "Every speedup is
explained").

On a mixture-of-experts target a forward's cost follows the experts it reads: c(N) comes with
the distinct experts a forward of N new tokens touches, per MoE layer (`experts_touched`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.devices import synchronize
from selfspec.model import Transformer
from selfspec.step import static_steps, use_cuda_graphs

DEFAULT_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
PROFILE_MAX_TOKENS = 64  # covering_lengths' cap


def covering_lengths(tokens: int, cap: int = PROFILE_MAX_TOKENS) -> tuple[int, ...]:
    """Forward lengths to profile so that c is measured, or taken at a near length above, for
    every forward of up to `tokens` tokens (at most `cap`): every length up to 16, then
    DEFAULT_LENGTHS up to the first one that reaches `tokens`."""
    tokens = max(1, min(int(tokens), cap, DEFAULT_LENGTHS[-1]))
    if tokens <= 16:
        return tuple(range(1, tokens + 1))
    reach = next(n for n in DEFAULT_LENGTHS if n >= tokens)
    return (*range(1, 17), *(n for n in DEFAULT_LENGTHS if 16 < n <= reach))


@dataclass(frozen=True)
class CostProfile:
    """seconds[N]: median seconds of a forward over N new tokens after cache_length tokens,
    for each of batch_size rows (c_B(N) at batch B: a batch's step against its plain step)."""

    seconds: dict[int, float]
    cache_length: int
    device: str
    dtype: str
    batch_size: int = 1
    experts_touched: dict[int, float] | None = None  # a MoE target's, by N (`experts_touched`)

    def c(self, n: float) -> float:
        """c(n) = seconds(n) / seconds(1); between measured lengths (or at a fractional n, a
        mean), the next one above."""
        if n < 1:
            raise ValueError(f"CostProfile.c: n must be >= 1, got {n}")
        above = [m for m in sorted(self.seconds) if m >= n]
        if not above:
            raise ValueError(f"CostProfile.c: measured up to N={max(self.seconds)}, not {n}")
        return self.seconds[above[0]] / self.seconds[1]

    def bound(self, tau: float, nodes: int | Sequence[int], draft_cost: float = 0.0) -> float:
        """The speedup tau allows when a step verifies `nodes` draft nodes (a forward over
        nodes + 1 tokens) and drafting costs `draft_cost` one-token forwards. Steps of several
        sizes: nodes[n] = the steps that verified n draft nodes (`GenerationStats.
        nodes_histogram`), and the forward costs the mean of c(n + 1) over those steps."""
        if isinstance(nodes, int):
            return tau / (self.c(nodes + 1) + draft_cost)
        steps = sum(nodes)
        if steps < 1 or min(nodes) < 0:
            raise ValueError(f"CostProfile.bound: nodes must count steps by draft size, got "
                             f"{list(nodes)}")
        forward = sum(count * self.c(n + 1) for n, count in enumerate(nodes) if count) / steps
        return tau / (forward + draft_cost)

    def as_dict(self) -> dict:
        figures = {"cache_length": self.cache_length, "device": self.device, "dtype": self.dtype,
                   "batch_size": self.batch_size, "one_token_ms": 1000 * self.seconds[1],
                   "c": {n: self.c(n) for n in sorted(self.seconds)}}
        if self.experts_touched is not None:
            figures["experts_touched"] = self.experts_touched
        return figures


@torch.inference_mode()
def measure_cost_profile(
    target: Transformer,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    cache_length: int = 200,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
    cuda_graphs: bool | None = None,
    batch_size: int = 1,
) -> CostProfile:
    """Time target forwards of every N in lengths over a cache of cache_length random tokens,
    as `generate` runs them: cuda_graphs as its (None: replayed CUDA graphs on a CUDA target;
    a batch runs eagerly), over batch_size rows of N tokens each.

    The lengths are measured in interleaved rounds, so drift of the machine's speed hits all
    of them alike; each figure is the median over `repeats` rounds after `warmup` rounds.
    """
    lengths = sorted({1, *(int(n) for n in lengths)})
    if lengths[0] < 1 or repeats < 1 or warmup < 0 or cache_length < 1:
        raise ValueError("measure_cost_profile: lengths and cache_length must be >= 1, "
                         "repeats >= 1 and warmup >= 0")
    weight = target.embed_tokens.weight
    generator = torch.Generator(weight.device).manual_seed(seed)
    vocab = target.config.vocab_size

    def random_tokens(n: int) -> torch.Tensor:
        return torch.randint(vocab, (batch_size, n), generator=generator, device=weight.device)

    steps = (static_steps(target, cache_length + lengths[-1])
             if batch_size == 1 and use_cuda_graphs(cuda_graphs, target) else None)
    cache = (target.new_cache(batch_size, max_slots=cache_length + lengths[-1])
             if steps is None else steps.cache)
    target(random_tokens(cache_length), torch.arange(cache_length, device=weight.device), cache)

    def forward(tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if steps is None:
            target(tokens, positions, cache)
        else:
            steps.forward(tokens, positions, None)

    times: dict[int, list[float]] = {n: [] for n in lengths}
    for round_ in range(warmup + repeats):
        for n in lengths:
            seconds = _timed_forward(forward, random_tokens(n), cache, cache_length)
            if round_ >= warmup:
                times[n].append(seconds)
    cache.truncate(cache_length)
    touched = (experts_touched(target, lengths, cache, generator, batch_size)
               if target.config.num_experts else None)
    return CostProfile({n: statistics.median(t) for n, t in times.items()}, cache_length,
                       str(weight.device), str(weight.dtype).removeprefix("torch."), batch_size,
                       touched)


@torch.inference_mode()
def experts_touched(target: Transformer, lengths: Sequence[int], cache,
                    generator: torch.Generator | None = None, batch_size: int = 1
                    ) -> dict[int, float]:
    """{N: the distinct experts a forward of N random new tokens (batch_size rows of them)
    over `cache` routes to, the mean over the target's MoE layers}: the expert weights a
    verification of N tokens reads, against E per layer for a dense read. The cache is left
    at its length; the routing is read back from each layer's router (a measurement, not a
    decode step)."""
    routers = [target.layers[i].mlp for i in sorted(target.config.moe_layers)]
    counts: list[int] = []

    def count(moe, inputs, _output) -> None:
        experts = moe.route(inputs[0].reshape(-1, inputs[0].shape[-1])).experts
        counts.append(experts.unique().numel())

    hooks = [moe.register_forward_hook(count) for moe in routers]
    device, length = target.embed_tokens.weight.device, cache.length
    touched = {}
    try:
        for n in lengths:
            counts.clear()
            tokens = torch.randint(target.config.vocab_size, (batch_size, n),
                                   generator=generator, device=device)
            target(tokens, torch.arange(length, length + n, device=device), cache)
            cache.truncate(length)
            touched[n] = sum(counts) / len(counts)
    finally:
        for hook in hooks:
            hook.remove()
    return touched


def _timed_forward(forward, tokens: torch.Tensor, cache, cache_length: int) -> float:
    positions = torch.arange(cache_length, cache_length + tokens.shape[1], device=tokens.device)
    synchronize(tokens.device)
    start = time.perf_counter()
    forward(tokens, positions)
    synchronize(tokens.device)
    seconds = time.perf_counter() - start
    cache.truncate(cache_length)
    return seconds
