"""The decode loop's floor and ceiling on the running machine (eval/bench_decode.py): plain
tokens/s of selfspec and of Hugging Face `generate` on the same weights, c(N), and the oracle
drafter's speedup at each draft length beside its bound, and in trees of given shapes."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from selfspec.measure.costs import measure_cost_profile
from selfspec.measure.memory import PeakMemory
from selfspec.measure.method_costs import METHODS, method_cost_row
from selfspec.measure.oracle import OracleDrafter
from selfspec.measure.passes import BenchSettings, compare_with_plain, run_passes
from selfspec.measure.peers import HFDecoder, OurDecoder
from selfspec.model import Transformer
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
        unknown = [name for name in self.methods if name not in METHODS]
        if unknown:
            raise ValueError(f"methods: unknown {unknown}; choose from {', '.join(METHODS)}")
        for name, choices in self.oracle_trees:
            if len(choices) + 1 > max(self.cost_lengths):
                raise ValueError(f"cost_lengths must reach {len(choices) + 1} for the oracle "
                                 f"tree {name} ({len(choices)} nodes), got up to "
                                 f"{max(self.cost_lengths)}")


def measure_floor(target: Transformer, hf_model, settings: FloorSettings) -> dict:
    """The decode loop's floor and ceiling on this machine: plain tokens/s of selfspec and of
    Hugging Face `generate` on the same weights, c(N), and the oracle drafter's speedup at
    each draft length beside the bound tau / c(k + 1) (its drafting costs nothing), with the
    time split of its steps (synchronized at every phase boundary on a GPU)."""
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
        methods = [method_cost_row(name, target, settings.method_tree, prompts,
                                   settings.new_tokens, profile, settings.seed,
                                   settings.cuda_graphs) for name in settings.methods]
    return {"plain_tokens_per_s": statistics.median(ours.tokens_per_s),
            "hf_plain_tokens_per_s": statistics.median(theirs.tokens_per_s),
            "cuda_graphs": use_cuda_graphs(graphs, target),
            "compiled": target.compile_steps,
            "setup_seconds": setup_seconds(target),
            "peak_memory_mb": memory.peak_mb, "peak_memory_kind": memory.kind,
            "cost_profile": profile.as_dict(), "oracle": oracle, "oracle_trees": trees,
            "methods": methods, "settings": asdict(settings)}


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
            "time_split": row.time_split}
