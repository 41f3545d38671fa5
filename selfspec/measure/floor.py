"""The decode loop's floor and ceiling on the running machine (eval/bench_decode.py): plain
tokens/s of selfspec and of Hugging Face `generate` on the same weights, the memory floor of
a token (what a one-token forward reads, at the copy bandwidth measured in the same run),
c(N), the oracle drafter's speedup at each draft length beside its bound, in trees of given
shapes, and against batch size."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from selfspec.devices import synchronize
from selfspec.measure.costs import CostProfile, measure_cost_profile
from selfspec.measure.divergence import first_difference
from selfspec.measure.memory import PeakMemory
from selfspec.measure.method_costs import CostRow, method_cost_row
from selfspec.measure.oracle import OracleDrafter
from selfspec.measure.passes import BenchSettings, compare_with_plain, run_passes
from selfspec.measure.peers import HFDecoder, OurDecoder
from selfspec.model import Transformer
from selfspec.model.cpu_linear import invariant_rows_of
from selfspec.sampling import SamplingParams
from selfspec.step import setup_seconds, use_cuda_graphs


@dataclass(frozen=True)
class FloorSettings:
    """What eval/bench_decode.py measures: random prompts of prompt_tokens ids, new_tokens
    generated greedily, the oracle at each draft length, c(N) at each cost length."""

    prompt_tokens: int = 512
    new_tokens: int = 128
    num_prompts: int = 2
    draft_lengths: tuple[int, ...] = (1, 2, 4, 8)
    cost_lengths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    repeats: int = 3
    seed: int = 0
    cuda_graphs: bool | None = None  # as `generate`'s: None = on for a CUDA target
    # (name, choices): trees the oracle's answer is hidden in (`OracleTreeDrafter`)
    oracle_trees: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    # methods whose draft cost is measured with random heads (`selfspec.measure.method_costs`),
    # the static ones over method_tree (choices)
    methods: tuple[str, ...] = ()
    method_tree: tuple[tuple[int, ...], ...] = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    # batch sizes at which plain decoding and the oracle's chain of batch_draft_tokens run
    batch_sizes: tuple[int, ...] = ()
    batch_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true, false or null, got {self.cuda_graphs!r}")
        for name in ("prompt_tokens", "new_tokens", "num_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("draft_lengths", "cost_lengths"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a non-empty list of integers >= 1")
        if max(self.draft_lengths) + 1 > max(self.cost_lengths):
            raise ValueError(f"cost_lengths must reach max(draft_lengths) + 1 = "
                             f"{max(self.draft_lengths) + 1} (a draft of k verifies k + 1 "
                             f"tokens), got up to {max(self.cost_lengths)}")
        if any(b < 1 for b in self.batch_sizes) or self.batch_draft_tokens < 1:
            raise ValueError(f"batch_sizes and batch_draft_tokens must be >= 1, got "
                             f"{list(self.batch_sizes)} and {self.batch_draft_tokens}")
        for name, choices in self.oracle_trees:
            if len(choices) + 1 > max(self.cost_lengths):
                raise ValueError(f"cost_lengths must reach {len(choices) + 1} for the oracle "
                                 f"tree {name} ({len(choices)} nodes), got up to "
                                 f"{max(self.cost_lengths)}")


def measure_floor(target: Transformer, hf_model, settings: FloorSettings,
                  cost_rows: Mapping[str, CostRow] | None = None) -> dict:
    """The decode loop's floor and ceiling on this machine: plain tokens/s of selfspec and of
    Hugging Face `generate` on the same weights, c(N), and the oracle drafter's speedup at
    each draft length beside the bound tau / c(k + 1) (its drafting costs nothing), with the
    time split of its steps (synchronized at every phase boundary on a GPU); and the draft cost
    of each of settings.methods, by its row of cost_rows (the methods' own)."""
    rows = cost_rows or {}
    if unknown := [name for name in settings.methods if name not in rows]:
        raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(rows)}")
    generator = torch.Generator().manual_seed(settings.seed)
    prompts = torch.randint(target.config.vocab_size, (settings.num_prompts,
                            settings.prompt_tokens), generator=generator).tolist()
    bench = BenchSettings(max_new_tokens=settings.new_tokens, repeats=settings.repeats,
                          seed=settings.seed)
    graphs = settings.cuda_graphs
    ours, theirs = run_passes([OurDecoder(target, cuda_graphs=graphs), HFDecoder(hf_model)],
                              prompts, SamplingParams(), bench)
    profile = measure_cost_profile(target, settings.cost_lengths,
                                   cache_length=settings.prompt_tokens, repeats=settings.repeats,
                                   cuda_graphs=graphs)
    answers, oracle = OracleDrafter(), []
    # ahead, not inside the timed runs, and in their forward mode
    answers.prepare(target, prompts, settings.new_tokens, settings.cuda_graphs)
    with PeakMemory(target.embed_tokens.weight.device) as memory:  # the oracle and plain runs
        for k in settings.draft_lengths:
            oracle.append({"k": k} | _against_bound(target, answers.with_draft_tokens(k),
                                                    prompts, settings, profile))
        trees = []
        for name, choices in settings.oracle_trees:
            drafter = answers.with_tree(choices)
            trees.append({"tree": name, "nodes": drafter.tree.num_nodes,
                          "depth": drafter.tree.max_depth}
                         | _against_bound(target, drafter, prompts, settings, profile))
        methods = [method_cost_row(name, rows[name], target, settings.method_tree, prompts,
                                   settings.new_tokens, profile, settings.seed,
                                   settings.cuda_graphs) for name in settings.methods]
    plain = statistics.median(ours.tokens_per_s)
    return {"plain_tokens_per_s": plain,
            "hf_plain_tokens_per_s": statistics.median(theirs.tokens_per_s),
            "cuda_graphs": use_cuda_graphs(graphs, target),
            "compiled": target.compile_steps,
            "invariant_rows": invariant_rows_of(target),
            "setup_seconds": setup_seconds(target),
            "peak_memory_mb": memory.peak_mb, "peak_memory_kind": memory.kind,
            "cost_profile": profile.as_dict(), "oracle": oracle, "oracle_trees": trees,
            "methods": methods, "memory_floor": measure_memory_floor(target, profile, plain),
            "batches": measure_batches(target, settings), "settings": asdict(settings)}


