"""The single generation loop: prefill, propose, verify-forward, verify, commit, repeat.

`drafter=None` is plain autoregressive decoding through the same loop and cache. Batch size
is one. The root of each step is the last committed token, which is not yet in the target's
cache: the verification forward feeds [root, draft nodes...] in one pass, so its row 0 gives
the target's law after the root and row i+1 the law after node i.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from selfspec.devices import synchronize
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext, TargetFeatures
from selfspec.metrics import GenerationStats
from selfspec.model import ModelOutput, Transformer
from selfspec.sampling import SamplingParams, check_generator, logits_to_probs, sample
from selfspec.step import StaticSteps, static_steps, use_cuda_graphs
from selfspec.verify import Acceptance, verify_greedy, verify_trusted

if TYPE_CHECKING:  # annotations only
    from selfspec.drafters.base import Drafter, EarlyLayers


@dataclass(frozen=True)
class GenerationSettings:
    """What to generate, checked before any model loads: new tokens per prompt, the sampling
    law and the seed of the generator."""

    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    """tokens: the new tokens only (EOS included when reached); stats: what was measured."""

    tokens: list[int]
    stats: GenerationStats


@torch.inference_mode()
def generate(
    target: Transformer,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    drafter: Drafter | None = None,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    split_time: bool | None = None,
    cuda_graphs: bool | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` ([L] ids, batch of one).

    With a drafter, every step verifies its draft exactly (`selfspec.verify`), so the output
    law equals plain decoding's; at temperature 0 the tokens are identical. Stops after an EOS
    token or exactly at max_new_tokens.

    generator: a torch.Generator on the target's device, e.g.
    `torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)`; one on
    another device is refused (ValueError). An unseeded sampling run makes one there from a
    fresh seed.

    split_time: time every phase of every step into stats (`GenerationStats.time_split`).
    None: only where it is free, on the CPU; True: on any device, synchronizing it at every
    phase boundary; False: never (drafting time is measured in every case).

    cuda_graphs: None (auto) = on for a CUDA target. On, the verification forwards of up to
    128 tokens run as static-shape steps over a persistent cache, replayed from one CUDA graph
    per bucket of T (`selfspec.step`); on another device True runs the same static step
    eagerly. A draft model (`SmallModelDrafter`) runs static steps of its own alike; prefill,
    early-layer resumes and the other drafters' forwards stay eager.
    """
    prompt = _check_arguments(target, prompt_ids, sampling, max_new_tokens)
    check_generator(generator, prompt.device, "generate")
    if generator is None and not sampling.greedy:
        generator = torch.Generator(device=prompt.device).manual_seed(secrets.randbits(63))
    max_length = len(prompt) + max_new_tokens + (drafter.max_nodes if drafter else 0) + 1
    steps = (static_steps(target, max_length) if use_cuda_graphs(cuda_graphs, target)
             else None)
    cache = target.new_cache(max_slots=max_length) if steps is None else steps.cache
    if drafter is not None:
        drafter.begin(DecodeSetup(target, prompt, sampling, generator, max_length, cache,
                                  static_steps=steps is not None))
        cache.reset()  # begin may have generated with this target, in the same persistent cache
    layers = drafter.target_layers if drafter is not None else ()
    stop_ids = _stop_ids(eos_token_id)
    stats, history = GenerationStats(), prompt.tolist()
    clock = _PhaseClock(stats, prompt.device, split_time)
    start = clock.last
    features = _prefill(target, prompt[:-1], cache, layers) if len(prompt) > 1 else None
    stats.target_forwards += len(prompt) > 1
    clock.lap("prefill")
    new: list[int] = []
    extra_logits = None
    while len(new) < max_new_tokens and not (new and new[-1] in stop_ids):
        context = DraftContext(torch.tensor(history, device=prompt.device), features,
                               extra_logits)
        draft = _checked(drafter.propose(context), drafter) if drafter else Draft.empty()
        clock.lap("draft")
        acceptance, features, extra_logits = _step(target, steps, history[-1], draft, cache,
                                                   layers, sampling, generator, clock)
        stats.record_step(draft.tree.num_nodes, draft.tree.max_depth, acceptance.num_accepted,
                          rows=draft.rows)
        emitted = _until_stop(acceptance.tokens.tolist(), stop_ids, max_new_tokens - len(new))
        new += emitted
        history += emitted
        clock.lap("commit")
        stats.split_steps += clock.split
    stats.wall_time_s = time.perf_counter() - start
    stats.new_tokens = len(new)
    return GenerationResult(new, stats)


