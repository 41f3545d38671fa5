"""The baseline: a separate small draft model sharing the target's tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.checks import check_count, is_int_in
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext
from selfspec.drafters.block import BlockShape, block_draft
from selfspec.drafters.confidence import below_confidence, check_confidence_threshold
from selfspec.heads.draft_vocab import DraftVocab, check_vocab_covers
from selfspec.model import ModelOutput, Transformer, linear
from selfspec.model.kv_cache import BatchRows, KVCache, RowSlots, pad_rows
from selfspec.ranking import ranked, ranked_on_device
from selfspec.sampling import draw, draw_on_device, gumbel_top, logits_to_probs
from selfspec.step import StaticSteps, kept_or_new
from selfspec.tree import DeviceTree, Tree


class SmallModelDrafter:
    """Drafts `num_draft_tokens` tokens autoregressively with its own model and KV cache.

    When sampling, each token is drawn from the draft's warped distribution (the same
    `logits_to_probs` as the target) and that distribution is passed on as q; when greedy,
    drafts are the argmax and q is None. The cache is rolled back to the longest prefix it
    shares with the committed tokens before each draft.

    confidence_threshold: stop a draft early after the first token whose top-1 probability
    under the draft model is below it (`selfspec.drafters.confidence`); None drafts
    num_draft_tokens every step.

    draft_vocab: score only these target ids (`selfspec.heads.draft_vocab`): the LM head's K rows
    instead of all V, and q is zero elsewhere, which verification handles exactly.

    first_candidates: W > 1 drafts a tree: W candidates for the first token (the draft's top
    W when greedy, W distinct draws when sampling), the chain continuing under the first of
    them. They come out of the draft forward the chain needs anyway, so the tree costs the
    draft nothing; verification grows by W - 1 rows (on SmolLM2, MT-bench: the first token
    right in 25% of steps, one of the top three in 36%).

    mask_token_id: PARD, a draft trained to fill masks (`from_config.methods.small_model`,
    DraftModelObjective's `parallel`): all k tokens come from one forward over the newly
    committed tokens then k - 1 mask tokens, the output after the root and after each mask
    giving a law per position, none depending on a drafted token (a chain of their top
    tokens, or one draw from each, q = the laws). The masks' keys are dropped again.
    """

    target_layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, num_draft_tokens: int = 4,
                 confidence_threshold: float | None = None, draft_vocab: DraftVocab | None = None,
                 first_candidates: int = 1, mask_token_id: int | None = None):
        for name, value in (("num_draft_tokens", num_draft_tokens),
                            ("first_candidates", first_candidates)):
            check_count(name, value, owner="SmallModelDrafter")
        self.confidence_threshold = check_confidence_threshold("SmallModelDrafter",
                                                               confidence_threshold)
        self.model = model
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(
            model.lm_head.weight.device)
        # The LM head's rows of the draft vocabulary, gathered once.
        self._head_rows = (None if draft_vocab is None else
                           model.lm_head.weight[self.draft_vocab.target_ids].detach()
                           .contiguous())
        self.num_draft_tokens, self.first_candidates = num_draft_tokens, first_candidates
        self.max_nodes = num_draft_tokens + first_candidates - 1
        self.mask_token_id = _checked_mask(mask_token_id, model, first_candidates,
                                           self.confidence_threshold)
        # Greedy candidates come from the ids the draft scores (the rest are -inf).
        scored = (model.config.vocab_size if draft_vocab is None
                  else draft_vocab.target_ids.numel())
        self._greedy_candidates = min(first_candidates, scored)
        self._fed: _Fed | None = None  # its cache and what it holds, drafting one prompt
        self._steps: StaticSteps | None = None  # its own, when the target runs static steps
        self._batch: _DraftRows | None = None  # drafting a batch's rows together
        self._checked_target: Transformer | None = None  # the vocabularies agree for it

    def begin(self, setup: DecodeSetup) -> None:
        self._begin_law(setup)
        self._begin_cache(setup)
        # In static steps a chain stays on the device, each token (the argmax, or a draw)
        # fed to the next step.
        self._on_device = (self._steps is not None and self.confidence_threshold is None
                           and self.mask_token_id is None)
        self._drafted_at = None  # where the last device chain's tokens sit in the history

    def begin_rows(self, setups: Sequence[DecodeSetup]) -> None:
        """A batch (`BatchDrafter`): its rows draft together, in one batch cache, eagerly."""
        self._begin_law(setups[0])
        self._batch = _DraftRows(self.model.new_cache(len(setups),
                                                      max_slots=setups[0].max_length))

    def _begin_law(self, setup: DecodeSetup) -> None:
        """What every row of a generation shares: the target checked, the sampling law."""
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
        self._batch = None

    @torch.inference_mode()
    def _propose_on_device(self, context: DraftContext) -> Draft:
        """A draft that reads nothing back: each token the argmax of the last step's logits,
        or a draw from their law (`sample_rows`, as the host-side chain draws), fed to the
        next step as a device tensor; with first_candidates > 1 the first token's candidates
        picked as `_first_tokens` picks them (`_candidates_on_device`). Its tokens enter
        `_fed` as None until the next step's history shows which were accepted
        (`_pending`)."""
        logits = self._next_logits(self._pending(context))
        self._drafted_at = len(context.tokens)  # the first drafted token's history index
        first, law, drawn = (self._candidates_on_device(logits) if self.first_candidates > 1
                             else (*draw_on_device(logits, self.sampling, self.generator), None))
        tokens, laws = [first[:1]], [law]
        while len(tokens) < self.num_draft_tokens:
            token, law = draw_on_device(self._next_logits(tokens[-1]), self.sampling,
                                        self.generator)
            tokens.append(token)
            laws.append(law)
        q = None if self.sampling.greedy else torch.cat(laws)
        return _draft_on_device(torch.cat(tokens), first[1:], q, drawn)

    def _candidates_on_device(self, logits: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`_first_tokens` with nothing read back: the candidates [W] (the most likely, or
        distinct draws by Gumbel-top-k), their law [1, V] (None when greedy) and which of them
        were drawn [W] (None when greedy; False where the law has fewer positive tokens)."""
        if self.sampling.greedy:
            return ranked_on_device(logits[None], self._greedy_candidates)[0], None, None
        law = logits_to_probs(logits[None], self.sampling, static=True)
        tokens, drawn = gumbel_top(law, self.first_candidates, self.generator)
        return tokens[0], law, drawn[0]

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        if self._on_device:
            return self._propose_on_device(context)
        if self.mask_token_id is not None:
            return self._propose_in_parallel(context)
        chain = self._started(self._next_logits(self._pending(context)))
        while chain.goes_on(self):
            chain.extend(self, self._next_logits([chain.tokens[-1]]))
        return self._draft(chain)

    @torch.inference_mode()
    def propose_rows(self, rows: Sequence[int], contexts: Sequence[DraftContext]
                     ) -> list[Draft]:
        """A batch's drafts (`BatchDrafter`), each row's the same as it drafts alone: each
        forward of the draft model runs over every row at once, over the batch cache, each
        row at its own length."""
        self._batch.caches.pack(rows)
        states = [self._batch.rows[b] for b in rows]
        if self.mask_token_id is not None:
            return self._propose_rows_in_parallel(states, contexts)
        logits = self._next_logits_of_rows(states, [state.pending(context.token_list())
                                                    for state, context in zip(states, contexts,
                                                                              strict=True)])
        chains = [self._started(row_logits) for row_logits in logits]
        while any(going := [chain.goes_on(self) for chain in chains]):
            logits = self._next_logits_of_rows(states, [[chain.tokens[-1]] if on else []
                                                        for chain, on in zip(chains, going,
                                                                             strict=True)])
            for chain, row_logits, on in zip(chains, logits, going, strict=True):
                if on:
                    chain.extend(self, row_logits)
        return [self._draft(chain) for chain in chains]

    def _propose_in_parallel(self, context: DraftContext) -> Draft:
        """PARD: the pending tokens and k - 1 masks in one forward, the masks' keys dropped
        again; a chain from the k laws."""
        masks = self.num_draft_tokens - 1
        logits = self._feed(self._pending(context) + [self.mask_token_id] * masks,
                            last=masks + 1)[0, -(masks + 1):]  # [k, V_draft]
        self._fed.drop(masks)
        return self._parallel_draft(F.pad(logits, (0, self._padding), value=float("-inf")))

    def _propose_rows_in_parallel(self, states: list[_Fed], contexts: Sequence[DraftContext]
                                  ) -> list[Draft]:
        """PARD for a batch's rows: one forward of the draft model over every row's pending
        tokens and k - 1 masks."""
        masks = self.num_draft_tokens - 1
        fed = [state.pending(context.token_list()) + [self.mask_token_id] * masks
               for state, context in zip(states, contexts, strict=True)]
        logits = self._next_logits_of_rows(states, fed, last=masks + 1)
        for state in states:
            state.drop(masks)
        return [self._parallel_draft(row_logits) for row_logits in logits]

    def _parallel_draft(self, logits: torch.Tensor) -> Draft:
        """A chain from the k laws of logits [k, V] (`BlockShape`: argmax, or a draw from
        each)."""
        law = None if self.sampling.greedy else self.sampling
        shape = BlockShape(self.num_draft_tokens, None, logits.shape[-1])
        return block_draft(shape.draft(logits, law, self.generator), shape, on_device=False)

    def _pending(self, context: DraftContext) -> list[int]:
        """The tokens to feed before drafting: those after the longest prefix its cache
        shares with the committed tokens (at least the root)."""
        history = context.token_list()
        if self._drafted_at is not None:  # the device chain's tokens: the accepted ones are
            accepted = len(history) - self._drafted_at - 1  # the history's, the rest are not
            if self.first_candidates > 1:  # unless a sibling was accepted: feed them again
                accepted = 0
            self._fed.settle(self._drafted_at, accepted, history)
            self._drafted_at = None
        return self._fed.pending(history)

    def _started(self, logits: torch.Tensor) -> _Chain:
        """A draft's first token (and its sibling candidates) from the logits after the
        committed tokens."""
        probs = logits_to_probs(logits, self.sampling)
        first = self._first_tokens(logits, probs)  # the first token's candidates, best first
        return _Chain([first[0]], [probs], first[1:], logits)

    def _draft(self, chain: _Chain) -> Draft:
        tokens = torch.tensor(chain.tokens + chain.siblings, device=self._device)
        # [k + W - 1, V] on the draft's device: each node's law (the siblings share the first's)
        q = (None if self.sampling.greedy
             else torch.stack(chain.laws + [chain.laws[0]] * len(chain.siblings)))
        if not chain.siblings:
            return Draft.chain(tokens, q)
        tree = _with_siblings(len(chain.tokens), 1 + len(chain.siblings))
        return Draft(tree, tokens, q, without_replacement=q is not None)

    def _begin_cache(self, setup: DecodeSetup) -> None:
        """The draft's cache for this generation: its own static steps' when the target runs
        static steps (CUDA graphs on CUDA: a launch-bound eager draft would cost more than
        the graphed step it saves); else a plain cache, kept while large enough."""
        if setup.static_steps:
            self._steps = kept_or_new(self._steps, self.model, setup.max_length)
            self._fed = _Fed(self._steps.cache)
        else:
            self._steps = None
            if self._fed is None or self._fed.cache.max_slots < setup.max_length:
                self._fed = _Fed(self.model.new_cache(max_slots=setup.max_length))
        self._fed.reset()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, **options) -> ModelOutput:
        if self._steps is None:
            return self.model(ids, positions, self._fed.cache, **options)
        return self._steps.forward(ids, positions, None, options.get("return_hidden", ()),
                                   options.get("with_logits", True))

    def _first_tokens(self, logits: torch.Tensor, probs: torch.Tensor) -> list[int]:
        """The first token's candidates: one drawn from probs (its argmax when greedy), or with
        first_candidates > 1 the W most likely (greedy) or W distinct draws (sampling)."""
        if self.first_candidates == 1:
            return [draw(probs, self.sampling, self.generator)]
        if self.sampling.greedy:  # ties rank by id, as the argmax does
            return ranked(logits[None], self._greedy_candidates)[0].tolist()
        tokens, drawn = gumbel_top(probs[None], self.first_candidates, self.generator)
        return tokens[0][drawn[0]].tolist()

    def _next_logits(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """[V] the draft's logits for the token after `tokens` (fed into its cache; a device
        tensor is fed without a read); -inf at the target's ids it cannot propose."""
        logits = self._feed(tokens)[0, -1]  # [V_draft]
        return F.pad(logits, (0, self._padding), value=float("-inf"))  # [V]

    def _vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., V] fp32 logits of the draft's last hidden states [..., H] scored over its draft
        vocabulary only (-inf outside it)."""
        scores = linear(self.model.norm(hidden), self._head_rows)  # [..., K]
        return self.draft_vocab.scatter(self.model.final_logits(scores).float())

    @property
    def _device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _feed(self, tokens: list[int], last: int = 1) -> torch.Tensor:
        """Run the draft model over new tokens; returns logits [1, T, V] (with a draft
        vocabulary, [1, last, V] at the last tokens, -inf outside the vocabulary)."""
        start = self._fed.cache.length
        if isinstance(tokens, torch.Tensor):  # drafted on the device: known to be in range
            ids = tokens.view(1, -1)
            self._fed.tokens.extend([None] * ids.shape[1])  # known once a history shows them
        else:
            _check_draft_ids(tokens, self.model)
            ids = torch.tensor([tokens], dtype=torch.long, device=self._device)  # [1, T]
            self._fed.tokens.extend(tokens)
        positions = torch.arange(start, start + ids.shape[1], device=self._device)  # [T]
        if self.draft_vocab is None:
            return self._forward(ids, positions).logits
        out = self._forward(ids, positions, with_logits=False,
                            return_hidden=(self.model.config.num_layers,))
        return self._vocab_logits(out.hidden[0][:, -last:])  # [1, l, V]

    def _next_logits_of_rows(self, states: list[_Fed], fed: list[list[int]], last: int = 1
                             ) -> list[torch.Tensor | None]:
        """`_next_logits` for a batch's rows (`states`, in the order of the batch cache's
        first rows) in one forward of the draft model: row i's tokens fed[i] after its own
        length (a row fed nothing rides along, its cache unchanged); [V] each (None for a
        row fed nothing), or with last > 1 [last, V] at each row's last tokens (every row fed
        at least that many)."""
        model, device = self.model, self._device
        for tokens in fed:
            _check_draft_ids(tokens, model)
        lengths = [state.cache.length for state in states]
        inputs = [(torch.tensor([tokens], dtype=torch.long, device=device),
                   torch.arange(len(tokens), device=device),
                   torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device).tril())
                  for tokens in fed]
        tokens, positions, masks = pad_rows(inputs, lengths, device)
        slots = RowSlots(self._batch.caches.first(len(states)), lengths, tokens.shape[1])
        at = torch.tensor([[max(len(t), last) - last + j for j in range(last)] for t in fed],
                          device=device)  # [n, last]: each row's last tokens
        every = torch.arange(len(fed), device=device)[:, None]
        if self.draft_vocab is None:
            out = model(tokens, positions, slots, mask=slots.mask(masks))
            logits = out.logits[every, at]  # [n, last, V_draft]
        else:
            out = model(tokens, positions, slots, mask=slots.mask(masks), with_logits=False,
                        return_hidden=(model.config.num_layers,))
            logits = self._vocab_logits(out.hidden[0][every, at])  # [n, last, V]
        logits = logits[:, 0] if last == 1 else logits
        result = []
        for state, tokens, row_logits in zip(states, fed, logits, strict=True):
            state.cache.advance(len(tokens))
            state.tokens.extend(tokens)
            result.append(F.pad(row_logits, (0, self._padding), value=float("-inf"))
                          if tokens else None)
        return result


class _Fed:
    """A draft cache and the tokens whose K/V it holds, in order (None: a token drafted on
    the device, known once the next history shows it)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.tokens = cache, []

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []

    def pending(self, history: Sequence[int]) -> list[int]:
        """The tokens to feed before drafting after `history`: those after the longest
        prefix the cache shares with it (at least the root, always fed again); the cache is
        rolled back to that prefix."""
        n, limit = 0, min(len(self.tokens), len(history) - 1)
        while n < limit and self.tokens[n] == history[n]:
            n += 1
        self.cache.truncate(n)
        del self.tokens[n:]
        return list(history[n:])

    def settle(self, start: int, accepted: int, history: Sequence[int]) -> None:
        """After a device chain fed from history index `start` on: its first `accepted`
        tokens are the history's (their values filled in), the rest are dropped."""
        del self.tokens[start + max(0, accepted):]
        self.tokens[start:] = history[start:len(self.tokens)]

    def drop(self, count: int) -> None:
        """Forget the last `count` tokens fed (a parallel draft's masks)."""
        self.cache.truncate(self.cache.length - count)
        del self.tokens[len(self.tokens) - count:]


