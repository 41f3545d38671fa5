"""What each method's drafting costs on the running machine, with random heads
(eval/bench_decode.py): a random head is accepted about never, but it drafts exactly the work
a trained one drafts, so its draft time per step, in plain-step units, is the method's draft
cost. Each method's registering module gives its rows (`CostRow`: from_config/methods/); the
MTP row drafts with the target's own module (a target that has one: model=random-mtp, whose
module is random too). With a published tau it projects the method's speedup,
tau / (c(N + 1) + draft cost), which is labelled a projection wherever it is shown."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from selfspec.drafters.base import Drafter
from selfspec.measure.costs import CostProfile
from selfspec.measure.passes import compare_with_plain
from selfspec.model import Transformer

TreeChoices = Sequence[Sequence[int]]  # a static tree, as its choices


@dataclass(frozen=True)
class CostRow:
    """A method's row of the draft costs, as its registering module gives it.

    drafts: what drafts, in words; drafter(target, tree, seed): the method's drafter over random
    heads (seeded), on the target's device and dtype (tree: bench_decode's `method_tree`, for
    the methods that take a static tree); levels(drafter): the sequential forwards it drafts a
    step in (a tree's depth, an early exit's tokens; one for one forward); published_tau and
    published: a tau published for it, and where."""

    drafts: str
    drafter: Callable[[Transformer, TreeChoices, int], Drafter]
    levels: Callable[[Drafter], int] = lambda drafter: 1
    published_tau: float | None = None
    published: str | None = None


# The published taus the rows quote: Vicuna-7B, MT-bench, greedy (the EAGLE-2 paper's table).
EAGLE2_PAPER = "Vicuna-7B, MT-bench, T=0, EAGLE-2 paper"


def method_cost_row(name: str, cost: CostRow, target: Transformer, tree: TreeChoices,
                    prompts: list, new_tokens: int, profile: CostProfile, seed: int,
                    cuda_graphs: bool | None) -> dict:
    """One method's draft cost (plain-step units, per step and per drafted token), its step's
    time split, c(N + 1) and, where a tau was published, the projected speedup."""
    drafter = cost.drafter(target, tree, seed)
    row = compare_with_plain(target, drafter, prompts, max_new_tokens=new_tokens, seed=seed,
                             split_time=True, cuda_graphs=cuda_graphs)
    nodes = drafter.max_nodes
    draft_cost = row.time_split["draft"]["s_per_step"] * row.plain_tokens_per_s
    tau, verify = cost.published_tau, profile.c(nodes + 1)
    return {"method": name, "drafts": cost.drafts, "nodes": nodes, "draft_cost": draft_cost,
            "draft_cost_per_level": draft_cost / cost.levels(drafter), "c_verify": verify,
            "step_cost": verify + draft_cost, "random_tau": row.tau, "lossless": row.lossless,
            "first_difference": row.first_difference,
            "time_split": row.time_split, "published_tau": tau,
            "projected_speedup": None if tau is None else tau / (verify + draft_cost),
            "published": cost.published}
