"""Exact verification of linear and tree drafts: pure functions over probability tensors.

The output law of every function here equals the target's: tokens are accepted by
(recursive) rejection sampling, and on rejection the next token is drawn from the residual
max(p - q, 0), renormalised (Leviathan et al. 2023; Chen et al. 2023; SpecInfer's recursive
rejection sampling over sibling candidates). Greedy decoding is the special case of one-hot
target rows: a draft is kept iff it equals the argmax, and no random number is drawn.

Everything here handles one draft (batch size one). No model calls, no caches, no global RNG:
randomness comes only from the `torch.Generator` passed in, and only when an outcome is random.
The generator must live on p's device (`torch.Generator(device=p.device)`); q, when given, on
that device too. The returned tensors are on p's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from selfspec.sampling import check_generator, sample, sample_rows
from selfspec.tree import Tree

_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Acceptance:
    """What a verification step keeps.

    tokens: [num_accepted + 1] the accepted draft tokens, then one corrected or bonus token.
    num_accepted: how many draft tokens were accepted (the extra token excluded).
    path: [num_accepted] accepted node indices, root to leaf (0..num_accepted-1 for a chain).
    """

    tokens: torch.Tensor
    num_accepted: int
    path: torch.Tensor


def verify_linear(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Verify a linear draft of k tokens.

    draft_tokens: [k] the drafted tokens.
    q: [k, V] row i is the distribution draft token i was drawn from, or None when the drafts
        were chosen deterministically (argmax, top-k, lookup).
    p: [k+1, V] target probabilities (after `logits_to_probs`): row 0 after the last committed
        token, row i+1 after draft token i.
    generator: the source of randomness, a torch.Generator on p's device; needed unless
        every outcome is certain (greedy). One on another device is refused (ValueError).
    """
    _check_token_vector(draft_tokens, "draft_tokens")
    tree = _chain(int(draft_tokens.shape[0]))
    return _verify(tree, draft_tokens, q, p, generator, False, tokens_name="draft_tokens")


def verify_tree(
    tree: Tree,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    without_replacement: bool = False,
) -> Acceptance:
    """Verify a draft tree of N nodes by recursive rejection sampling over siblings.

    tokens: [N] node i's token.
    q: [N, V] row i is the distribution node i was drawn from (for siblings drawn without
        replacement: the distribution *before* earlier siblings were removed), or None when
        the children were chosen deterministically (top-k).
    p: [N+1, V] target probabilities: row 0 after the root (the last committed token), row
        i+1 after node i.
    generator: as for `verify_linear`: a torch.Generator on p's device, needed unless every
        outcome is certain.
    without_replacement: siblings were sampled without replacement, so the proposal for a
        later sibling is q with the earlier siblings' tokens removed and renormalised.
    """
    if not isinstance(tree, Tree):
        raise ValueError(f"verify_tree: tree must be a selfspec.Tree, got {type(tree).__name__}")
    _check_token_vector(tokens, "tokens")
    return _verify(tree, tokens, q, p, generator, without_replacement, tokens_name="tokens")


def verify_greedy(tree: Tree, tokens: Sequence[int], target_tokens: Sequence[int]) -> Acceptance:
    """Greedy verification from the target's argmax alone: `verify_tree` with one-hot target
    rows, without building them.

    tokens: [N] node i's token; target_tokens: [N+1] the target's argmax after the root (0)
    and after node i (i+1), lowest index on ties as in `logits_to_probs`. A child is accepted
    iff its token is its parent's argmax; the last token is the argmax where the walk stops.
    Plain lists: the decode loop reads the argmax row back once per step and walks the tree
    on the host, with no per-node device reads. Trusted input (the loop builds it). The
    result lives on the CPU, where its inputs are (lists).
    """
    path, last = greedy_path(tree, tokens, target_tokens)
    return Acceptance(tokens=torch.tensor([*(tokens[i] for i in path), last]),
                      num_accepted=len(path), path=torch.tensor(path, dtype=torch.long))


def greedy_path(tree: Tree, tokens: Sequence[int], target_tokens: Sequence[int]
                ) -> tuple[list[int], int]:
    """`verify_greedy`'s walk, all on the host: the accepted nodes, root to leaf, and the
    target's token where the walk stops."""
    node, path = -1, []
    while True:
        want = target_tokens[node + 1]
        child = next((c for c in tree.children_of(node) if tokens[c] == want), None)
        if child is None:
            return path, want
        node = child
        path.append(child)


