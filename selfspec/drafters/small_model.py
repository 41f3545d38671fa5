"""The baseline: a separate small draft model sharing the target's tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.draft_vocab import DraftVocab, check_vocab_covers
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.confidence import below_confidence, check_confidence_threshold
from selfspec.model import Transformer, linear
from selfspec.sampling import logits_to_probs, sample


class SmallModelDrafter:
    """Drafts `num_draft_tokens` tokens autoregressively with its own model and KV cache.

    When sampling, each token is drawn from the draft's warped distribution (the same
    `logits_to_probs` as the target) and that distribution is passed on as q; when greedy,
    drafts are the argmax and q is None. The cache is rolled back to the longest prefix it
    shares with the committed tokens before each draft.

    confidence_threshold: stop a draft early after the first token whose top-1 probability
    under the draft model is below it (`selfspec.drafters.confidence`); None drafts
    num_draft_tokens every step.

    draft_vocab: score only these target ids (`selfspec.draft_vocab`): the LM head's K rows
    instead of all V, and q is zero elsewhere, which verification handles exactly.
    """

    target_layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, num_draft_tokens: int = 4,
                 confidence_threshold: float | None = None, draft_vocab: DraftVocab | None = None):
        if num_draft_tokens < 1:
            raise ValueError(
                f"SmallModelDrafter: num_draft_tokens must be >= 1, got {num_draft_tokens}"
            )
        self.confidence_threshold = check_confidence_threshold("SmallModelDrafter",
                                                               confidence_threshold)
        self.model = model
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(
            model.lm_head.weight.device)
        # The LM head's rows of the draft vocabulary, gathered once.
        self._head_rows = (None if draft_vocab is None else
                           model.lm_head.weight[self.draft_vocab.target_ids].detach()
                           .contiguous())
        self.num_draft_tokens = num_draft_tokens
        self.max_nodes = num_draft_tokens
        self._cache = None
        self._fed: list[int] = []  # tokens whose K/V are in the draft cache, in order
        self._checked_target: Transformer | None = None  # the vocabularies agree for it

    def begin(self, setup: DecodeSetup) -> None:
        if setup.target is not self._checked_target:  # reading tokenizer.json takes ~20 ms
            check_same_vocabulary(setup.target, self.model)
            self._checked_target = setup.target
        # A draft sharing the tokenizer may pad its embedding table less (Qwen2.5 0.5B vs 7B):
        # the target's extra ids get probability 0 under the draft.
        self._padding = setup.target.config.vocab_size - self.model.config.vocab_size
        if self.draft_vocab is not None:
            check_vocab_covers(self.draft_vocab, setup.target.config.vocab_size)
            self._padding = 0  # the draft vocabulary's scores are spread over the target's ids
        self.sampling, self.generator = setup.sampling, setup.generator
        if self._cache is None or self._cache.max_slots < setup.max_length:
            self._cache = self.model.new_cache(max_slots=setup.max_length)
        self._cache.reset()
        self._fed = []

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        history = context.tokens.tolist()
        pending = history[self._rollback_to_common_prefix(history) :]  # at least the root
        tokens, rows = [], []
        for _ in range(self.num_draft_tokens):
            logits = self._feed(pending)[0, -1]  # [V_draft]
            logits = F.pad(logits, (0, self._padding), value=float("-inf"))  # [V]
            probs = logits_to_probs(logits, self.sampling)
            token = sample(probs, self.generator)
            tokens.append(token)
            rows.append(probs)
            pending = [token]
            if below_confidence(logits, self.confidence_threshold):
                break
        q = None if self.sampling.greedy else torch.stack(rows)  # [k, V] on the draft's device
        return Draft.chain(torch.tensor(tokens, device=self._device), q)

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _rollback_to_common_prefix(self, history: list[int]) -> int:
        n = 0
        limit = min(len(self._fed), len(history) - 1)  # the root is always fed again
        while n < limit and self._fed[n] == history[n]:
            n += 1
        self._cache.truncate(n)
        del self._fed[n:]
        return n

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Run the draft model over new tokens; returns logits [1, T, V] (with a draft
        vocabulary, [1, 1, V] at the last token, -inf outside the vocabulary)."""
        start = self._cache.length
        if max(tokens) >= self.model.config.vocab_size:
            raise ValueError(
                f"token id {max(tokens)} is outside the draft model's vocabulary "
                f"({self.model.config.vocab_size}): it only exists in the target's padded table"
            )
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)  # [1, T]
        positions = torch.arange(start, start + len(tokens), device=self._device)  # [T]
        self._fed.extend(tokens)
        if self.draft_vocab is None:
            return self.model(ids, positions, self._cache).logits
        out = self.model(ids, positions, self._cache, with_logits=False,
                         return_hidden=(self.model.config.num_layers,))
        scores = linear(self.model.norm(out.hidden[0][:, -1:]), self._head_rows)  # [1, 1, K]
        return self.draft_vocab.scatter(scores.float())


def check_same_vocabulary(target: Transformer, draft: Transformer) -> None:
    """Refuse a draft model whose vocabulary differs from the target's.

    Different tokenizers silently collapse acceptance (token ids mean different strings).
    When both models were loaded from folders holding tokenizer.json, the vocabularies
    themselves are compared (and a draft whose embedding table is merely padded less is
    accepted); otherwise vocabulary sizes and special token ids must agree.
    """
    t, d = target.config, draft.config
    fingerprints = [_tokenizer_fingerprint(m) for m in (target, draft)]
    if None not in fingerprints:
        if fingerprints[0] != fingerprints[1]:
            raise ValueError(
                f"draft model tokenizer ({draft.source}) differs from the target's "
                f"({target.source}): the same ids would mean different text"
            )
        if d.vocab_size > t.vocab_size:
            raise ValueError(
                f"draft model vocab size {d.vocab_size} exceeds the target's {t.vocab_size}"
            )
        return
    if t.vocab_size != d.vocab_size:
        raise ValueError(
            f"draft model vocab size {d.vocab_size} differs from the target's {t.vocab_size}: "
            f"the draft model must use the target's tokenizer"
        )
    if (t.bos_token_id, set(t.eos_token_ids)) != (d.bos_token_id, set(d.eos_token_ids)):
        raise ValueError(
            f"draft model special tokens (bos {d.bos_token_id}, eos {d.eos_token_ids}) differ "
            f"from the target's (bos {t.bos_token_id}, eos {t.eos_token_ids}): the draft model "
            f"must use the target's tokenizer"
        )


def _tokenizer_fingerprint(model: Transformer) -> str | None:
    """A hash of the vocabulary in the model folder's tokenizer.json, if there is one."""
    source = getattr(model, "source", None)
    path = Path(source) / "tokenizer.json" if source else None
    if path is None or not path.is_file():
        return None
    spec = json.loads(path.read_text())
    vocab = {"model": spec.get("model", {}).get("vocab"), "added": spec.get("added_tokens")}
    return hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()
