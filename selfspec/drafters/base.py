"""The drafter protocol: what every drafter receives and what it proposes.

A drafter proposes a `Draft` (a tree of tokens and, when they were sampled, the distributions
they were drawn from); the decode loop verifies it against the target in one forward. Target
features a drafter needs (hidden states) reach it explicitly through `DraftContext`, never
through hooks on modules.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from selfspec.model.kv_cache import KVCache, SegmentedKVCache
from selfspec.sampling import SamplingParams
from selfspec.tree import DeviceTree, Tree, host_tree

if TYPE_CHECKING:
    from selfspec.model import Transformer


@dataclass(frozen=True)
class EarlyLayers:
    """What a draft already ran of the target itself (early-exit drafting): the target's
    layers [0, exit_layer) over the first n rows of the verification forward (the root, then
    draft nodes 0..n-2, in order). Their K/V sit in the target's cache at slots
    [length, length + n), length being the cache's length when `propose` returned; hidden
    [n, hidden_size] are their residual streams entering layer exit_layer. Verification then
    runs layers [0, exit_layer) over the remaining rows only and layers
    [exit_layer, num_layers) over every row (`selfspec.decode`)."""

    exit_layer: int
    hidden: torch.Tensor


@dataclass(frozen=True)
class ExtraRows:
    """Rows a draft adds to the verification forward that are not draft nodes (Lookahead's
    Jacobi window): they follow the nodes in the forward, are never accepted, and their
    logits come back to the drafter in the next `DraftContext.extra_logits`.

    tokens [R]; offsets [R]: positions relative to the root's (the root is at 0); mask
    [R, 1 + R] bool: which of (the root, the extra rows) each row attends to, besides the
    committed cache. Draft nodes never attend to extra rows, so the verified logits are those
    of a forward without them."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        rows = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.offsets.shape != (rows,) \
                or self.mask.shape != (rows, rows + 1) or self.mask.dtype != torch.bool:
            raise ValueError(f"ExtraRows: tokens [R], offsets [R] and a bool mask [R, 1 + R], "
                             f"got {list(self.tokens.shape)}, {list(self.offsets.shape)}, "
                             f"{self.mask.dtype} {list(self.mask.shape)}")

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class Draft:
    """tree: the draft's shape (a `DeviceTree` where only the device knows it); tokens [N]:
    node i's token; q [N, V] | None: the law each token was drawn from (None = chosen
    deterministically); without_replacement: siblings
    were sampled without replacement (see `selfspec.verify.verify_tree`); early: the target
    layers the draft already ran over its first rows (None: verification runs every layer);
    extra: rows the verification forward carries for the drafter that are not nodes."""

    tree: Tree | DeviceTree
    tokens: torch.Tensor
    q: torch.Tensor | None = None
    without_replacement: bool = False
    early: EarlyLayers | None = None
    extra: ExtraRows | None = None

    @property
    def rows(self) -> int:
        """What the draft adds to the verification forward: its nodes and extra rows."""
        return self.tree.num_nodes + (self.extra.rows if self.extra is not None else 0)

    @classmethod
    def empty(cls) -> Draft:
        return cls(Tree.chain(0), torch.empty(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens: torch.Tensor | list[int], q: torch.Tensor | None = None,
              early: EarlyLayers | None = None) -> Draft:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return cls(Tree.chain(len(tokens)), tokens, q, early=early)

    @classmethod
    def from_paths(cls, paths: Sequence[tuple[int, ...]],
                   device: torch.device | str = "cpu") -> Draft:
        """A chosen (q=None) draft whose nodes are the token paths `paths` from the root,
        each listed after its parent path (prefix-closed)."""
        index = {path: i for i, path in enumerate(paths)}
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        tokens = torch.tensor([p[-1] for p in paths], dtype=torch.long, device=device)
        return cls(Tree.from_parents(parents), tokens)

    def token_paths(self) -> list[tuple[int, ...]]:
        """Each node's token path from the root, in node order (one host read)."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens.tolist(), host_tree(self.tree).parents, strict=True):
            paths.append((*(paths[parent] if parent >= 0 else ()), token))
        return paths


@dataclass(frozen=True)
class DecodeSetup:
    """What a drafter learns when a generation begins.

    max_length: the most tokens (prompt + generated + one draft) the generation can reach.
    target_cache: the target's own KV cache, for a drafter that runs the target's early
    layers itself (its draft's K/V there are then reused by verification: `EarlyLayers`).
    static_steps: whether the target runs static steps (CUDA graphs on CUDA, `selfspec.step`);
    a drafter with a model of its own runs that model the same way.
    rows: how many prompts the generation decodes together (a batch's rows may decode
    differently from one prompt alone, up to float rounding).
    """

    target: Transformer
    prompt: torch.Tensor
    sampling: SamplingParams
    generator: torch.Generator | None
    max_length: int
    target_cache: KVCache | None = None
    static_steps: bool = False
    rows: int = 1


@dataclass(frozen=True)
class TargetFeatures:
    """The target's states at the rows committed by its last forward, oldest first.

    tokens [A]: their token ids; last_hidden [A, hidden]: the normed final hidden state (what
    the LM head reads); hidden: the residual streams the drafter asked for
    (`Drafter.target_layers`), each [A, hidden].
    """

    tokens: torch.Tensor
    last_hidden: torch.Tensor
    hidden: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class DraftContext:
    """tokens [L]: prompt + generated so far; the last one (the root) is not yet in the
    target's cache. features: the target's states for the rows its last forward committed
    (None before the first forward, e.g. for a one-token prompt). extra_logits [R, V]: the
    target's logits at the previous draft's extra rows (None when it had none). history: the
    same tokens as host ints, where the caller holds them (the decode loop does)."""

    tokens: torch.Tensor
    features: TargetFeatures | None
    extra_logits: torch.Tensor | None = None
    history: tuple[int, ...] | None = None

    def token_list(self) -> Sequence[int]:
        """The tokens as host ints: `history` where given, else read back from the device."""
        return self.history if self.history is not None else self.tokens.tolist()


class Drafter(Protocol):
    """max_nodes: the most rows one draft may add to the verification forward, its nodes and
    any extra rows (sizes the target's cache).
    target_layers: residual-stream layers whose states the drafter needs from the target."""

    max_nodes: int
    target_layers: tuple[int, ...]

    def begin(self, setup: DecodeSetup) -> None:
        """Reset per-generation state; refuse a target it cannot draft for (clear error)."""

    def propose(self, context: DraftContext) -> Draft:
        """A draft to follow context.tokens."""


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that drafts a batch's rows together (the draft model: one forward of its
    model per drafted token over every row). In a batch the loop hands it every row itself,
    where another drafter gets a `fork` per row; one prompt, it is a plain `Drafter`."""

    def begin_rows(self, setups: Sequence[DecodeSetup]) -> None:
        """Begin a batch: its rows' setups, in order (as `begin` for each)."""

    def propose_rows(self, rows: Sequence[int], contexts: Sequence[DraftContext]
                     ) -> list[Draft]:
        """The drafts of the unfinished rows `rows` (their indices in `begin_rows`' setups,
        in order), each the draft of its context."""


@runtime_checkable
class LearningDrafter(Drafter, Protocol):
    """A drafter that learns from the answers it drafted (suffix decoding's store): the loop
    hands it each row's tokens when the row stops, so that it learns the whole answer, the last
    step's tokens included (no proposal follows them)."""

    def finish(self, tokens: Sequence[int]) -> None:
        """The row's prompt and answer, as host ints, once it has stopped."""

    def forget(self) -> None:
        """Forget every answer learnt so far (a measurement's warmup decodes a measured
        prompt, and must not teach the drafter its answer)."""


def fork(drafter: Drafter) -> Drafter:
    """Another instance of `drafter` for another row of a batch, with the same weights and
    read-only data and its own per-generation state (`begin` then resets it for its row).

    The rule: a fork shares every module, generator and tensor it holds, since drafting only
    reads them, and every object whose class sets `shared_by_forks = True` (read-only data
    such as a lookup corpus, or static steps a batch never runs); it copies everything else
    (its lists, dicts, counters and the objects holding them), and its KV caches, which are
    what a row writes."""
    memo: dict[int, object] = {}
    _collect_shared(drafter, memo, set())
    return copy.deepcopy(drafter, memo)


def _collect_shared(value: object, memo: dict[int, object], seen: set[int]) -> None:
    """`copy.deepcopy`'s memo for a fork: what it shares, each mapped to itself."""
    if id(value) in seen or isinstance(value, KVCache | SegmentedKVCache):
        return
    seen.add(id(value))
    if isinstance(value, nn.Module | torch.Generator | torch.Tensor) \
            or getattr(type(value), "shared_by_forks", False):
        memo[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            _collect_shared(item, memo, seen)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _collect_shared(item, memo, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for item in vars(value).values():
            _collect_shared(item, memo, seen)