class _DraftRows:
    """A batch's draft cache, which its rows share (one forward over all of them), and
    each row's own part of it."""

    def __init__(self, cache: KVCache) -> None:
        self.caches = BatchRows(cache, cache.k.shape[1])
        self.rows = [_Fed(view) for view in self.caches.views]


def _draft_on_device(chain: torch.Tensor, siblings: torch.Tensor, q: torch.Tensor | None,
                     drawn: torch.Tensor | None) -> Draft:
    """A draft made on the device: its chain [k], and the first token's sibling candidates
    [W - 1] (when sampled, those drawn: `drawn` [W] marks the first's and theirs) as leaves
    of the root, verified as drawn without replacement from the first token's law."""
    if not len(siblings):
        return Draft.chain(chain, q)
    tree, tokens = _with_siblings(len(chain), 1 + len(siblings)), torch.cat([chain, siblings])
    if q is None:
        return Draft(tree, tokens)
    valid = torch.cat([torch.ones_like(chain, dtype=torch.bool), drawn[1:]])
    device_tree = DeviceTree(tree.parents_on(chain.device), len(chain), valid, 1 + len(siblings))
    return Draft(device_tree, tokens, torch.cat([q, q[:1].expand(len(siblings), -1)]),
                 without_replacement=True)


def _with_siblings(chain: int, candidates: int) -> Tree:
    """A chain of `chain` tokens whose first has `candidates - 1` sibling candidates after
    it, leaves of the root."""
    return Tree.from_parents([-1, *range(chain - 1), *[-1] * (candidates - 1)])


