"""Sampling settings and the one warping function shared by drafters and targets.

Speculative decoding is exact only if the draft and the target distributions are warped the
same way the plain decoder would warp them, so `logits_to_probs` is the single place where
temperature, top-k and top-p are applied.

Randomness: selfspec draws every random number from a `torch.Generator` the caller passes, on
the device of the probabilities it draws for (`torch.Generator(device="cuda:0")` for a target
on cuda:0). `check_generator` is the one place that enforces this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfspec.checks import is_count
from selfspec.ranking import ranked, ranked_on_device


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a next-token distribution.

    temperature: 0 means greedy (one-hot argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = keep all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = keep all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"SamplingParams: temperature must be a finite number >= 0 (0 = greedy), "
                f"got {self.temperature!r}"
            )
        if not is_count(self.top_k, 0):
            raise ValueError(
                f"SamplingParams: top_k must be an integer >= 0 (0 = no top-k), got {self.top_k!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"SamplingParams: top_p must lie in (0, 1] (1 = no nucleus filter), "
                f"got {self.top_p!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncated(self) -> bool:
        """Top-k or top-p cuts the law."""
        return bool(self.top_k) or self.top_p < 1.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, *, static: bool = False
                    ) -> torch.Tensor:
    """Warp logits [..., V] into probabilities [..., V] (float32) under `params`.

    Temperature 0 gives the one-hot argmax (lowest index on ties). Otherwise the order is
    temperature, then top-k, then top-p, as in Hugging Face `generate`; ties at a cut-off are
    broken towards the lower token index so the kept set is deterministic.

    static: for a static step (captured on CUDA), rank without a branch on the values, so
    nothing is read back: the same law, from a top-k cut that resolves its ties by tensor
    ops (`ranking.ranked_on_device`) and a nucleus over the whole sorted row.
    """
    logits = logits.float()
    if params.greedy:
        return _one_hot_argmax(logits)
    logits = logits / params.temperature
    if params.truncated:
        vocab = logits.shape[-1]
        kept = _filter_top_k_top_p(logits.reshape(-1, vocab), params.top_k, params.top_p,
                                   static)
        logits = kept.reshape(logits.shape)
    return torch.softmax(logits, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


# Top-p first ranks this many candidates and sorts the whole vocabulary only for a nucleus
# that reaches past them (a flat distribution): a 49k-token sort per position was a fifth of a
# sampled decoding step on a small real target.
NUCLEUS_WINDOW = 1024


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, static: bool
                        ) -> torch.Tensor:
    """Set to -inf every logit [R, V] outside the top-k / nucleus set."""
    vocab = logits.shape[-1]
    rank = ranked_on_device if static else ranked
    if 0 < top_k < vocab:
        order = rank(logits, top_k)
        keep = _nucleus(torch.softmax(logits.gather(-1, order), dim=-1), top_p)  # within top k
    else:
        probs = torch.softmax(logits, dim=-1)
        order = rank(logits, vocab if static else min(NUCLEUS_WINDOW, vocab))
        keep = _nucleus(probs.gather(-1, order), top_p)
        if not static and keep[..., -1].any():  # the nucleus reaches past the window
            order = rank(logits, vocab)
            keep = _nucleus(probs.gather(-1, order), top_p)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


def _nucleus(ranked_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which ranked tokens the nucleus keeps: each while the mass ranked before it is short of
    top_p (all of them when top_p is 1)."""
    if top_p >= 1.0:
        return torch.ones_like(ranked_probs, dtype=torch.bool)
    mass_before = torch.cumsum(ranked_probs, dim=-1) - ranked_probs
    return mass_before < top_p


def check_generator(
    generator: torch.Generator | None, device: torch.device | str, caller: str
) -> None:
    """Refuse a generator that is not a torch.Generator on `device` (where the probabilities
    live): torch cannot draw on one device with another device's generator.

    None passes: whether a generator is needed at all depends on the outcome (see `sample`).
    """
    if generator is None:
        return
    device = torch.device(device)
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"{caller}: generator must be a torch.Generator, got {type(generator).__name__}; "
            f"pass generator=torch.Generator(device='{device}').manual_seed(seed)"
        )
    if not _same_device(generator.device, device):
        raise ValueError(
            f"{caller}: the generator is on {generator.device} but the probabilities are on "
            f"{device}; pass generator=torch.Generator(device='{device}').manual_seed(seed)"
        )


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same type, and the same index where both name one ('cuda' means the current one)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a probability row [V] by inverse CDF.

    A zero-probability token is never returned (its CDF step has zero width), and a one-hot
    row is returned without touching the generator, so greedy decoding needs no RNG.
    A generator is required whenever the outcome is random: selfspec never uses torch's
    global RNG, so runs are reproducible from the seeds passed in. It must live on
    probs.device (see `check_generator`).
    """
    check_generator(generator, probs.device, "sample")
    support = torch.nonzero(probs > 0).flatten()
    if support.numel() == 1:
        return int(support[0])
    if support.numel() == 0:
        raise ValueError("sample: the probability row has no positive entry")
    _needs_generator(generator, probs.device)
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    return min(index, int(support[-1]))  # u rounded up to the total mass: take the last token


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [R, V], drawn by inverse CDF on the device, as `sample`
    draws it from one row but with nothing read back (and a uniform drawn for every row, a
    one-hot one too): [R] token ids, never one of probability zero."""
    _needs_generator(generator, probs.device)
    cdf = torch.cumsum(probs.double(), dim=-1)  # [R, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=probs.device) * cdf[:, -1:]
    index = torch.searchsorted(cdf, u, right=True)[:, 0]
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, -1).amax(dim=-1)  # u rounded up to the total mass
    return torch.minimum(index, last)


def draw(probs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
         ) -> int:
    """A drafted chain's next token from its law [V], as a host value: the one-hot argmax row
    read as it is (no generator), or a draw as `sample_rows` makes it, so that a chain drafted
    on the device (`sample_rows` there) draws the same tokens."""
    if sampling.greedy:
        return sample(probs, None)
    return int(sample_rows(probs[None], generator)[0])


def draw_on_device(logits: torch.Tensor, sampling: SamplingParams,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`draw`'s twin for a chain drafted on the device, nothing read back: the next token [1]
    after logits [V] or [1, V], the argmax (lowest id on ties) or a `sample_rows` draw, and
    the law [1, V] it was drawn from (None when greedy)."""
    logits = logits.reshape(1, -1)
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    law = logits_to_probs(logits, sampling, static=True)
    return sample_rows(law, generator), law


def gumbel_top(probs: torch.Tensor, count: int, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` distinct tokens per row of probs [R, V], in the order one-after-another draws
    without replacement would make them, by Gumbel-top-k: the top `count` of log p + Gumbel
    noise, the noise from one draw of R x V uniforms whatever the row (so a static, captured
    step draws exactly as a host-side one). Returns tokens [R, count] and drawn [R, count]:
    False where a row has fewer than `count` tokens of positive probability (those entries
    are not draws; their tokens are meaningless)."""
    _needs_generator(generator, probs.device)
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64,
                         device=probs.device).clamp_(min=torch.finfo(torch.float64).tiny)
    keys = probs.double().log() - torch.log(-torch.log(uniform))
    values, tokens = torch.topk(keys, count, dim=-1)
    return tokens, values > -math.inf


def _needs_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """A random draw needs the caller's generator: selfspec never uses torch's global RNG."""
    if generator is None:
        raise ValueError(f"sampling needs a torch.Generator: pass "
                         f"generator=torch.Generator(device='{device}').manual_seed(seed)")