def tree_draws(children: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
               generator: torch.Generator | None, without_replacement: bool = False
               ) -> torch.Tensor:
    """A sampled tree's verification, every draw made on the device at once (nothing read
    back): [2(N + 1)] = per row of p (the root, then node i) the child it accepts (-1: none),
    then the token it emits when the walk stops there (a draw from its residual once all
    its children are rejected; from p's row at a leaf).

    The walk from the root follows one child per node, and a node's test depends only on
    its own row of p and its children, never on how the walk reached it. So every node runs
    its siblings' recursive rejection sampling at once, column by column of `children`
    ([N+1, K] from `children_table`), with its own random numbers: the walk
    (`tree_outcome`) is `verify_trusted`'s in law. A chain is the tree of one column.
    tokens [N], q [N, V] (the laws they were drawn from, before earlier siblings were
    removed when `without_replacement`), p [N+1, V]; trusted input."""
    rows, width = children.shape[0], children.shape[1] if len(tokens) else 0  # 0: no nodes
    u = torch.rand(rows, width, generator=generator, dtype=torch.float64, device=p.device)
    residual = p  # [N+1, V] each node's law for what it emits next
    removed = torch.zeros_like(p, dtype=torch.bool)  # its rejected children's tokens
    accepted = torch.full((rows,), -1, dtype=torch.long, device=p.device)
    for column in range(width):
        child = children[:, column]
        open_ = (child >= 0) & (accepted < 0)  # a child to test, none accepted before it
        node = child.clamp(min=0)  # padding reads node 0, and is never open
        x, proposal = tokens[node], q[node]
        if without_replacement:
            proposal = proposal.masked_fill(removed, 0.0)
            proposal = proposal / proposal.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        at = x[:, None]
        ratio = residual.gather(1, at)[:, 0].double() / proposal.gather(1, at)[:, 0].double()
        accepted = torch.where(open_ & (u[:, column] < ratio), child, accepted)
        rejected = open_ & (accepted < 0)
        residual = torch.where(rejected[:, None], _residuals(residual, proposal), residual)
        removed = removed.scatter(1, at, removed.gather(1, at) | rejected[:, None])
    return torch.cat([accepted, sample_rows(residual, generator)])


def tree_outcome(draws: Sequence[int]) -> tuple[list[int], int]:
    """From `tree_draws` read back: the accepted nodes, root to leaf, and the token emitted
    after them."""
    rows = len(draws) // 2
    node, path = -1, []
    while (child := draws[node + 1]) >= 0:
        path.append(child)
        node = child
    return path, draws[rows + node + 1]