class _Chain:
    """A draft being grown: its chain of tokens, the law each was drawn from, the first
    token's sibling candidates and the logits after the last token."""

    def __init__(self, tokens: list[int], laws: list[torch.Tensor], siblings: list[int],
                 logits: torch.Tensor) -> None:
        self.tokens, self.laws, self.siblings, self.logits = tokens, laws, siblings, logits

    def goes_on(self, drafter: SmallModelDrafter) -> bool:
        """Whether the chain takes another token: shorter than the draft length, and the last
        one confident enough."""
        return (len(self.tokens) < drafter.num_draft_tokens
                and not below_confidence(self.logits, drafter.confidence_threshold))

    def extend(self, drafter: SmallModelDrafter, logits: torch.Tensor) -> None:
        """The next token, from the logits after the chain's last."""
        probs = logits_to_probs(logits, drafter.sampling)
        self.tokens.append(draw(probs, drafter.sampling, drafter.generator))
        self.laws.append(probs)
        self.logits = logits


def _checked_mask(mask_token_id: int | None, model: Transformer, first_candidates: int,
                  confidence_threshold: float | None) -> int | None:
    """A PARD mask token id, refused where it cannot draft (None: drafting token by token)."""
    if mask_token_id is None:
        return None
    if not is_int_in(mask_token_id, range(model.config.vocab_size)):
        raise ValueError(f"SmallModelDrafter: mask_token_id must be a token id of the draft "
                         f"model (0..{model.config.vocab_size - 1}), got {mask_token_id!r}")
    if first_candidates != 1 or confidence_threshold is not None:
        raise ValueError("SmallModelDrafter: a parallel draft (mask_token_id) drafts a chain "
                         "of all its tokens at once: leave first_candidates at 1 and "
                         "confidence_threshold unset")
    return mask_token_id


def _check_draft_ids(tokens: list[int], model: Transformer) -> None:
    if tokens and max(tokens) >= model.config.vocab_size:
        raise ValueError(
            f"token id {max(tokens)} is outside the draft model's vocabulary "
            f"({model.config.vocab_size}): it only exists in the target's padded table"
        )


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
