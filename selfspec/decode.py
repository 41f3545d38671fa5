"""The single generation loop: prefill, propose, verify-forward, verify, commit, repeat.

`drafter=None` is plain autoregressive decoding through the same loop and cache. The loop
runs over the rows of a batch (one prompt is a batch of one): each row's root is its last
committed token, which is not yet in the target's cache, so the verification forward feeds
[root, draft nodes...] in one pass: its row 0 gives the target's law after the root and row
i+1 the law after node i.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.checks import is_count
from selfspec.devices import synchronize
from selfspec.drafters.base import (
    BatchDrafter,
    DecodeSetup,
    Draft,
    DraftContext,
    LearningDrafter,
    TargetFeatures,
    fork,
)
from selfspec.metrics import PHASES, GenerationStats
from selfspec.model import ModelOutput, Transformer
from selfspec.model.kv_cache import BatchRows, KVCache, RowSlots, pad_rows
from selfspec.sampling import (
    SamplingParams,
    check_generator,
    logits_to_probs,
    sample,
    sample_rows,
)
from selfspec.step import StaticSteps, static_steps, use_cuda_graphs
from selfspec.tree import DeviceTree, Tree, host_tree
from selfspec.verify import greedy_path, tree_draws, tree_outcome, verify_trusted

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
        if not is_count(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    """tokens: the new tokens only (EOS included when reached); stats: what was measured."""

    tokens: list[int]
    stats: GenerationStats


@torch.inference_mode()
def generate(
    target: Transformer,
    prompt_ids: torch.Tensor | Sequence[int] | Sequence[torch.Tensor | Sequence[int]],
    *,
    drafter: Drafter | None = None,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    split_time: bool | None = None,
    cuda_graphs: bool | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`: one prompt ([L] ids) gives
    one GenerationResult; a list of prompts (each a sequence or 1-D tensor of ids, of any
    lengths) gives a list of results in their order, decoded together as a batch.

    With a drafter, every step verifies its draft exactly (`selfspec.verify`), so the output
    law equals plain decoding's; at temperature 0 the tokens are identical. Stops after an EOS
    token or exactly at max_new_tokens.

    A batch runs the same loop: each row has its own drafter (the one given for row 0, a
    `fork` of it for the others; a `BatchDrafter` drafts every row itself), cache length,
    positions, draft, acceptance, commit and stop, and its output is what it would be
    decoded alone (at temperature 0 the same tokens). One forward verifies every row's
    draft, each padded to the longest with rows that attend to themselves alone and are
    never accepted. A row that stops leaves: the others move to the first rows of the cache
    and go on. Drafts that ran the target's early layers (early exit) are verified row by
    row.

    generator: a torch.Generator on the target's device, e.g.
    `torch.Generator(device=target.embed_tokens.weight.device).manual_seed(seed)`; one on
    another device is refused (ValueError). An unseeded sampling run makes one there from a
    fresh seed. A batch's rows draw from it in turn.

    split_time: time every phase of every step into stats (`GenerationStats.time_split`).
    None: only where it is free, on the CPU; True: on any device, synchronizing it at every
    phase boundary; False: never (drafting time is measured in every case). A batch's rows
    share its phases' times; each row's wall time ends at its last token.

    cuda_graphs: None (auto) = on for a CUDA target. On, the verification forwards of up to
    128 tokens run as static-shape steps over a persistent cache, replayed from one CUDA
    graph per bucket of (rows, T) (`selfspec.step`); on another device True runs the same
    static step eagerly. Decoding one prompt, the drafters draft in static steps of their own
    alike (EAGLE, Medusa, early exit, a draft model: docs/gpu.md), and a step reads the
    device back once; prefill, early-layer resumes, a confidence stop and a batch's drafters
    stay eager.
    """
    batch = _is_batch(prompt_ids)
    prompts = _check_prompts(target, prompt_ids if batch else [prompt_ids], sampling,
                             max_new_tokens)
    check_generator(generator, prompts[0].device, "generate")
    if generator is None and not sampling.greedy:
        generator = torch.Generator(device=prompts[0].device).manual_seed(secrets.randbits(63))
    results = _decode(target, prompts, drafter, sampling, max_new_tokens,
                      _stop_ids(eos_token_id), generator, split_time,
                      _static_steps(target, prompts, drafter, max_new_tokens, cuda_graphs))
    return results if batch else results[0]


