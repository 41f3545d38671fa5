"""What each method's drafting costs on the running machine, with random heads
(eval/bench_decode.py): a random head is accepted about never, but it drafts exactly the work
a trained one drafts, so its draft time per step, in plain-step units, is the method's draft
cost. `mtp` drafts with the target's own MTP module (a target that has one: model=random-mtp,
whose module is random too). With a published tau it projects the method's speedup,
tau / (c(N + 1) + draft cost), which is labelled a projection wherever it is shown."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.drafters import DFlashDrafter, EagleDrafter, EarlyExitDrafter, MedusaDrafter
from selfspec.drafters.mtp import MtpDrafter
from selfspec.heads import (
    DFlashConfig,
    DFlashHead,
    EagleConfig,
    EagleHead,
    ExitConfig,
    ExitHead,
    MedusaConfig,
    MedusaHeads,
)
from selfspec.measure.costs import CostProfile
from selfspec.measure.passes import compare_with_plain
from selfspec.model import Transformer

# Published tau, Vicuna-7B, MT-bench, greedy (the EAGLE-2 paper's comparison).
PUBLISHED = "Vicuna-7B, MT-bench, T=0, EAGLE-2 paper"
METHODS = {  # name: (published tau or None, what drafts)
    "eagle2": (4.98, "EAGLE-1 head, EAGLE-2 tree: 60 nodes, depth 6, top-10"),
    "eagle3": (None, "EAGLE-3 head, EAGLE-2 tree: 60 nodes, depth 6, top-10"),
    "eagle1": (3.94, "EAGLE-1 head, the static tree (EAGLE-1's tau is for its own tree)"),
    "medusa": (2.52, "4 Medusa heads, the static tree"),
    "early_exit": (None, "adapter exit at E = L/4, 4 tokens a step"),
    "dflash": (None, "DFlash head, one layer, 8 tokens drafted in one forward (a chain)"),
    "mtp": (None, "the target's own MTP module, EAGLE-2 tree: 60 nodes, depth 6, top-10"),
}


def random_drafter(name: str, target: Transformer, tree: Sequence[Sequence[int]], seed: int):
    """The method's drafter over random heads (seeded), on the target's device and dtype."""
    config, weight = target.config, target.embed_tokens.weight
    torch.manual_seed(seed)
    if name in ("eagle1", "eagle2", "eagle3"):
        version = 3 if name == "eagle3" else 1
        extra = {"draft_vocab_size": config.vocab_size // 4} if version == 3 else {}
        head = EagleHead(EagleConfig.for_target(config, version, **extra)).to(weight)
        shape = {"tree": tree} if name == "eagle1" else {"total_tokens": 60, "depth": 6,
                                                        "top_k": 10}
        return EagleDrafter(head.eval(), **shape)
    if name == "medusa":
        heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=4))
        return MedusaDrafter(heads.to(weight).eval(), tree)
    if name == "dflash":
        head_config = DFlashConfig.for_target(config, mask_token_id=config.vocab_size - 1,
                                              block_size=9)
        return DFlashDrafter(DFlashHead(head_config).to(weight).eval())
    if name == "mtp":  # the target's own module: no head to make
        return MtpDrafter(target, total_tokens=60, depth=6, top_k=10)
    if name == "early_exit":
        exit_config = ExitConfig.for_target(config, max(1, config.num_layers // 4))
        return EarlyExitDrafter(ExitHead(exit_config).to(weight).eval(), 4)
    raise ValueError(f"unknown method {name!r}: choose from {', '.join(METHODS)}")


def method_cost_row(name: str, target: Transformer, tree: Sequence[Sequence[int]],
                    prompts: list, new_tokens: int, profile: CostProfile, seed: int,
                    cuda_graphs: bool | None) -> dict:
    """One method's draft cost (plain-step units, per step and per drafted token), its step's
    time split, c(N + 1) and, where a tau was published, the projected speedup."""
    drafter = random_drafter(name, target, tree, seed)
    row = compare_with_plain(target, drafter, prompts, max_new_tokens=new_tokens, seed=seed,
                             split_time=True, cuda_graphs=cuda_graphs)
    nodes = drafter.max_nodes
    draft_cost = row.time_split["draft"]["s_per_step"] * row.plain_tokens_per_s
    tau, what = METHODS[name]
    verify = profile.c(nodes + 1)
    return {"method": name, "drafts": what, "nodes": nodes, "draft_cost": draft_cost,
            "draft_cost_per_level": draft_cost / _levels(drafter), "c_verify": verify,
            "step_cost": verify + draft_cost, "random_tau": row.tau, "lossless": row.lossless,
            "first_difference": row.first_difference,
            "time_split": row.time_split, "published_tau": tau,
            "projected_speedup": None if tau is None else tau / (verify + draft_cost),
            "published": PUBLISHED if tau is not None else None}


def _levels(drafter) -> int:
    """The drafter's sequential forwards a step: an early exit's tokens, an EAGLE tree's
    levels, one for Medusa's heads and for DFlash's block."""
    if isinstance(drafter, EarlyExitDrafter):
        return drafter.num_draft_tokens
    if isinstance(drafter, EagleDrafter):
        return drafter.shape.depth
    return 1
