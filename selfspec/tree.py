"""Draft trees: the shape of what a drafter proposes and the target verifies in one forward.

Node indices run 0..N-1 in topological order (a parent before its children). The *root* is the
last committed token; it is not a node, and its index is -1 in `parents`. In a verification
forward the root is fed first, so the "with root" tensors have N+1 rows: row 0 is the root,
row i+1 is node i. A linear draft is a chain: `Tree.chain(k)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch


@dataclass(frozen=True, eq=False)
class Tree:
    """A frozen draft tree.

    parents: parent index of every node (-1 = the root), topologically ordered.
    choices: per node, the candidate ranks on its root-to-node path (Medusa "choices");
        `choices[i][-1]` is which candidate of its parent's distribution node i is
        (0 = most likely), which is how a top-k drafter assigns tokens to nodes.
    """

    parents: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def chain(cls, k: int) -> Tree:
        """A linear draft of k tokens."""
        if k < 0:
            raise ValueError(f"Tree.chain: k must be >= 0, got {k}")
        return cls.from_parents(list(range(-1, k - 1)))

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> Tree:
        """A tree from each node's parent index (-1 = root); nodes must be topologically ordered.

        Children keep index order, and a child's candidate rank is its position among its
        siblings. Trees are immutable, so a dynamic drafter's recurring shapes come from a
        cache with their masks already built.
        """
        return _tree_from_parents(cls, tuple(int(p) for p in parents))

    @classmethod
    def _build_from_parents(cls, parents: tuple[int, ...]) -> Tree:
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(
                    f"Tree.from_parents: parents[{i}] = {parent}, but a node's parent must be -1 "
                    f"(the root) or an earlier node (0..{i - 1}): nodes must be listed in "
                    f"topological order, parents before children"
                )
        choices: list[tuple[int, ...]] = []
        num_children = [0] * (len(parents) + 1)  # indexed by parent + 1
        for parent in parents:
            prefix = choices[parent] if parent >= 0 else ()
            choices.append((*prefix, num_children[parent + 1]))
            num_children[parent + 1] += 1
        return cls(parents, tuple(choices))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> Tree:
        """A tree from Medusa-style choices: `[[0], [1], [0, 0], [0, 1]]`.

        Each path lists candidate ranks from the root: `[0, 1]` is the second candidate after
        the top-1 candidate. Every proper prefix of a path must be a path too.
        """
        unique = sorted({tuple(int(c) for c in path) for path in paths}, key=lambda p: (len(p), p))
        index = {path: i for i, path in enumerate(unique)}
        parents = []
        for path in unique:
            if not path or min(path) < 0:
                raise ValueError(
                    f"Tree.from_paths: every path must be a non-empty list of ranks >= 0, "
                    f"got {list(path)}"
                )
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(
                    f"Tree.from_paths: path {list(path)} has no parent path {list(path[:-1])}; "
                    f"add it to the choices"
                )
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
        return cls(tuple(parents), tuple(unique))

    # ---- structure ----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, depth={self.max_depth}, parents={self.parents})"

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[parent + 1]: the children of `parent` (-1 = root), in index order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, parent in enumerate(self.parents):
            kids[parent + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def children_of(self, node: int) -> tuple[int, ...]:
        """The children of `node` (-1 = the root)."""
        return self.children[node + 1]

    @cached_property
    def depth(self) -> torch.Tensor:
        """[N] depth of each node: 1 for the root's children."""
        return torch.tensor([len(c) for c in self.choices], dtype=torch.long)

    @cached_property
    def max_depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_nodes) if not self.children_of(i))

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf paths as node indices, one per leaf."""
        return tuple(tuple(self.path_to(leaf)) for leaf in self.leaves)

    @cached_property
    def retrieve_indices(self) -> torch.Tensor:
        """[num_leaves, max_depth] node indices of each root-to-leaf path, padded with -1."""
        out = torch.full((len(self.leaves), self.max_depth), -1, dtype=torch.long)
        for row, path in enumerate(self.paths):
            out[row, : len(path)] = torch.tensor(path, dtype=torch.long)
        return out

    # ---- tensors for a batched verification forward --------------------------------------

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    @cached_property
    def mask_with_root(self) -> torch.Tensor:
        """[N+1, N+1] bool mask for the forward of [root, node 0, ..., node N-1]."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask
        return mask

    @cached_property
    def positions_with_root(self) -> torch.Tensor:
        """[N+1] position offsets from the root: 0 for the root, depth for each node."""
        return torch.cat([torch.zeros(1, dtype=torch.long), self.depth])

    def verification_inputs(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions_with_root, mask_with_root) on `device`, copied there once per device
        rather than every step."""
        return self._on(device, "inputs", lambda: (self.positions_with_root.to(device),
                                                   self.mask_with_root.to(device)))

    def parents_on(self, device: torch.device | str) -> torch.Tensor:
        """[N] `parents` as a long tensor on `device`, copied there once per device (a copy
        from the host in a decode step would wait for the device's queued work)."""
        return self._on(device, "parents", lambda: torch.tensor(self.parents, dtype=torch.long,
                                                                device=device))

    @cached_property
    def max_children(self) -> int:
        """The most children of one node (the root included): 0 for an empty tree."""
        return max(len(kids) for kids in self.children)

    def children_table(self, device: torch.device | str) -> torch.Tensor:
        """[N+1, K] each node's children in order, padded with -1 (row 0: the root's, row
        i+1: node i's; K = max_children), on `device`, built once per device."""
        def build() -> torch.Tensor:
            table = torch.full((self.num_nodes + 1, max(self.max_children, 1)), -1)
            for row, kids in enumerate(self.children):
                table[row, : len(kids)] = torch.tensor(kids, dtype=torch.long)
            return table.to(device)
        return self._on(device, "children", build)

    def _on(self, device: torch.device | str, name: str, make):
        """A tensor of this (immutable) tree on `device`: made once per device and kept."""
        kept = self.__dict__.setdefault("_on_device", {})
        key = (name, str(device))
        if key not in kept:
            kept[key] = make()
        return kept[key]


@dataclass(frozen=True, eq=False)
class DeviceTree:
    """A draft tree whose shape is known only on the device, as a tensor drafter grows it
    (EAGLE-2 in static steps): parents [N] long (-1 = the root, topologically ordered), no
    deeper than `max_depth_bound`. The verification forward's inputs come from it by tensor
    ops; the decode loop reads the parents back with the target's argmax, in the step's one
    host read, and verifies over `on_host(parents)`. valid [N] bool (None: every node): a
    False node is a row of the verification forward but not a node of the verified tree (a
    sampled node its law could not supply, and everything below it): `nodes_on_host`.
    max_children_bound: no node has more children (None: any number up to N)."""

    parents: torch.Tensor
    max_depth_bound: int
    valid: torch.Tensor | None = None
    max_children_bound: int | None = None

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    def __len__(self) -> int:
        return self.num_nodes

    def on_host(self, parents: Sequence[int]) -> Tree:
        """The host Tree, given the parents as read back."""
        return Tree.from_parents(parents)

    def nodes_on_host(self, parents: Sequence[int], valid: Sequence[bool]
                      ) -> tuple[Tree, list[int]]:
        """The tree of the valid nodes (parents and valid as read back) and, per node of it,
        its index among all N (its forward row - 1). A valid node's parent is valid."""
        kept = [i for i in range(len(parents)) if valid[i]]
        index = {node: i for i, node in enumerate(kept)} | {-1: -1}
        return Tree.from_parents([index[parents[i]] for i in kept]), kept

    def verification_inputs(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions_with_root [N+1], mask_with_root [N+1, N+1]), as `Tree` gives them, by
        tensor ops: each hop adds the parent's ancestors, and after max_depth_bound hops every
        node holds its whole path."""
        n, parents = self.num_nodes, self.parents.to(device)
        eye = torch.eye(n + 1, dtype=torch.bool, device=device)  # row 0: the root
        up = torch.cat([parents.new_zeros(1), parents + 1])  # [N+1] each row's parent row
        mask = eye.clone()
        mask[:, 0] = True
        for _ in range(self.max_depth_bound):
            mask = eye | mask[up]
            mask[:, 0] = True
        return mask.sum(dim=-1) - 1, mask

    def children_table(self, device: torch.device | str) -> torch.Tensor:
        """`Tree.children_table` by tensor ops, [N+1, K] with K = max_children_bound: each
        valid node's children in index order, a child's column its count of valid elder
        siblings."""
        n, parents = self.num_nodes, self.parents.to(device)
        valid = (torch.ones(n, dtype=torch.bool, device=device) if self.valid is None
                 else self.valid.to(device))
        width = max(1, n if self.max_children_bound is None else self.max_children_bound)
        elder = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # [i, j]: j < i
        rank = ((parents[:, None] == parents[None, :]) & elder & valid[None, :]).sum(dim=-1)
        spare = (n + 1) * width  # where the invalid nodes go, cut off below
        slot = torch.where(valid & (rank < width), (parents + 1) * width + rank, spare)
        table = torch.full((spare + 1,), -1, dtype=torch.long, device=device)
        table.scatter_(0, slot, torch.arange(n, device=device))
        return table[:spare].view(n + 1, width)


def host_tree(tree: Tree | DeviceTree) -> Tree:
    """The tree on the host: itself, or a DeviceTree's parents read back (one host read)."""
    if isinstance(tree, Tree):
        return tree
    if tree.valid is not None:
        raise ValueError("host_tree: this tree has rows that are not nodes: use "
                         "DeviceTree.nodes_on_host")
    return tree.on_host(tree.parents.tolist())


@lru_cache(maxsize=512)
def _tree_from_parents(cls: type[Tree], parents: tuple[int, ...]) -> Tree:
    return cls._build_from_parents(parents)