@dataclass
class _Row:
    """One prompt of a batch as the loop carries it: its drafter, its own view of the
    batch's cache, what it generated, and what its last verification left for its drafter."""

    index: int  # its row of the batch
    drafter: Drafter | None
    cache: KVCache
    history: list[int]
    new: list[int] = field(default_factory=list)
    features: TargetFeatures | None = None
    extra_logits: torch.Tensor | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    done: bool = False

    def context(self, device: torch.device) -> DraftContext:
        return DraftContext(torch.tensor(self.history, device=device), self.features,
                            self.extra_logits, tuple(self.history))


def _decode(
    target: Transformer,
    prompts: list[torch.Tensor],
    drafter: Drafter | None,
    sampling: SamplingParams,
    max_new_tokens: int,
    stop_ids: set[int],
    generator: torch.Generator | None,
    split_time: bool | None,
    steps: StaticSteps | None,
) -> list[GenerationResult]:
    """The loop: prefill, propose, verify-forward, verify, commit, repeat, for every row."""
    device = prompts[0].device
    max_length = _max_length(prompts, drafter, max_new_tokens)
    caches = BatchRows(steps.cache if steps is not None
                       else target.new_cache(batch_size=len(prompts), max_slots=max_length),
                       len(prompts))
    together = drafter if len(prompts) > 1 and isinstance(drafter, BatchDrafter) else None
    rows = [_Row(b, row_drafter, caches.views[b], prompt.tolist()) for b, (prompt, row_drafter)
            in enumerate(zip(prompts, _drafters(drafter, len(prompts), together), strict=True))]
    # A batch's drafters run eagerly: a row's static steps would be its own.
    setups = [DecodeSetup(target, prompt, sampling, generator, max_length, row.cache,
                          static_steps=steps is not None and len(rows) == 1, rows=len(rows))
              for row, prompt in zip(rows, prompts, strict=True)]
    if together is not None:
        together.begin_rows(setups)
    elif drafter is not None:
        for row, setup in zip(rows, setups, strict=True):
            row.drafter.begin(setup)
    for row in rows:
        row.cache.reset()  # begin may have generated with this target, in the same cache
    layers = drafter.target_layers if drafter is not None else ()
    timing = GenerationStats()
    clock = _PhaseClock(timing, device, split_time)
    loop = _Loop(target, steps, layers, sampling, generator, clock)
    start = clock.last
    _prefill_rows(target, rows, [prompt[:-1] for prompt in prompts], caches, layers)
    clock.lap("prefill")
    active = list(rows)
    while active:
        drafts = _proposed(active, together, device)
        clock.lap("draft")
        outcomes = _verify_rows(loop, active, drafts, caches)
        for row, draft, outcome in zip(active, drafts, outcomes, strict=True):
            _commit(row, draft, outcome, stop_ids, max_new_tokens)
        clock.lap("commit")
        timing.split_steps += clock.split
        timing.loop_steps += 1
        if any(row.done for row in active):
            for row in active:  # a row's wall time ends with the step that finished it
                if row.done:
                    row.stats.wall_time_s = clock.last - start
                    if isinstance(row.drafter, LearningDrafter):
                        row.drafter.finish(row.history)
            active = [row for row in active if not row.done]
            caches.pack([row.index for row in active])
    return [GenerationResult(row.new, _finished(row, timing)) for row in rows]


def _proposed(rows: list[_Row], together: BatchDrafter | None, device: torch.device
              ) -> list[Draft]:
    """Each row's draft: from its drafter, or from a batch drafter's `propose_rows` for all."""
    if rows[0].drafter is None:
        return [Draft.empty() for _ in rows]
    contexts = [row.context(device) for row in rows]
    drafts = (together.propose_rows([row.index for row in rows], contexts)
              if together is not None
              else [row.drafter.propose(context) for row, context in zip(rows, contexts,
                                                                            strict=True)])
    return [_checked(draft, row.drafter) for draft, row in zip(drafts, rows, strict=True)]


@dataclass(frozen=True)
class _Kept:
    """What a row's verification keeps, as host values: the tree it verified, the tokens it
    emits (the accepted nodes', then one corrected or bonus token) and the accepted nodes,
    as indices of the draft's rows (the tree's own, unless rows of the draft are not nodes:
    `DeviceTree.valid`)."""

    tree: Tree
    tokens: list[int]
    path: list[int]


