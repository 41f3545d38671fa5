"""Drafting with Gemma 4's assistant (`selfspec.heads.gemma4_assistant.Gemma4Assistant`): a
chain of k tokens or a static tree, each step reading the target's keys and values where they
already are.

At the root (token t, not yet in the target's cache) the assistant reads the target's scaled
embedding of token t beside the target's normed last hidden state at t - 1 (the committed row
that predicted it: `DraftContext.features`), and the K/V of the target's last sliding and last
full layer over the committed tokens, read from the target's own cache
(`DecodeSetup.target_cache`) without a copy: no extra target forward, no cache of its own.
Step j + 1 reads step j's token and the state it projected back to the target's width, at the
same position and over the same K/V, as transformers' `SinglePositionMultiTokenCandidateGenerator`
does. A static tree (Medusa-style choices) grows level by level: a node's children are its
parent's top tokens (greedy) or drawn from its parent's law without replacement, and every
node of a level with children is fed in one forward (they share the position and the K/V and
do not see each other); a child its parent's law cannot supply (a top-k or top-p cut) is
missing with its subtree. In a batch each row drafts with its own fork over its own row of
the target's cache (the assistant's weights shared). Greedy decoding chooses the top tokens
(q=None); sampling draws them from the assistant's law warped as the target's is
(`logits_to_probs`) and hands those laws on as q, so the shared verifier keeps the output law
the target's.

transformers' generator, after a rejection, also hands the assistant the first rejected draft
token's K/V (its slice keeps as many slots as the committed tokens, the root included); here the
assistant reads the committed tokens' K/V only, the same K/V it reads after a prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from selfspec.checks import is_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.heads.gemma4_assistant import AssistantOutput, Gemma4Assistant
from selfspec.model import ModelConfig, Transformer
from selfspec.model.kv_cache import KVCache
from selfspec.ranking import ranked
from selfspec.sampling import gumbel_top, logits_to_probs
from selfspec.tree import Tree

# the cache layer each kind of the assistant's layers reads: the target's last of that kind
_KINDS = {"sliding": "sliding_attention", "full": "full_attention"}


@dataclass
class _Growth:
    """A draft in the making: its nodes' tokens, parents (growth indices, -1 the root) and the
    laws they were drawn from, and the tree node each growth node stands for."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    laws: list[torch.Tensor] = field(default_factory=list)
    made: dict[int, int] = field(default_factory=lambda: {-1: -1})  # tree node -> growth node

    def add(self, node: int, token: int, parent: int, law: torch.Tensor) -> None:
        self.made[node] = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.laws.append(law)