def _against_bound(target: Transformer, drafter: OracleDrafter, prompts: list,
                   settings: FloorSettings, profile) -> dict:
    """An oracle's speedup over plain decoding beside its bound tau / c(N + 1), N the nodes
    it drafts (a chain's k, a tree's all): its drafting costs nothing, so the distance is the
    loop's own cost, split by phase."""
    row = compare_with_plain(target, drafter, prompts, max_new_tokens=settings.new_tokens,
                             seed=settings.seed, split_time=True, cuda_graphs=settings.cuda_graphs)
    bound = profile.bound(row.tau, drafter.max_nodes)
    return {"tau": row.tau, "speedup": row.speedup, "bound": bound,
            "efficiency": row.speedup / bound, "tokens_per_s": row.tokens_per_s,
            "plain_tokens_per_s": row.plain_tokens_per_s, "lossless": row.lossless,
            "first_difference": row.first_difference, "time_split": row.time_split}


# ---- the memory floor ------------------------------------------------------------------------

COPY_BYTES = 1 << 30  # the copy that measures the bandwidth: well past any cache


def copy_bandwidth(device: torch.device | str, nbytes: int = COPY_BYTES, repeats: int = 10,
                   warmup: int = 3) -> float:
    """Bytes per second a copy of nbytes within the device moves, counting the bytes read and
    those written (the median of `repeats` copies after `warmup`)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = []
    for i in range(warmup + repeats):
        synchronize(source.device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(source.device)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(seconds)


def bytes_read_per_token(target: Transformer, cache_length: int) -> tuple[int, int]:
    """(weights, K/V) bytes a one-token forward over cache_length cached tokens reads: every
    parameter once but the embedding table, of which one row (unless the LM head is it), and
    every layer's keys and values."""
    weights = {id(p): _tensor_bytes(p) for p in target.parameters()}
    table = target.embed_tokens.weight
    if table is not target.lm_head.weight:
        weights[id(table)] = table.shape[1] * table.element_size()
    config = target.config
    heads, key_dim, value_dim = config.cache_dims  # MLA: a roped key and a latent a token
    kv = (config.num_layers * heads * (key_dim + value_dim) * cache_length
          * table.element_size())
    return sum(weights.values()), kv


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """What a tensor holds in memory: a quantized tensor subclass, its inner tensors."""
    flatten = getattr(tensor.data, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    return sum(_tensor_bytes(getattr(tensor.data, name)) for name in flatten()[0])


def measure_memory_floor(target: Transformer, profile: CostProfile, plain_tokens_per_s: float,
                         nbytes: int | None = None) -> dict:
    """The least time a token can take here, reading what a one-token forward reads at the
    copy bandwidth measured now, and the share of it that the measured one-token forward and
    plain decoding reach (1.0: at the floor)."""
    weights, kv = bytes_read_per_token(target, profile.cache_length)
    device = target.embed_tokens.weight.device
    if nbytes is None:  # a CPU copies a smaller buffer as fast; a GPU needs one past its cache
        nbytes = COPY_BYTES if device.type == "cuda" else 1 << 26
    bandwidth = copy_bandwidth(device, nbytes)
    floor_s = (weights + kv) / bandwidth
    return {"weight_bytes": weights, "kv_bytes": kv, "cache_length": profile.cache_length,
            "copy_bytes_per_s": bandwidth, "copy_buffer_bytes": nbytes,
            "floor_ms": 1000 * floor_s, "floor_tokens_per_s": 1 / floor_s,
            "share_of_one_token_forward": 1000 * floor_s / profile.as_dict()["one_token_ms"],
            "share_of_plain_decoding": plain_tokens_per_s * floor_s}


# ---- batches ---------------------------------------------------------------------------------


def measure_batches(target: Transformer, settings: FloorSettings) -> list[dict]:
    """At each batch size B: plain decoding of B random prompts as one batch and the oracle's
    chain of batch_draft_tokens over the same batch (its answers: that batch's own plain
    greedy output), interleaved; tokens/s of all rows together, the speedup, tau, and c_B(k+1),
    a verification forward's time against a plain step's in the loop itself (every phase timed,
    on a GPU synchronized at its boundaries), and the bound tau / c_B(k + 1)."""
    if not settings.batch_sizes:
        return []
    generator = torch.Generator().manual_seed(settings.seed + 1)
    pool = torch.randint(target.config.vocab_size, (max(settings.batch_sizes),
                         settings.prompt_tokens), generator=generator).tolist()
    bench = BenchSettings(max_new_tokens=settings.new_tokens, repeats=settings.repeats,
                          seed=settings.seed)
    rows = []
    for size in settings.batch_sizes:
        prompts = pool[:size]
        oracle = OracleDrafter(settings.batch_draft_tokens)
        oracle.prepare_batch(target, prompts, settings.new_tokens, settings.cuda_graphs)
        decoders = [OurDecoder(target, d, split_time=True, cuda_graphs=settings.cuda_graphs)
                    for d in (None, oracle)]
        plain, drafted = run_passes(decoders, prompts, SamplingParams(), bench, batch_size=size)
        speed, base = (statistics.median(p.tokens_per_s) for p in (drafted, plain))
        verify = _forward_per_step(drafted) / _forward_per_step(plain)
        rows.append({"batch_size": size, "draft_tokens": settings.batch_draft_tokens,
                     "plain_tokens_per_s": base, "oracle_tokens_per_s": speed,
                     "speedup": speed / base, "tau": drafted.stats.tau, "c_verify": verify,
                     "bound": drafted.stats.tau / verify,
                     "lossless": drafted.outputs == plain.outputs,
                     "first_difference": first_difference(decoders[0], prompts, plain.outputs,
                                                          drafted.outputs)})
    return rows


def _forward_per_step(summary) -> float:
    """Seconds of the verification forward per step of the batch's loop."""
    return summary.stats.forward_time_s / max(summary.stats.loop_steps, 1)