@dataclass(frozen=True)
class _Outcome:
    """A row's step: what its verification kept, the target's states at the rows it kept
    (the root and the accepted nodes) and the logits at its draft's extra rows (None
    without), which its drafter reads next."""

    kept: _Kept
    features: TargetFeatures
    extra_logits: torch.Tensor | None


def _commit(row: _Row, draft: Draft, outcome: _Outcome, stop_ids: set[int],
            max_new_tokens: int) -> None:
    """A row's step outcome into its history and stats; the row stops at a stop token or its
    budget."""
    kept = outcome.kept
    row.stats.record_step(kept.tree.num_nodes, kept.tree.max_depth, len(kept.path),
                          rows=draft.rows, position=len(row.new))
    emitted = _until_stop(kept.tokens, stop_ids, max_new_tokens - len(row.new))
    row.new += emitted
    row.history += emitted
    row.features, row.extra_logits = outcome.features, outcome.extra_logits
    row.done = len(row.new) >= max_new_tokens or bool(row.new and row.new[-1] in stop_ids)


def _finished(row: _Row, timing: GenerationStats) -> GenerationStats:
    """A row's stats, with the batch's phase times (its rows share them)."""
    stats = row.stats
    for phase in PHASES:
        setattr(stats, f"{phase}_time_s", getattr(timing, f"{phase}_time_s"))
    stats.split_steps, stats.loop_steps = timing.split_steps, timing.loop_steps
    stats.new_tokens = len(row.new)
    return stats


@dataclass(frozen=True)
class _Loop:
    """What every step of one generation shares."""

    target: Transformer
    steps: StaticSteps | None
    layers: tuple[int, ...]
    sampling: SamplingParams
    generator: torch.Generator | None
    clock: _PhaseClock


def _verify_rows(loop: _Loop, rows: list[_Row], drafts: list[Draft], caches: BatchRows
                 ) -> list[_Outcome]:
    """Each row's step outcome: one forward over the rows (the batch cache's first rows), or,
    for one prompt or drafts that ran early layers, a forward per row (eager in a batch)."""
    batch = loop.steps is not None and loop.steps.batch_size > 1 or len(rows) > 1
    if batch and not any(draft.early is not None for draft in drafts):
        return _batched_step(loop, rows, drafts, caches.first(len(rows)))
    return [_step(loop, row.history[-1], draft, row.cache, None if batch else loop.steps)
            for row, draft in zip(rows, drafts, strict=True)]


def _step(loop: _Loop, root: int, draft: Draft, cache, steps: StaticSteps | None
          ) -> _Outcome:
    """One verification forward over [root, draft..., extra rows...] (in `steps`, if any),
    exact verification of the draft, cache commit; returns the extra rows' logits too."""
    target, layers = loop.target, loop.layers
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
    loop.clock.lap("forward")
    return _verified(loop, out, 0, tokens[0], draft, base, cache)


def _batched_step(loop: _Loop, rows: list[_Row], drafts: list[Draft], cache: KVCache
                  ) -> list[_Outcome]:
    """One verification forward over every row's [root, draft..., extra rows...], padded to
    the longest (`cache`: their rows of the batch cache, in order): the batch's static step,
    or eagerly; then each row's verification and commit, as `_step` does."""
    device = loop.target.embed_tokens.weight.device
    inputs = [_forward_rows(row.history[-1], draft, device) for row, draft in zip(rows, drafts,
                                                                                 strict=True)]
    lengths = [row.cache.length for row in rows]
    tokens, positions, masks = pad_rows(inputs, lengths, device)
    out = (None if loop.steps is None
           else loop.steps.forward_rows(tokens, positions, masks, lengths, loop.layers))
    if out is None:
        slots = RowSlots(cache, lengths, tokens.shape[1])
        out = loop.target(tokens, positions, slots, mask=slots.mask(masks),
                          return_hidden=loop.layers)
    loop.clock.lap("forward")
    outcomes = []
    for b, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
        row.cache.advance(tokens.shape[1])  # its slots [length, length + T) were written
        outcomes.append(_verified(loop, out, b, tokens[b], draft, lengths[b], row.cache))
    return outcomes