def _step(
    target: Transformer,
    steps: StaticSteps | None,
    root: int,
    draft: Draft,
    cache,
    layers: tuple[int, ...],
    sampling: SamplingParams,
    generator: torch.Generator | None,
    clock: _PhaseClock,
) -> tuple[Acceptance, TargetFeatures, torch.Tensor | None]:
    """One verification forward over [root, draft..., extra rows...], exact verification of
    the draft, cache commit; returns the extra rows' logits too."""
    base, device = cache.length, target.embed_tokens.weight.device
    tokens, offsets, mask = _forward_rows(root, draft, device)
    positions = base + offsets
    if draft.early is not None:
        out = _resume_after_early_layers(target, tokens, positions, cache, mask, layers,
                                         draft.early)
    elif steps is not None:
        out = steps.forward(tokens, positions, mask, layers)
    else:
        out = target(tokens, positions, cache, mask=mask, return_hidden=layers)
    clock.lap("forward")
    verified = draft.tree.num_nodes + 1
    acceptance = _verify_step(out.logits[0, :verified], draft, sampling, generator, clock)
    clock.lap("verify")
    rows = torch.tensor([0, *(i + 1 for i in acceptance.path.tolist())], device=device)
    cache.commit(base + rows)
    extra_logits = out.logits[0, verified:] if draft.extra is not None else None
    return acceptance, _features(out, tokens[0, rows], rows), extra_logits


