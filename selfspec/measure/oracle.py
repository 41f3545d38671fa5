"""A drafter that knows the answer: the target's own greedy continuation, proposed in chunks.

With a perfect drafter every draft token is accepted (tau = k + 1 until the end), so its
speedup over plain decoding is the ceiling of the decode loop on this machine: it should sit
near tau / c(k + 1) (see `selfspec.measure.costs`). Greedy decoding only.

`OracleTreeDrafter` hides that answer in a tree of a given shape (EAGLE-2's, Medusa's), along
its rank-0 path, with random tokens at every other node: the whole tree path (its forward
of N + 1 rows, its mask, the walk) runs at a known tau, whose ceiling is tau / c(N + 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.checks import check_count
from selfspec.decode import generate
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.step import use_cuda_graphs
from selfspec.tree import Tree


class OracleDrafter:
    """Proposes the next num_draft_tokens tokens of plain greedy decoding. The answers are
    computed by `prepare` (or, for a prompt it did not see, in `begin`) and kept per target,
    forward mode and prompt: a timed generation of a prepared prompt only replays its answer.

    The forward mode (static steps or eager, `DecodeSetup.static_steps`) is part of the key:
    in bf16 the two round a near-tie of the greedy argmax apart, and an answer of one mode
    replayed in the other stops being accepted at the first such tie. So is a batch: its
    rows' answers are those of plain decoding of the same batch (`prepare_batch`), whose
    products over B rows may round otherwise than one row's."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, num_draft_tokens: int = 4):
        check_count("num_draft_tokens", num_draft_tokens, owner="OracleDrafter")
        self.num_draft_tokens = self.max_nodes = num_draft_tokens
        self._answer: list[int] = []
        self._prompt_length = 0
        # (id(target), static steps, prompt) -> greedy answer
        self._answers: dict[tuple, list[int]] = {}

    def prepare(self, target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                cuda_graphs: bool | None = None) -> None:
        """Compute the greedy answers ahead of the generations that will replay them (which
        `begin` would otherwise do inside the caller's timing), in the forward mode those
        generations run (cuda_graphs: as `generate`'s)."""
        static = use_cuda_graphs(cuda_graphs, target)
        for prompt in prompts:
            self._answer_for(target, torch.as_tensor(list(prompt)), max_new_tokens, static)

    def prepare_batch(self, target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      cuda_graphs: bool | None = None) -> None:
        """The answers of a batch's rows: plain greedy decoding of the prompts as one batch
        (cuda_graphs: as `generate`'s), which a batch of these prompts then replays."""
        results = generate(target, [list(p) for p in prompts], max_new_tokens=max_new_tokens,
                           cuda_graphs=cuda_graphs)
        for prompt, result in zip(prompts, results, strict=True):
            self._answers[(id(target), ("rows", len(prompts)), tuple(prompt))] = result.tokens

    def with_draft_tokens(self, num_draft_tokens: int) -> OracleDrafter:
        """An oracle of another draft length that shares these answers."""
        other = OracleDrafter(num_draft_tokens)
        other._answers = self._answers
        return other

    def with_tree(self, tree: Tree | Sequence[Sequence[int]]) -> OracleTreeDrafter:
        """An oracle over a tree (`OracleTreeDrafter`) that shares these answers."""
        other = OracleTreeDrafter(tree)
        other._answers = self._answers
        return other

    def _answer_for(self, target, prompt: torch.Tensor, length: int, static: bool
                    ) -> list[int]:
        key = (id(target), static, tuple(prompt.tolist()))
        known = self._answers.get(key, [])
        if len(known) < length:  # greedy answers are prefixes of longer ones
            known = self._answers[key] = generate(target, prompt, max_new_tokens=length,
                                                  cuda_graphs=static).tokens
        return known[:length]

    def begin(self, setup: DecodeSetup) -> None:
        if not setup.sampling.greedy:
            raise ValueError("OracleDrafter replays greedy decoding: use temperature 0")
        room = setup.max_length - len(setup.prompt) - self.max_nodes - 1
        batch = (id(setup.target), ("rows", setup.rows), tuple(setup.prompt.tolist()))
        self._answer = (self._answers[batch][:room] if batch in self._answers
                        else self._answer_for(setup.target, setup.prompt, room,
                                              setup.static_steps))
        self._prompt_length = len(setup.prompt)

    def propose(self, context: DraftContext) -> Draft:
        done = len(context.tokens) - self._prompt_length  # tokens generated so far
        chunk = self._answer[done : done + self.num_draft_tokens]
        return Draft.chain(torch.tensor(chunk, dtype=torch.long, device=context.tokens.device))


class OracleTreeDrafter(OracleDrafter):
    """The oracle's answer along `tree`'s rank-0 path (nodes (0), (0, 0), ...), random tokens
    at its other nodes (from a generator of its own, on the target's device, so drafting reads
    nothing back). Every step accepts the whole rank-0 path: tau = its length + 1."""

    def __init__(self, tree: Tree | Sequence[Sequence[int]], seed: int = 0) -> None:
        self.tree = tree if isinstance(tree, Tree) else Tree.from_paths(tree)
        path = [i for i, choice in enumerate(self.tree.choices) if not any(choice)]
        if not path:
            raise ValueError("OracleTreeDrafter: the tree has no rank-0 child of the root, "
                             "where the answer goes; give a tree with a node [0]")
        super().__init__(len(path))
        self.max_nodes, self.seed = self.tree.num_nodes, seed
        self._path = path  # the rank-0 path, root to leaf (a chain: each the last's child)
        self._noise: torch.Generator | None = None

    def with_draft_tokens(self, num_draft_tokens: int) -> OracleDrafter:
        raise ValueError("OracleTreeDrafter: its draft is its tree; build another tree")

    def begin(self, setup: DecodeSetup) -> None:
        super().begin(setup)
        device = setup.target.embed_tokens.weight.device
        self._vocab = setup.target.config.vocab_size
        self._noise = torch.Generator(device=device).manual_seed(self.seed)
        self._at = torch.tensor(self._path, device=device)

    def propose(self, context: DraftContext) -> Draft:
        device = context.tokens.device
        chunk = super().propose(context).tokens.to(device)
        tokens = torch.randint(self._vocab, (self.tree.num_nodes,), generator=self._noise,
                               device=device)
        tokens[self._at[: len(chunk)]] = chunk
        return Draft(self.tree, tokens)


def eagle2_shape(total_tokens: int = 60, depth: int = 6, top_k: int = 10) -> Tree:
    """The tree EAGLE-2 grows when every node's children score alike, the rank-r child r
    nats below the best: a top_k frontier grown `depth` levels, the best total_tokens kept
    (ties: the earlier made). Its defaults are EAGLE-2's published setting."""
    nodes, frontier = [], [(-1, 0.0)]  # (parent, score) per node; the frontier as (node, score)
    for _ in range(depth):
        level = []
        for parent, score in frontier:
            for rank in range(top_k):
                nodes.append((parent, score - rank))
                level.append((len(nodes) - 1, score - rank))
        frontier = sorted(level, key=lambda node: (-node[1], node[0]))[:top_k]
    kept = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], i))[:total_tokens])
    index = {node: i for i, node in enumerate(kept)} | {-1: -1}
    return Tree.from_parents([index[nodes[i][0]] for i in kept])