def _verified(loop: _Loop, out: ModelOutput, b: int, tokens: torch.Tensor, draft: Draft,
              base: int, cache) -> _Outcome:
    """Row b of a verification forward: exact verification of its draft, its cache commit,
    the target's states at the kept rows, and the extra rows' logits."""
    verified = draft.tree.num_nodes + 1
    kept = _verify_step(out.logits[b, :verified], draft, loop)
    loop.clock.lap("verify")
    committed = [0, *(i + 1 for i in kept.path)]  # forward rows: the root, the accepted nodes
    rows = torch.tensor(committed, device=tokens.device)
    cache.commit([base + row for row in committed])
    extra_logits = (out.logits[b, verified:verified + draft.extra.rows]
                    if draft.extra is not None else None)
    return _Outcome(kept, _features(out, tokens[rows], rows, b), extra_logits)


def _forward_rows(root: int, draft: Draft, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verification forward's tokens [1, T], position offsets [T] and mask [T, T]: the
    root and the draft's nodes under its tree mask, then any extra rows, which see the root
    and each other as their mask says and which no node sees."""
    # A fill, not a copy from the host: that would wait for the queued draft.
    tokens = torch.cat([torch.full((1,), root, device=device), draft.tokens.to(device)])
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


def _verify_step(logits: torch.Tensor, draft: Draft, loop: _Loop) -> _Kept:
    """What the step keeps, from logits [N+1, V]. Greedy: the argmax rows decide (the one-hot
    probabilities they stand for are never built), read back with the draft's tokens (and a
    device tree's parents) in the step's one host read. Otherwise the target's law from
    `logits_to_probs` and recursive rejection sampling. In static steps every draw of it is
    made on the device and read back in the step's one read: for chosen candidates (q None)
    in its closed form, where a node's children are taken in order, each with the
    probability the law left for it, which is the first child whose token is one draw from
    the law at their parent, or, when none is, that draw (so one draw per row, and the walk
    is greedy verification's over those draws); for sampled drafts (q given), every node's
    tests of its children at once (`verify.tree_draws`). Eagerly the host verifies, reading
    as it walks. Drafts and laws built by this loop are well-formed, so the public
    verifier's input checks are not repeated every step."""
    sampling, generator, clock = loop.sampling, loop.generator, loop.clock
    if sampling.greedy:
        return _walked(logits.float().argmax(dim=-1), draft, clock)
    p = logits_to_probs(logits, sampling, static=loop.steps is not None)  # [N+1, V]
    if loop.steps is not None and draft.q is None:
        return _walked(sample_rows(p, generator), draft, clock)
    if loop.steps is not None:
        return _drawn(p, draft, generator, clock)
    clock.lap("probs")
    if draft.tree.num_nodes == 0:  # plain decoding: nothing to verify
        return _Kept(draft.tree, [sample(p[0], generator)], [])
    q = None if draft.q is None else draft.q.to(p.device)  # a draft model may live elsewhere
    tree = host_tree(draft.tree)
    acceptance = verify_trusted(tree, draft.tokens.to(p.device), q, p, generator,
                                draft.without_replacement)
    return _Kept(tree, acceptance.tokens.tolist(), acceptance.path.tolist())


def _drawn(p: torch.Tensor, draft: Draft, generator: torch.Generator | None,
           clock: _PhaseClock) -> _Kept:
    """A sampled draft verified from one host read: every draw of its rejection sampling
    made on the device ahead (`verify.tree_draws`), read back with its tokens and, for a
    tree known only on the device, its shape."""
    tree, tokens = draft.tree, draft.tokens.to(p.device)
    draws = tree_draws(tree.children_table(p.device), tokens, draft.q.to(p.device), p,
                       generator, draft.without_replacement)
    read = _read_once(draws=draws, tokens=tokens, **_shape_of(tree, p.device))
    clock.lap("probs")
    path, last = tree_outcome(read["draws"])
    return _Kept(_read_tree(tree, read), [*(read["tokens"][i] for i in path), last], path)


def _walked(target_tokens: torch.Tensor, draft: Draft, clock: _PhaseClock) -> _Kept:
    """The walk down the draft from one host read: the target's token per row [N+1] (its
    argmax, or its draw), the draft's tokens [N] and, for a tree known only on the device,
    its parents (chosen children: every row a node); a child is accepted iff its token is
    its parent row's."""
    device = target_tokens.device
    read = _read_once(target=target_tokens, tokens=draft.tokens.to(device),
                      **_shape_of(draft.tree, device))
    clock.lap("probs")
    tree = _read_tree(draft.tree, read)
    path, last = greedy_path(tree, read["tokens"], read["target"])
    return _Kept(tree, [*(read["tokens"][i] for i in path), last], path)


def _read_once(**parts: torch.Tensor) -> dict[str, list[int]]:
    """The step's one host read: 1-D integer (or bool) tensors read back together, as host
    ints split by name."""
    values = torch.cat([part.long() for part in parts.values()]).tolist()  # one read
    read, start = {}, 0
    for name, part in parts.items():
        read[name], start = values[start:start + len(part)], start + len(part)
    return read


def _shape_of(tree: Tree | DeviceTree, device: torch.device) -> dict[str, torch.Tensor]:
    """What the host needs to know of a tree's shape, as tensors to read with the step's
    other values: nothing for a host Tree; a device tree's parents [N], and its valid flags
    [N] if some rows are not nodes."""
    if isinstance(tree, Tree):
        return {}
    if tree.valid is None:
        return {"parents": tree.parents.to(device)}
    return {"parents": tree.parents.to(device), "valid": tree.valid.to(device)}


def _read_tree(tree: Tree | DeviceTree, read: dict[str, list[int]]) -> Tree:
    """The tree verified, from `_shape_of`'s values read back: a host Tree itself; a device
    tree's valid nodes (a path through them names them by their rows of the draft, as the
    draft's own indices)."""
    if isinstance(tree, Tree):
        return tree
    if "valid" not in read:  # every row a node
        return tree.on_host(read["parents"])
    return tree.nodes_on_host(read["parents"], read["valid"])[0]


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


def _prefill_rows(target: Transformer, rows: list[_Row], contexts: list[torch.Tensor],
                  caches: BatchRows, layers: tuple[int, ...]) -> None:
    """Each row's context (its prompt but the last token, which the first step verifies)
    into its cache, and the target's states there for its drafter: one forward over a
    batch's rows where its layers allow it (`_prefills_together`), else a forward a row."""
    if sum(len(c) > 0 for c in contexts) > 1 and _prefills_together(target, caches.cache):
        found = _prefill_together(target, contexts, caches.first(len(rows)), layers)
        for row, context in zip(rows, contexts, strict=True):
            row.cache.advance(len(context))  # its context's slots; the padding's stay free
    else:
        found = [_prefill(target, context, row.cache, layers) if len(context) else None
                 for row, context in zip(rows, contexts, strict=True)]
    for row, features in zip(rows, found, strict=True):
        if features is not None:
            row.features = features
            row.stats.target_forwards += 1


def _prefills_together(target: Transformer, cache) -> bool:
    """Whether a batch's contexts may fill their rows of cache in one forward, padded to the
    longest: a plain KVCache, and no layer whose state the padding would enter (a recurrent
    one) or that attends within a window or a chunk."""
    config = target.config
    return (type(cache) is KVCache and not config.sliding_layers and not config.chunked_layers
            and not config.linear_layers)


def _prefill_together(target: Transformer, contexts: list[torch.Tensor], cache: KVCache,
                      layers: tuple[int, ...]) -> list[TargetFeatures | None]:
    """The contexts of a batch's rows (cache: those rows) in one forward, each row causal
    over its own tokens, the padding after them seeing itself alone; each row's features
    (None for an empty context): a forward a row streams every weight once per prompt of
    some 60 tokens (docs/serving.md, the anchor's batch split)."""
    device = target.embed_tokens.weight.device
    inputs = [(context[None], torch.arange(len(context), device=device),
               torch.ones(len(context), len(context), dtype=torch.bool, device=device).tril())
              for context in contexts]
    tokens, positions, masks = pad_rows(inputs, [0] * len(contexts), device)
    slots = RowSlots(cache, [0] * len(contexts), tokens.shape[1])
    last, hidden = _states(target, tokens, positions, slots, layers, slots.mask(masks))
    return [TargetFeatures(context, last[b, :len(context)],
                           tuple(h[b, :len(context)] for h in hidden)) if len(context) else None
            for b, context in enumerate(contexts)]


def _prefill(target: Transformer, tokens: torch.Tensor, cache, layers: tuple[int, ...]
             ) -> TargetFeatures:
    positions = torch.arange(len(tokens), device=tokens.device)
    last, hidden = _states(target, tokens[None], positions, cache, layers)
    return TargetFeatures(tokens, last[0], tuple(h[0] for h in hidden))


def _states(target: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache,
            layers: tuple[int, ...], mask: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A prefill forward's normed last hidden states and its residual streams at layers,
    without the LM head: a prefill's logits are never read, and over SmolLM2's 49,152-token
    vocabulary the head is a fifth of a prompt's forward."""
    out = target(tokens, positions, cache, mask=mask, with_logits=False,
                 return_hidden=(*layers, target.config.num_layers))
    return target.norm(out.hidden[-1]), out.hidden[:-1]


def _features(out: ModelOutput, tokens: torch.Tensor, rows: torch.Tensor,
              b: int = 0) -> TargetFeatures:
    """The target's states at the committed rows of a forward (of its batch row b)."""
    return TargetFeatures(
        tokens=tokens,
        last_hidden=out.last_hidden[b, rows],
        hidden=tuple(h[b, rows] for h in out.hidden),
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


def _is_batch(prompt_ids) -> bool:
    """A list (or tuple) of prompts, rather than one prompt's ids (an empty list is an empty
    prompt)."""
    return isinstance(prompt_ids, list | tuple) and any(
        isinstance(p, torch.Tensor | list | tuple) for p in prompt_ids)


def _check_prompts(
    target: Transformer, prompts: Sequence, sampling: SamplingParams, max_new_tokens: int
) -> list[torch.Tensor]:
    """The prompts as 1-D LongTensors on the target's device, or a clear error."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"generate: sampling must be a SamplingParams, got {sampling!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    devices = {str(p.device) for p in prompts if isinstance(p, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"generate: the prompts lie on different devices "
                         f"({', '.join(sorted(devices))}); put them on one")
    if len(prompts) > 1 and target.placement is not None and target.placement.spans_devices:
        raise ValueError("generate: a target placed over several devices (model.device_map) "
                         "decodes one prompt at a time; pass the prompts one by one")
    where = " (prompt {})" if len(prompts) > 1 else ""
    return [_check_prompt(target, p, max_new_tokens, where.format(i))
            for i, p in enumerate(prompts)]


def _check_prompt(target: Transformer, prompt_ids, max_new_tokens: int, where: str
                  ) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise ValueError(f"generate: the prompt{where} is empty; give at least one token "
                         f"(e.g. BOS)")
    vocab, limit = target.config.vocab_size, target.config.max_position_embeddings
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"generate: prompt ids{where} must lie in [0, {vocab}) (the vocab "
                         f"size)")
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(
            f"generate: prompt{where} ({len(prompt)} tokens) + max_new_tokens "
            f"({max_new_tokens}) exceeds the model's {limit} positions "
            f"(max_position_embeddings); shorten the prompt or lower max_new_tokens"
        )
    return prompt.to(target.embed_tokens.weight.device)


def _max_length(prompts: list[torch.Tensor], drafter: Drafter | None, max_new_tokens: int
                ) -> int:
    """The most slots a row can reach: its prompt, its tokens and one draft's rows."""
    return (max(len(p) for p in prompts) + max_new_tokens
            + (drafter.max_nodes if drafter is not None else 0) + 1)


def _static_steps(target: Transformer, prompts: list[torch.Tensor], drafter: Drafter | None,
                  max_new_tokens: int, cuda_graphs: bool | None) -> StaticSteps | None:
    """The target's static steps for the generation, where it runs them (None: eager)."""
    if not use_cuda_graphs(cuda_graphs, target):
        return None
    return static_steps(target, _max_length(prompts, drafter, max_new_tokens), len(prompts))


def _drafters(drafter: Drafter | None, rows: int, together: BatchDrafter | None
              ) -> list[Drafter | None]:
    """A drafter per row: the one given for the first, forks of it for the others; a batch
    drafter drafting them together is every row's."""
    if together is not None:
        return [together] * rows
    return [drafter] + [None if drafter is None else fork(drafter) for _ in range(rows - 1)]