def _forward_rows(root: int, draft: Draft, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verification forward's tokens [1, T], position offsets [T] and mask [T, T]: the
    root and the draft's nodes under its tree mask, then any extra rows, which see the root
    and each other as their mask says and which no node sees."""
    tokens = torch.cat([torch.tensor([root], device=device), draft.tokens.to(device)])
    offsets, mask = draft.tree.verification_inputs(device)  # [N+1], [N+1, N+1]
    extra = draft.extra
    if extra is None:
        return tokens[None], offsets, mask
    if draft.early is not None:
        raise ValueError("a draft cannot carry extra rows and early layers at once")
    nodes, rows = mask.shape[0], extra.rows
    full = torch.zeros(nodes + rows, nodes + rows, dtype=torch.bool, device=device)
    full[:nodes, :nodes] = mask
    full[nodes:, 0] = extra.mask[:, 0].to(device)
    full[nodes:, nodes:] = extra.mask[:, 1:].to(device)
    return (torch.cat([tokens, extra.tokens.to(device)])[None],
            torch.cat([offsets, extra.offsets.to(device)]), full)


def _verify_step(
    logits: torch.Tensor,  # [N+1, V]
    draft: Draft,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    clock: _PhaseClock,
) -> Acceptance:
    """What the step keeps. Greedy: the argmax rows, read back once, decide (the one-hot
    probabilities they stand for are never built); otherwise the target's law from
    `logits_to_probs` and recursive rejection sampling. Drafts and laws built by this loop
    are well-formed, so the public verifier's input checks are not repeated every step."""
    if sampling.greedy:
        target_tokens = logits.float().argmax(dim=-1).tolist()  # the one device read
        clock.lap("probs")
        return verify_greedy(draft.tree, draft.tokens.tolist(), target_tokens)
    p = logits_to_probs(logits, sampling)  # [N+1, V]
    clock.lap("probs")
    if draft.tree.num_nodes == 0:  # plain decoding: nothing to verify
        token = torch.tensor([sample(p[0], generator)], device=p.device)
        return Acceptance(token, 0, torch.empty(0, dtype=torch.long, device=p.device))
    q = None if draft.q is None else draft.q.to(p.device)  # a draft model may live elsewhere
    return verify_trusted(draft.tree, draft.tokens.to(p.device), q, p, generator,
                          draft.without_replacement)


class _PhaseClock:
    """Adds the time since the previous lap to a phase's counter in stats.

    On the CPU a timer read at a phase boundary is exact, so every phase is timed for free.
    CUDA (and MPS) run kernels asynchronously: a boundary means something only after a device
    synchronize, and a synchronize per phase would slow the default path. So there the phases
    are timed only when the caller asks (split_time=True: benchmarks, sweeps), synchronizing at
    each boundary; otherwise only the draft is timed, as a host-side figure."""

    def __init__(self, stats: GenerationStats, device: torch.device, split: bool | None):
        self.stats, self.device = stats, device
        self.split = device.type == "cpu" if split is None else bool(split)
        if self.split:
            synchronize(device)  # work queued before generation is not the prefill's
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.split:
            synchronize(self.device)
        now = time.perf_counter()
        if self.split or phase == "draft":
            name = f"{phase}_time_s"
            setattr(self.stats, name, getattr(self.stats, name) + now - self.last)
        self.last = now


def _resume_after_early_layers(
    target: Transformer,
    tokens: torch.Tensor,  # [1, N+1]
    positions: torch.Tensor,  # [N+1]
    cache,
    mask: torch.Tensor,  # [N+1, N+1]
    layers: tuple[int, ...],
    early: EarlyLayers,
) -> ModelOutput:
    """The verification forward of a draft that already ran layers [0, E) over its first n
    rows (K/V in the cache, residual streams in early.hidden): layers [0, E) over the other
    rows only, then layers [E, L) over every row. Same logits as a full forward."""
    exit_layer, base = early.exit_layer, cache.length
    n = _check_early_layers(target, tokens.shape[1], layers, early)
    hidden = early.hidden[None].to(target.embed_tokens.weight)  # [1, n, H]
    if n < tokens.shape[1]:
        cache.advance(n)  # the drafted rows' early K/V are already in their slots
        past_cols = torch.ones(tokens.shape[1] - n, base, dtype=torch.bool, device=mask.device)
        rest = target(tokens[:, n:], positions[n:], cache,
                      mask=torch.cat([past_cols, mask[n:]], dim=1), exit_layer=exit_layer,
                      return_hidden=(exit_layer,), with_logits=False)
        hidden = torch.cat([hidden, rest.hidden[0]], dim=1)  # [1, N+1, H]
        cache.truncate(base)
    return target(tokens, positions, cache, mask=mask, return_hidden=layers,
                  start_layer=exit_layer, hidden_in=hidden)


def _check_early_layers(
    target: Transformer, rows: int, layers: tuple[int, ...], early: EarlyLayers
) -> int:
    """The number of rows whose early layers ran, or a clear error for an inconsistent draft."""
    n, exit_layer = early.hidden.shape[0], early.exit_layer
    if not 1 <= exit_layer < target.config.num_layers or not 1 <= n <= rows:
        raise ValueError(
            f"a draft's early layers must be [0, E) with 1 <= E < {target.config.num_layers} "
            f"over 1..{rows} rows, got E={exit_layer} over {n} rows")
    if any(layer < exit_layer for layer in layers):
        raise ValueError(f"the drafter asks for target layers {list(layers)} below the layer "
                         f"{exit_layer} its verification starts at")
    return n


def _prefill(
    target: Transformer, tokens: torch.Tensor, cache, layers: tuple[int, ...]
) -> TargetFeatures:
    positions = torch.arange(len(tokens), device=tokens.device)
    out = target(tokens[None], positions, cache, return_hidden=layers)
    return _features(out, tokens, torch.arange(len(tokens), device=tokens.device))


def _features(out: ModelOutput, tokens: torch.Tensor, rows: torch.Tensor) -> TargetFeatures:
    """The target's states at the committed rows of a forward (batch row 0)."""
    return TargetFeatures(
        tokens=tokens,
        last_hidden=out.last_hidden[0, rows],
        hidden=tuple(h[0, rows] for h in out.hidden),
    )


def _until_stop(tokens: list[int], stop_ids: set[int], room: int) -> list[int]:
    """Cut a step's tokens after the first stop token and to the room left."""
    for i, token in enumerate(tokens[:room]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:room]


def _stop_ids(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _checked(draft: Draft, drafter: Drafter) -> Draft:
    if draft.tokens.shape != (draft.tree.num_nodes,) or draft.rows > drafter.max_nodes:
        raise ValueError(
            f"{type(drafter).__name__} proposed {draft.tokens.shape[0]} tokens for a tree of "
            f"{draft.tree.num_nodes} nodes and {draft.rows - draft.tree.num_nodes} extra rows "
            f"(its max_nodes is {drafter.max_nodes})"
        )
    return draft


def _check_arguments(
    target: Transformer, prompt_ids, sampling: SamplingParams, max_new_tokens: int
) -> torch.Tensor:
    """The prompt as a 1-D LongTensor on the target's device, or a clear error."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"generate: sampling must be a SamplingParams, got {sampling!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise ValueError("generate: the prompt is empty; give at least one token (e.g. BOS)")
    vocab, limit = target.config.vocab_size, target.config.max_position_embeddings
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"generate: prompt ids must lie in [0, {vocab}) (the vocab size)")
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(
            f"generate: prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's {limit} positions (max_position_embeddings); shorten the prompt or "
            f"lower max_new_tokens"
        )
    return prompt.to(target.embed_tokens.weight.device)