class Gemma4AssistantDrafter:
    """Chains of `num_draft_tokens` tokens, or a static `tree` (a `Tree` or Medusa-style
    choices), from a Gemma 4 assistant; see the module docstring."""

    def __init__(self, assistant: Gemma4Assistant, num_draft_tokens: int | None = None, *,
                 tree: Tree | Sequence[Sequence[int]] | None = None) -> None:
        if (num_draft_tokens is None) == (tree is None):
            raise ValueError("Gemma4AssistantDrafter: give num_draft_tokens (a chain) or a "
                             "tree, exactly one")
        if tree is None and not is_count(num_draft_tokens):
            raise ValueError(f"Gemma4AssistantDrafter: num_draft_tokens must be an integer >= 1, "
                             f"got {num_draft_tokens!r}")
        self.tree = Tree.chain(num_draft_tokens) if tree is None else \
            tree if isinstance(tree, Tree) else Tree.from_paths(tree)
        self.assistant = assistant
        self.max_nodes = self.tree.num_nodes
        self.target_layers: tuple[int, ...] = ()  # the normed last hidden state only

    def begin(self, setup: DecodeSetup) -> None:
        if setup.target_cache is None or not hasattr(setup.target_cache, "k"):
            raise ValueError("Gemma4AssistantDrafter reads the target's K/V from its own cache "
                             "(DecodeSetup.target_cache), which only the decode loop passes: "
                             "draft through selfspec.generate")
        self._layers = shared_layers(self.assistant, setup.target)
        self._target, self._cache = setup.target, setup.target_cache
        self._sampling, self._generator = setup.sampling, setup.generator

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if context.features is None:
            return Draft.empty()  # no target state before the root yet
        shared = shared_kv(self._cache, self._layers, self._target.config, self._cache.length)
        weight = self.assistant.pre_projection.weight
        hidden = context.features.last_hidden[-1:][None].to(weight)  # [1, 1, backbone]
        position = len(context.tokens) - 1
        out = self._step(context.tokens[-1:].to(weight.device), hidden, position, shared)
        outputs = {-1: (out.logits[0, 0], out.hidden[0, 0])}  # fed growth node -> its output
        growth, tree = _Growth(), self.tree
        for depth in range(1, tree.max_depth + 1):
            above = [-1] if depth == 1 else [i for i in range(tree.num_nodes)
                                             if len(tree.choices[i]) == depth - 1]
            for parent in (i for i in above if i in growth.made and tree.children_of(i)):
                self._children(growth, parent, outputs[growth.made[parent]])
            fed = [growth.made[i] for i in range(tree.num_nodes) if i in growth.made
                   and len(tree.choices[i]) == depth and tree.children_of(i)]
            if fed and depth < tree.max_depth:
                outputs |= self._feed(growth, fed, outputs, position, shared)
        tokens = torch.tensor(growth.tokens, dtype=torch.long, device=weight.device)
        drafted = Tree.from_parents(growth.parents)
        if self._sampling.greedy:
            return Draft(drafted, tokens)
        return Draft(drafted, tokens, torch.stack(growth.laws), without_replacement=True)

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, position: int,
              shared: dict) -> AssistantOutput:
        """The assistant over tokens [T] at the root's position, each beside its state
        [1, T, backbone]."""
        weight = self.assistant.pre_projection.weight
        embeds = self._target.embed(tokens[None]).to(weight)  # [1, T, backbone]
        positions = torch.full((len(tokens),), position, device=weight.device)
        return self.assistant(embeds, hidden, positions, shared)

    def _children(self, growth: _Growth, parent: int, output: tuple) -> None:
        """Make parent's children (tree node parent, -1 the root): its top tokens, or draws
        without replacement from its law; a rank the law cannot supply is left out."""
        logits = output[0]
        law = logits_to_probs(logits, self._sampling)  # [V]
        kids = self.tree.children_of(parent)
        count = max(self.tree.choices[kid][-1] for kid in kids) + 1
        if self._sampling.greedy:
            tokens, supplied = ranked(logits[None], count)[0].tolist(), count
        else:
            drawn, ok = gumbel_top(law[None], count, self._generator)
            tokens, supplied = drawn[0].tolist(), int(ok[0].sum())
        for kid in kids:
            rank = self.tree.choices[kid][-1]
            if rank < supplied:
                growth.add(kid, tokens[rank], growth.made[parent], law)

    def _feed(self, growth: _Growth, fed: list[int], outputs: dict, position: int,
              shared: dict) -> dict:
        """One forward over the growth nodes `fed` (their tokens beside their parents'
        states); returns their outputs by growth node."""
        tokens = torch.tensor([growth.tokens[i] for i in fed],
                              device=self.assistant.pre_projection.weight.device)
        hidden = torch.stack([outputs[growth.parents[i]][1] for i in fed])[None]
        out = self._step(tokens, hidden, position, shared)
        return {node: (out.logits[0, row], out.hidden[0, row]) for row, node in enumerate(fed)}


def shared_kv(cache: KVCache, layers: dict[str, int], target: ModelConfig, length: int
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The K/V [B, H_kv, length, D] of each layer in `layers` (by kind), views of the cache's,
    cut to the layer's own heads and dims (a Gemma 4 cache holds every layer at the widest)."""
    found = {}
    for kind, layer in layers.items():
        heads, dim = target.layer_widths(layer)
        found[kind] = (cache.k[layer, :, :heads, :length, :dim],
                       cache.v[layer, :, :heads, :length, :dim])
    return found


def shared_layers(assistant: Gemma4Assistant, target: Transformer) -> dict[str, int]:
    """The target's layer whose K/V each kind of the assistant's layers reads (its last
    sliding and its last full layer), after checking that the assistant was made for a target
    of this shape."""
    config, theirs = assistant.config, target.config
    text = config.text
    kinds = {"sliding": theirs.sliding_layers,
             "full": set(range(theirs.num_layers)) - theirs.sliding_layers - theirs.linear_layers}
    needed = {("sliding" if i in text.sliding_layers else "full"): i
              for i in range(text.num_layers)}  # a layer of its own of each kind it has
    missing = [_KINDS[kind] for kind in needed if not kinds[kind]]
    if missing:
        raise ValueError(f"Gemma4AssistantDrafter: the assistant reads the target's "
                         f"{' and '.join(missing)} layers, which the target lacks")
    layers = {kind: max(kinds[kind]) for kind in needed}
    reasons = [f"{name} {a} vs the target {b}" for name, a, b in (
        ("backbone_hidden_size", config.backbone_hidden_size, theirs.hidden_size),
        ("vocab_size", text.vocab_size, theirs.vocab_size)) if a != b]
    for kind, own in needed.items():
        (_, dim), (heads, their_dim) = text.layer_widths(own), theirs.layer_widths(layers[kind])
        if dim != their_dim or text.num_heads % heads:
            reasons.append(f"its {kind} layers' {text.num_heads} heads of {dim} vs the "
                           f"target's {heads} K/V heads of {their_dim}")
    if reasons:
        raise ValueError(f"Gemma4AssistantDrafter: the assistant was made for another target "
                         f"({', '.join(reasons)}); load the assistant published with this "
                         f"target")
    return layers
