"""Drafting with Gemma 4's assistant (`selfspec.heads.gemma4_assistant.Gemma4Assistant`): a
chain of k tokens, each step reading the target's keys and values where they already are.

At the root (token t, not yet in the target's cache) the assistant reads the target's scaled
embedding of token t beside the target's normed last hidden state at t - 1 (the committed row
that predicted it: `DraftContext.features`), and the K/V of the target's last sliding and last
full layer over the committed tokens, read from the target's own cache
(`DecodeSetup.target_cache`) without a copy: no extra target forward, no cache of its own.
Step j + 1 reads step j's token and the state it projected back to the target's width, at the
same position and over the same K/V, as transformers' `SinglePositionMultiTokenCandidateGenerator`
does. In a batch each row drafts with its own fork over its own row of the target's cache (the
assistant's weights shared). Greedy decoding chooses each step's argmax (q=None); sampling
draws each token from the assistant's law warped as the target's is (`logits_to_probs`) and
hands those laws on as q, so the shared verifier keeps the output law the target's.

transformers' generator, after a rejection, also hands the assistant the first rejected draft
token's K/V (its slice keeps as many slots as the committed tokens, the root included); here the
assistant reads the committed tokens' K/V only, the same K/V it reads after a prefill.
"""

from __future__ import annotations

import torch

from selfspec.checks import is_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.heads.gemma4_assistant import Gemma4Assistant
from selfspec.model import Transformer
from selfspec.sampling import logits_to_probs, sample

# the cache layer each kind of the assistant's layers reads: the target's last of that kind
_KINDS = {"sliding": "sliding_attention", "full": "full_attention"}


class Gemma4AssistantDrafter:
    """Chains of `num_draft_tokens` tokens from a Gemma 4 assistant; see the module docstring."""

    def __init__(self, assistant: Gemma4Assistant, num_draft_tokens: int) -> None:
        if not is_count(num_draft_tokens):
            raise ValueError(f"Gemma4AssistantDrafter: num_draft_tokens must be an integer >= 1, "
                             f"got {num_draft_tokens!r}")
        self.assistant, self.num_draft_tokens = assistant, num_draft_tokens
        self.max_nodes = num_draft_tokens
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
        length = self._cache.length
        shared = {kind: (self._cache.k[layer, :, :, :length], self._cache.v[layer, :, :, :length])
                  for kind, layer in self._layers.items()}  # [1, H_kv, S, D] each
        weight = self.assistant.pre_projection.weight
        hidden = context.features.last_hidden[-1:][None].to(weight)  # [1, 1, backbone]
        token = context.tokens[-1:]
        position = torch.tensor([len(context.tokens) - 1], device=weight.device)
        tokens, laws = [], []
        for _ in range(self.num_draft_tokens):
            embeds = self._target.embed(token[None].to(weight.device)).to(weight)  # [1, 1, h]
            out = self.assistant(embeds, hidden, position, shared)
            law = logits_to_probs(out.logits[0, -1], self._sampling)  # [V]
            token = torch.tensor([sample(law, self._generator)], device=weight.device)
            tokens.append(token)
            laws.append(law)
            hidden = out.hidden
        q = None if self._sampling.greedy else torch.stack(laws)  # [k, V]
        return Draft.chain(torch.cat(tokens), q)


def shared_layers(assistant: Gemma4Assistant, target: Transformer) -> dict[str, int]:
    """The target's layer whose K/V each kind of the assistant's layers reads (its last
    sliding and its last full layer), after checking that the assistant was made for a target
    of this shape."""
    config, theirs = assistant.config, target.config
    text = config.text
    wrong = {name: (ours, target_value) for name, ours, target_value in (
        ("backbone_hidden_size", config.backbone_hidden_size, theirs.hidden_size),
        ("vocab_size", text.vocab_size, theirs.vocab_size),
        ("head_dim", text.head_dim, theirs.head_dim))
        if ours != target_value}
    reasons = [f"{name} {a} vs the target {b}" for name, (a, b) in wrong.items()]
    if text.num_heads % theirs.num_kv_heads:
        reasons.append(f"its {text.num_heads} heads over the target's {theirs.num_kv_heads} "
                       f"K/V heads")
    if reasons:
        raise ValueError(f"Gemma4AssistantDrafter: the assistant was made for another target "
                         f"({', '.join(reasons)}); load the assistant published with this "
                         f"target")
    kinds = {"sliding": theirs.sliding_layers,
             "full": set(range(theirs.num_layers)) - theirs.sliding_layers - theirs.linear_layers}
    needed = {"sliding" if i in text.sliding_layers else "full" for i in range(text.num_layers)}
    missing = [_KINDS[kind] for kind in needed if not kinds[kind]]
    if missing:
        raise ValueError(f"Gemma4AssistantDrafter: the assistant reads the target's "
                         f"{' and '.join(missing)} layers, which the target lacks")
    return {kind: max(kinds[kind]) for kind in needed}