def _residuals(residual: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """Row by row ([..., V]): norm(max(residual - proposal, 0)), or residual where that has
    no mass (a rejection of probability zero when residual == proposal, up to float
    noise)."""
    updated = (residual - proposal).clamp_(min=0.0)
    total = updated.sum(dim=-1, keepdim=True)
    return torch.where(total > 1e-12, updated / total.clamp(min=1e-30), residual)


def verify_trusted(
    tree: Tree,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
    without_replacement: bool = False,
) -> Acceptance:
    """`verify_tree` without its input checks, for the decode loop, whose drafts and
    probabilities are well-formed by construction: the checks read every probability row
    (float64 sums, minima, q at every token) on every step. Call `verify_tree` anywhere else.
    Recursive rejection sampling over the tree."""
    token_list = tokens.tolist()
    node, path = -1, []
    residual = p[0]  # [V] the law the next emitted token must follow
    while children := tree.children_of(node):
        rejected: list[int] = []  # tokens of rejected siblings
        for child in children:
            x = token_list[child]
            proposal = _proposal(q, child, rejected, without_replacement)
            if _accept(residual, proposal, x, generator):
                path.append(child)
                node, residual = child, p[child + 1]
                break
            residual = _residual(residual, proposal, x)
            rejected.append(x)
        else:
            break  # every child rejected: the last token comes from the residual
    accepted = [token_list[i] for i in path]
    final = sample(residual, generator)
    return Acceptance(
        tokens=torch.tensor([*accepted, final], dtype=torch.long, device=p.device),
        num_accepted=len(path),
        path=torch.tensor(path, dtype=torch.long, device=p.device),
    )


@lru_cache(maxsize=64)
def _chain(k: int) -> Tree:
    return Tree.chain(k)


def _verify(tree: Tree, tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
            generator: torch.Generator | None, without_replacement: bool, tokens_name: str
            ) -> Acceptance:
    if isinstance(p, torch.Tensor):  # a setup error: refused before the values are read
        check_generator(generator, p.device, "verify")
    _check_inputs(tree, tokens, q, p, without_replacement, tokens_name)
    return verify_trusted(tree, tokens, q, p, generator, without_replacement)


def _proposal(
    q: torch.Tensor | None, node: int, removed: list[int], without_replacement: bool
) -> torch.Tensor | None:
    """The law node's token was drawn from; None = a point mass on the token itself."""
    if q is None:
        return None
    if not (without_replacement and removed):
        return q[node]
    proposal = q[node].clone()
    proposal[removed] = 0.0
    return proposal / proposal.sum()


def _accept(
    residual: torch.Tensor,
    proposal: torch.Tensor | None,
    x: int,
    generator: torch.Generator | None,
) -> bool:
    """Accept x with probability min(1, residual(x) / proposal(x))."""
    ratio = float(residual[x]) / (1.0 if proposal is None else float(proposal[x]))
    if ratio >= 1.0 or ratio <= 0.0:
        return ratio >= 1.0  # a certain outcome draws no random number
    if generator is None:
        raise ValueError(
            f"verify: this draft is accepted at random; pass "
            f"generator=torch.Generator(device='{residual.device}').manual_seed(seed)"
        )
    u = torch.rand((), generator=generator, dtype=torch.float64, device=residual.device)
    return float(u) < ratio


def _residual(residual: torch.Tensor, proposal: torch.Tensor | None, x: int) -> torch.Tensor:
    """After rejecting x: norm(max(residual - proposal, 0)), a point mass at x when proposal
    is None (which zeroes x alone: residual(x) <= 1)."""
    if proposal is None:
        proposal = torch.zeros_like(residual)
        proposal[x] = 1.0
    return _residuals(residual, proposal)


# ---- input checks ------------------------------------------------------------------------


def _check_token_vector(tokens: torch.Tensor, name: str) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise ValueError(f"verify: {name} must be a 1-D integer tensor of token ids")


def _check_inputs(
    tree: Tree,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    without_replacement: bool,
    tokens_name: str,
) -> None:
    n = tree.num_nodes
    if tokens.shape[0] != n:
        raise ValueError(f"verify: {tokens_name} has {tokens.shape[0]} entries, the tree {n} nodes")
    _check_probs("p", p, rows=n + 1)
    vocab = p.shape[1]
    if n and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"verify: {tokens_name} holds ids outside [0, {vocab}) (p's vocab size)")
    if q is not None:
        _check_probs("q", q, rows=n)
        if q.device != p.device:
            raise ValueError(
                f"verify: q is on {q.device} but p on {p.device}: pass both on one device"
            )
        if q.shape[1] != vocab:
            raise ValueError(
                f"verify: q has vocab size {q.shape[1]} but p has {vocab}: draft and target "
                f"must share one vocabulary"
            )
        rows = torch.arange(n, device=q.device)
        if n and (q[rows, tokens.to(q.device)] <= 0).any():
            raise ValueError(
                "verify: a drafted token has probability 0 under its q row, so it cannot have "
                "been drawn from q; pass the distribution each token was sampled from"
            )
    if without_replacement:
        _check_distinct_siblings(tree, tokens.tolist(), tokens_name)


def _check_probs(name: str, probs: torch.Tensor, rows: int) -> None:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"verify: {name} must be a 2-D [rows, vocab] probability tensor")
    if probs.shape[0] != rows:
        raise ValueError(f"verify: {name} has {probs.shape[0]} rows, expected {rows}")
    sums = probs.sum(dim=1, dtype=torch.float64)  # [rows]; NaN or inf anywhere shows here
    if not torch.isfinite(sums).all():
        raise ValueError(f"verify: {name} holds NaN or infinite values")
    if rows and probs.min() < 0:
        raise ValueError(f"verify: {name} holds negative probabilities")
    if rows and ((sums - 1.0).abs() > _SUM_TOLERANCE).any():
        raise ValueError(
            f"verify: the rows of {name} must sum to 1 (got sums from {float(sums.min()):.4g} "
            f"to {float(sums.max()):.4g}); pass probabilities from logits_to_probs, not logits"
        )


def _check_distinct_siblings(tree: Tree, tokens: list[int], tokens_name: str) -> None:
    for parent in range(-1, tree.num_nodes):
        sibling_tokens = [tokens[c] for c in tree.children_of(parent)]
        if len(set(sibling_tokens)) != len(sibling_tokens):
            raise ValueError(
                f"verify: siblings under node {parent} repeat a token in {tokens_name}, "
                f"which sampling without replacement cannot produce"
            )
