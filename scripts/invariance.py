"""Does a row's result depend on the rows beside it? The diagnosis of a static step that is
not lossless in low precision, for scripts/bucket_invariance.py, the one program that runs it
(docs/gpu.md "A compiled step").

Greedy speculative decoding equals plain greedy decoding only if a token's logits in a
verification forward of n rows (a bucket of b >= n, `selfspec.step`) round as they do in the
one-row step plain decoding runs. Three views of where that fails:

- `rows_against_alone`: a bucket's rows against the same tokens fed one at a time (plain
  decoding's steps), after the same prefill: per residual stream (layer) how far each row
  moved, its logits, and whether its argmax changed, beside its top-2 gap (a near-tie?);
- `op_divergences`: each op of each layer (norm, q/k/v, RoPE, attention, o_proj, the second
  norm, the MLP; compiled: inductor's two stages around attention) fed the very same input
  rows, all b together and each alone: which ops' results depend on how many rows they see;
- `decode_divergence`: plain greedy decoding in static steps against the oracle's
  verification of that very answer (chains of k), as the loop runs them: the first token
  where they part, its bucket and cache length, and plain decoding's top-2 gap there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch.nn.attention import sdpa_kernel

from selfspec.model import (
    Transformer,
    apply_rope,
    attention_kernels,
    compiled_stages,
)
from selfspec.model.cpu_linear import INVARIANT_BLOCK_ROWS, use_invariant_products
from selfspec.model.transformer import LayerStages
from selfspec.step import StaticSteps, bucket_of, padded_slots


@dataclass(frozen=True)
class RowDivergence:
    """Row `row` of a verification forward of `rows` real rows in bucket `bucket` after
    `cache_length` cached tokens, against the same token fed alone (plain decoding's step).

    moved[l]: max |difference| of its residual stream after l layers (0: the embedding);
    first_layer: the first l where it differs at all (None: bitwise equal throughout)."""

    cache_length: int
    bucket: int
    rows: int
    row: int
    moved: list[float]
    first_layer: int | None
    logits_moved: float
    argmax_alone: int
    argmax_in_bucket: int
    top2_gap: float  # of the row's logits alone

    @property
    def flipped(self) -> bool:
        return self.argmax_alone != self.argmax_in_bucket

    @property
    def near_tie(self) -> bool:
        """A flip that moving every logit by logits_moved explains: a gap of at most twice it."""
        return self.flipped and self.top2_gap <= 2 * self.logits_moved

    def as_dict(self) -> dict:
        return asdict(self) | {"flipped": self.flipped, "near_tie": self.near_tie}


@dataclass(frozen=True)
class OpDivergence:
    """An op of layer `layer` whose result for row `row` of `bucket` rows differs from its
    result for that row fed alone, on the very same input rows (max |difference|)."""

    cache_length: int
    bucket: int
    layer: int
    op: str
    row: int
    moved: float


@torch.inference_mode()
def rows_against_alone(steps: StaticSteps, prompt: torch.Tensor, tokens: torch.Tensor,
                       cache_length: int, rows: int) -> list[RowDivergence]:
    """`rows` new tokens (tokens [1, >= rows]) after prompt[:, :cache_length], in one static
    step (bucket_of(rows), padded) and one at a time, every residual stream returned."""
    target, cache = steps.target, steps.cache
    device = cache.k.device
    layers = tuple(range(target.config.num_layers + 1))
    positions = cache_length + torch.arange(rows, device=device)
    _prefill(steps, prompt, cache_length)
    alone = [steps.forward(tokens[:, r:r + 1], positions[r:r + 1], None, layers=layers)
             for r in range(rows)]
    cache.truncate(cache_length)
    together = steps.forward(tokens[:, :rows], positions, None, layers=layers)
    found = []
    for r, one in enumerate(alone):
        moved = [_max_diff(h[:, r], o[:, 0]) for h, o in zip(together.hidden, one.hidden,
                                                              strict=True)]
        logits, reference = together.logits[0, r], one.logits[0, 0]
        found.append(RowDivergence(
            cache_length, bucket_of(rows) or rows, rows, r, moved,
            next((i for i, m in enumerate(moved) if m > 0), None), _max_diff(logits, reference),
            int(reference.argmax()), int(logits.argmax()), top2_gap(reference)))
    return found


@torch.inference_mode()
def op_divergences(steps: StaticSteps, prompt: torch.Tensor, tokens: torch.Tensor,
                   cache_length: int, bucket: int, stages: LayerStages | None = None
                   ) -> list[OpDivergence]:
    """Every op of every layer fed the inputs of a full bucket's step (bucket rows after
    prompt[:, :cache_length]), all rows together and each row alone: the ops whose rows
    differ. The eager ops always; with `stages` (compiled), its two stages as well, inside
    which inductor fuses the ops (named attention_inputs and layer_output)."""
    target, cache = steps.target, steps.cache
    device = cache.k.device
    layers = tuple(range(target.config.num_layers))
    positions = cache_length + torch.arange(bucket, device=device)
    _prefill(steps, prompt, cache_length)
    streams = steps.forward(tokens[:, :bucket], positions, None, layers=layers).hidden
    ropes = {kind: rope.cos_sin(positions, streams[0].dtype)
             for kind, rope in target.ropes.items()}  # each kind of layer's (cos, sin)
    mask = torch.zeros(bucket, cache.max_slots, dtype=torch.bool, device=device)  # [b, S]
    mask[:, :cache_length] = True
    mask[:, cache_length:cache_length + bucket] = torch.ones(
        bucket, bucket, dtype=torch.bool, device=device).tril()
    found = []
    kernels = attention_kernels(device, masked=True)
    with nullcontext() if kernels is None else sdpa_kernel(kernels):
        for i, x in zip(layers, streams, strict=True):
            cos, sin = ropes[target.layer_kinds[i]]
            keys = (cache.k[i], cache.v[i])  # [1, H_kv, S, D]: the step wrote this bucket's
            for op in _layer_ops(target.layers[i], keys, mask, stages):
                for r, moved in _row_dependence(op, op.inputs(x, cos, sin)):
                    found.append(OpDivergence(cache_length, bucket, i, op.name, r, moved))
    return found


@torch.inference_mode()
def decode_divergence(steps: StaticSteps, prompt: torch.Tensor, new_tokens: int,
                      draft_tokens: int) -> dict:
    """Plain greedy decoding in one-row static steps, then the oracle's verification of that
    answer in chains of draft_tokens as the loop runs it (each step: the last token and the
    next draft_tokens of the answer, the accepted rows kept), until a verification row's
    argmax leaves the answer: where (new token, bucket, cache length), plain decoding's top-2
    gap there and how far that row's logits moved from plain decoding's."""
    cache, device = steps.cache, steps.cache.k.device
    length = prompt.shape[1]
    _prefill(steps, prompt, length - 1)  # the last prompt token is the first step's root
    answer, plain_logits = [int(prompt[0, -1])], []
    for t in range(new_tokens):
        out = steps.forward(torch.tensor([answer[-1:]], device=device),
                            torch.tensor([length - 1 + t], device=device), None)
        plain_logits.append(out.logits[0, 0])
        answer.append(int(out.logits[0, 0].argmax()))
    _prefill(steps, prompt, length - 1)
    done, steps_run = 0, 0  # answer tokens committed after the prompt's last token
    while done < new_tokens:
        rows = answer[done:done + draft_tokens + 1]
        base = length - 1 + done
        out = steps.forward(torch.tensor([rows], device=device),
                            base + torch.arange(len(rows), device=device), None)
        steps_run += 1
        argmax = out.logits[0].argmax(-1).tolist()
        for r, token in enumerate(argmax):
            if done + r >= new_tokens:
                break
            if token != answer[done + r + 1]:
                reference = plain_logits[done + r]
                return {"draft_tokens": draft_tokens, "lossless": False, "position": done + r,
                        "bucket": bucket_of(len(rows)), "row": r, "cache_length": base + r,
                        "top2_gap": top2_gap(reference),
                        "logits_moved": _max_diff(out.logits[0, r], reference),
                        "plain_token": answer[done + r + 1], "verified_token": token,
                        "steps": steps_run}
        done += len(rows)
        cache.truncate(length + done - 1)  # the accepted rows; the next root is fed again
    return {"draft_tokens": draft_tokens, "lossless": True, "position": None,
            "tau": new_tokens / steps_run, "steps": steps_run,
            "min_top2_gap": min(top2_gap(logits) for logits in plain_logits)}


def top2_gap(logits: torch.Tensor) -> float:
    best = logits.float().topk(2).values
    return float(best[0] - best[1])


def first_divergences(ops: Sequence[OpDivergence]) -> dict:
    """Per (cache length, bucket): the first layer whose ops differ, and which ops there."""
    firsts: dict[tuple[int, int], list[OpDivergence]] = {}
    for op in ops:
        key = (op.cache_length, op.bucket)
        if key not in firsts or op.layer < firsts[key][0].layer:
            firsts[key] = [op]
        elif op.layer == firsts[key][0].layer:
            firsts[key].append(op)
    return {f"cache {c} bucket {b}": {"layer": found[0].layer,
                                      "ops": sorted({o.op for o in found}),
                                      "moved": max(o.moved for o in found)}
            for (c, b), found in sorted(firsts.items())}


# ---- helpers -------------------------------------------------------------------------------


def _prefill(steps: StaticSteps, prompt: torch.Tensor, length: int) -> None:
    """The cache holds prompt[:, :length], written by one eager forward (as `generate`'s
    prefill writes it)."""
    steps.cache.reset()
    device = steps.cache.k.device
    steps.target(prompt[:, :length].to(device), torch.arange(length, device=device),
                 steps.cache)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


class Op(NamedTuple):
    """One op of a layer: `run` over its inputs gives [B, T, ...] (rows on dim 1); `inputs`
    makes those inputs from the layer's input rows x and their cos, sin; `axes`: each input's
    rows axis (None: shared by every row, e.g. the cached keys)."""

    name: str
    run: Callable[..., torch.Tensor]
    inputs: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]
    axes: tuple[int | None, ...]


def _layer_ops(layer, keys: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
               stages: LayerStages | None) -> list[Op]:
    """The layer's eager ops in the order they run, each fed what the ops before it made of
    the full bucket's rows; with `stages` (compiled), its two stages too: attention_inputs
    (norm, q/k/v, RoPE) and layer_output (o_proj, residual adds, the second norm, the MLP)."""
    attn = layer.self_attn

    def projected(x, cos, sin):
        return attn.projections(layer.input_layernorm(x))

    def attended(x, cos, sin):
        q, k, _ = projected(x, cos, sin)
        return (attn.attend(apply_rope(q, cos, sin), *keys, mask, None),)

    def after_attention(x, cos, sin):
        return (x + attn.o_proj(attended(x, cos, sin)[0]),)

    ops = [
        Op("input_norm", layer.input_layernorm, lambda x, cos, sin: (x,), (1,)),
        Op("qkv", lambda h: torch.cat([t.transpose(1, 2).flatten(2)
                                       for t in attn.projections(h)], dim=-1),
           lambda x, cos, sin: (layer.input_layernorm(x),), (1,)),
        Op("rope", lambda q, k, cos, sin: torch.cat(
            [apply_rope(q, cos, sin), apply_rope(k, cos, sin)], dim=1).transpose(1, 2),
           lambda x, cos, sin: (*projected(x, cos, sin)[:2], cos, sin), (2, 2, 2, 2)),
        Op("attention", lambda q, k, v, rows_mask: attn.attend(q, k, v, rows_mask, None),
           lambda x, cos, sin: (apply_rope(projected(x, cos, sin)[0], cos, sin), *keys, mask),
           (2, None, None, 0)),
        Op("o_proj", attn.o_proj, attended, (1,)),
        Op("post_norm", layer.post_attention_layernorm, after_attention, (1,)),
        Op("mlp", layer.mlp,
           lambda x, cos, sin: (layer.post_attention_layernorm(after_attention(x, cos, sin)[0]),),
           (1,)),
    ]
    if stages is not None:
        ops += [
            Op("attention_inputs", lambda x, cos, sin: torch.cat(
                [t.transpose(1, 2).flatten(2) for t in stages.attention_inputs(layer, x, cos, sin)],
                dim=-1), lambda x, cos, sin: (x, cos, sin), (1, 2, 2)),
            Op("layer_output", lambda x, out: stages.layer_output(layer, x, out),
               lambda x, cos, sin: (x, *attended(x, cos, sin)), (1, 1)),
        ]
    return ops


def _row(tensor: torch.Tensor, axis: int, r: int) -> torch.Tensor:
    """Row r of tensor along axis, as a tensor of its own with the strides a one-row step's
    tensor has (`contiguous()` would keep the wider tensor's stride along its size-1 axes, and
    a compiled op would then compile, and run, another kernel for it)."""
    return tensor.narrow(axis, r, 1).clone(memory_format=torch.contiguous_format)


def _row_dependence(op: Op, inputs: tuple) -> list[tuple[int, float]]:
    """(row, max |difference|) for each row whose result differs when the op runs over all
    rows or over that row alone (each input cut to the row along its rows axis)."""
    together = op.run(*inputs)  # [B, T, ...]
    rows = together.shape[1]
    if rows == 1:
        return []
    found = []
    for r in range(rows):
        alone = op.run(*(t if axis is None else _row(t, axis, r)
                         for t, axis in zip(inputs, op.axes, strict=True)))
        if not torch.equal(together[:, r:r + 1], alone):
            found.append((r, _max_diff(together[:, r:r + 1], alone)))
    return found


# ---- the whole diagnosis -------------------------------------------------------------------

# mode: (compiled steps, inductor's emulated precision casts, the exact mode's invariant products)
MODES = {"eager": (False, False, False), "compiled": (True, False, False),
         "compiled_emulated": (True, True, False), "invariant": (False, False, True)}


def diagnose(target: Transformer, prompt: torch.Tensor, tokens: torch.Tensor, *,
             modes: Sequence[str] = ("eager", "compiled"),
             buckets: Sequence[int] = (2, 4, 8, 16), cache_lengths: Sequence[int] = (64, 512),
             new_tokens: int = 128, draft_lengths: Sequence[int] = (1, 4),
             op_cache_lengths: Sequence[int] | None = None) -> dict:
    """Every view of this module for each mode (`MODES`), in static steps over one cache
    (replayed CUDA graphs on CUDA): the rows of each bucket (full, and padded: b // 2 + 1
    rows) at each cache length against themselves alone; the ops whose rows depend on the
    bucket (at op_cache_lengths, default the longest); plain greedy decoding of `prompt`
    against the oracle's chains. tokens [1, >= max(buckets)]: the rows fed."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if tokens.shape[1] < max(buckets) or prompt.shape[1] < max(cache_lengths):
        raise ValueError("diagnose: tokens must hold max(buckets) ids and the prompt "
                         "max(cache_lengths)")
    slots = padded_slots(max(max(cache_lengths), prompt.shape[1]) + new_tokens)
    report = {}
    for mode in modes:
        compiled, emulate, invariant = MODES[mode]
        _set_mode(target, compiled, emulate, invariant)
        _compile_counts(reset=True)
        steps = StaticSteps(target, slots)
        stages = compiled_stages() if compiled else None
        start = time.perf_counter()
        rows = [row for length in cache_lengths for b in buckets
                for n in sorted({b, b // 2 + 1}) if n > 1
                for row in rows_against_alone(steps, prompt, tokens, length, n)]
        ops = [op for length in (op_cache_lengths or cache_lengths[-1:]) for b in buckets
               for op in op_divergences(steps, prompt, tokens, length, b, stages)]
        decode = [decode_divergence(steps, prompt, new_tokens, k) for k in draft_lengths]
        report[mode] = {"rows": summarize_rows(rows), "first_ops": first_divergences(ops),
                        "ops": summarize_ops(ops), "decode": decode,
                        "row_details": [r.as_dict() for r in rows],
                        "setup_seconds": steps.setup_seconds,
                        "seconds": time.perf_counter() - start,
                        "compile_counts": _compile_counts() if compiled else None}
        report[mode]["verdict"] = verdict(report[mode])
    _set_mode(target, False, False, False)
    return report


def summarize_rows(rows: Sequence[RowDivergence]) -> list[dict]:
    """Per (cache length, bucket, real rows): the first layer where a row moved, the most its
    logits moved, and the argmax flips, near-ties among them."""
    groups: dict[tuple, list[RowDivergence]] = {}
    for row in rows:
        groups.setdefault((row.cache_length, row.bucket, row.rows), []).append(row)
    found = []
    for (length, bucket, n), group in groups.items():
        layers = [r.first_layer for r in group if r.first_layer is not None]
        flips = [r for r in group if r.flipped]
        found.append({"cache_length": length, "bucket": bucket, "rows": n,
                      "first_layer": min(layers) if layers else None,
                      "rows_moved": len(layers), "logits_moved": max(r.logits_moved for r in group),
                      "flips": len(flips), "near_tie_flips": sum(r.near_tie for r in flips),
                      "top2_gaps_of_flips": [r.top2_gap for r in flips]})
    return found


def summarize_ops(ops: Sequence[OpDivergence]) -> list[dict]:
    """Per (cache length, bucket, layer, op): how many rows moved, and the most."""
    groups: dict[tuple, list[float]] = {}
    for op in ops:
        groups.setdefault((op.cache_length, op.bucket, op.layer, op.op), []).append(op.moved)
    return [{"cache_length": c, "bucket": b, "layer": layer, "op": name, "rows": len(moved),
             "moved": max(moved)} for (c, b, layer, name), moved in groups.items()]


def verdict(mode: dict) -> str:
    """One line: whether rows depend on their bucket, where first, and how decoding fared."""
    moved = [r for r in mode["rows"] if r["first_layer"] is not None]
    if not moved:
        rows = "every row bitwise equal to itself alone in every bucket and cache length"
    else:
        first = min(moved, key=lambda r: (r["first_layer"], r["bucket"]))
        rows = (f"rows differ from themselves alone in {len(moved)} of {len(mode['rows'])} "
                f"(cache, bucket, rows) cases, first after layer {first['first_layer']} "
                f"(bucket {first['bucket']}, cache {first['cache_length']}); "
                f"{sum(r['flips'] for r in mode['rows'])} argmax flips, "
                f"{sum(r['near_tie_flips'] for r in mode['rows'])} of them near-ties")
    ops = "; ".join(f"{key}: layer {v['layer']} {'/'.join(v['ops'])}"
                    for key, v in list(mode["first_ops"].items())[:4])
    decode = ", ".join(
        f"k={d['draft_tokens']} lossless (tau {d['tau']:.2f})" if d["lossless"] else
        f"k={d['draft_tokens']} parts at new token {d['position']} (bucket {d['bucket']}, "
        f"cache {d['cache_length']}, top-2 gap {d['top2_gap']:.3g}, logits moved "
        f"{d['logits_moved']:.3g})" for d in mode["decode"])
    return f"{rows}. First ops: {ops or 'none depends on its rows'}. Decoding: {decode}"


def _compile_counts(reset: bool = False) -> dict:
    """dynamo's counters (graphs compiled, frames, graph breaks, recompilations): one graph per
    stage and bucket is expected; more, or breaks, mean some steps did not run as compiled."""
    from torch._dynamo.utils import counters

    if reset:
        counters.clear()
    return {str(group): {str(key): count for key, count in found.items()}
            for group, found in counters.items()
            if group in ("frames", "stats", "graph_break", "recompiles", "unimplemented")}


def _set_mode(target: Transformer, compiled: bool, emulate: bool, invariant: bool) -> None:
    """The target's static steps as written or compiled; inductor's emulated precision casts
    (a new compilation: dynamo's caches are reset when they change); the exact mode's
    products (`use_invariant_products`)."""
    use_invariant_products(target, INVARIANT_BLOCK_ROWS if invariant else None)
    if compiled:
        from torch._inductor import config as inductor

        if inductor.emulate_precision_casts != emulate:
            inductor.emulate_precision_casts = emulate
            torch._dynamo.reset()
    target.compile_steps = compiled
