"""Early-exit self-speculation (LayerSkip-style drafting, Kangaroo's adapter and stop): the
target drafts with its own first E layers and an exit head (`selfspec.heads.early_exit`).

Each draft step runs the target's layers [0, E) over one token in the target's own cache
(the root first, then each drafted token but the last), keeps its layer-E state and turns it
into the next token's law through the exit. The early layers' K/V stay in the target's cache:
the draft hands its layer-E states on (`Draft.early`), and verification
(`selfspec.decode`) runs layers [0, E) only for the last draft token and layers [E, L) over
every row. The cache is then committed to the accepted prefix like any other draft's, so a
rejection rolls back everything at once.

The adapter exit keeps its own one-layer K/V cache over the committed context. Its entries
for the rows a draft fed are exactly the committed rows' (same layer-E states), so after
verification only the committed rows the draft did not feed (the last draft token when all
were accepted) are fed, from the verification forward's layer-E states.

Where the target runs static steps (`DecodeSetup.static_steps`), with no confidence stop,
the k draft steps run as one static step on the device
(`_StaticDraft`, captured on CUDA): each token's early layers write K/V at a slot tensor and
attend over every slot under a mask, the exit's argmax (or a draw, as the host-side draft
draws it) feeds the next step, and nothing is read back. Its draft then hands no early
layers on: verification is the target's own static step over every layer, which on a GPU
costs what a forward of the same rows costs anyway (the weights are read once either way).
A confidence stop drafts on the host as above.
"""

from __future__ import annotations

import torch

from selfspec.checks import check_count
from selfspec.drafters.base import DecodeSetup, Draft, DraftContext, EarlyLayers
from selfspec.drafters.confidence import below_confidence, check_confidence_threshold
from selfspec.heads.early_exit import ExitHead, check_exit_target
from selfspec.model.kv_cache import KVCache
from selfspec.model.recurrent_cache import refuse_partial_forwards
from selfspec.sampling import SamplingParams, draw, draw_on_device, logits_to_probs
from selfspec.step import CapturedSteps, SlotView, weights_of


class EarlyExitDrafter:
    """Drafts up to num_draft_tokens tokens with the target's layers [0, E) and `head`
    (E = head.exit_layer), stopping early after a token whose top-1 probability under the exit
    is below confidence_threshold (None: never). Greedy drafts take the exit's argmax (q
    None); sampled drafts draw from its warped law, passed on as q."""

    def __init__(self, head: ExitHead, num_draft_tokens: int = 4,
                 confidence_threshold: float | None = None) -> None:
        check_count("num_draft_tokens", num_draft_tokens, owner="EarlyExitDrafter")
        self.head, self.num_draft_tokens = head, num_draft_tokens
        self.confidence_threshold = check_confidence_threshold("EarlyExitDrafter",
                                                               confidence_threshold)
        self.max_nodes = num_draft_tokens
        self.exit_layer = head.exit_layer
        # The adapter reads the committed rows' layer-E states; the norm exit needs nothing.
        self.target_layers: tuple[int, ...] = (
            (self.exit_layer,) if head.config.kind == "adapter" else ())
        self._own_cache: KVCache | None = None
        self._static: _StaticDraft | None = None  # drafting in static shapes, kept
        self._committed = 0  # adapter cache slots holding committed rows
        self._drafted = 0  # rows the last draft fed into the adapter cache after them

    def begin(self, setup: DecodeSetup) -> None:
        check_exit_target("EarlyExitDrafter", self.head, setup.target)
        refuse_partial_forwards("EarlyExitDrafter", setup.target.config.linear_layers)
        if setup.target_cache is None:
            raise ValueError("EarlyExitDrafter drafts in the target's own KV cache "
                             "(DecodeSetup.target_cache), which only the decode loop "
                             "(selfspec.generate) passes: measure it there")
        self._target, self._cache = setup.target, setup.target_cache
        self._sampling, self._generator = setup.sampling, setup.generator
        # The exit reads the layer-E states the target hands back on its home device (that of
        # its embedding), wherever a placement put layer E: a head made elsewhere moves there.
        self.head.to(setup.target.embed_tokens.weight.device)
        self._committed = self._drafted = 0
        if self.head.config.kind == "adapter":
            self._reset_own_cache(setup.max_length)
        static = setup.static_steps and self.confidence_threshold is None
        self._static = _StaticDraft.kept(self._static, self, setup) if static else None

    @torch.inference_mode()
    def propose(self, context: DraftContext) -> Draft:
        self._consume(context)
        if self._static is not None:
            return self._propose_static(context)
        base, token = self._cache.length, context.token_list()[-1]
        tokens, laws, states = [], [], []
        for step in range(self.num_draft_tokens):
            state = self._early_layers(token, base + step)  # [1, 1, H]
            states.append(state[0, 0])
            logits = self.head.logits(state, self._positions(base + step), self._target,
                                      self._own_cache)[0, -1]  # [V]
            probs = logits_to_probs(logits, self._sampling)
            token = draw(probs, self._sampling, self._generator)
            tokens.append(token)
            laws.append(probs)
            if below_confidence(logits, self.confidence_threshold):
                break
        # The last token's early layers have not run: its state is not handed on.
        self._cache.truncate(base)  # verification reuses the drafted slots' early K/V
        self._drafted = len(tokens)
        q = None if self._sampling.greedy else torch.stack(laws)  # [n, V]
        early = EarlyLayers(self.exit_layer, torch.stack(states))  # [n, H]
        device = self._target.embed_tokens.weight.device
        return Draft.chain(torch.tensor(tokens, device=device), q, early)

    def _propose_static(self, context: DraftContext) -> Draft:
        tokens, q = self._static.run(context.tokens[-1:], self._cache.length, self._committed,
                                     self._generator)
        if self._own_cache is not None:  # the draft's rows, as the host-side draft leaves them
            self._own_cache.length = self._committed + self.num_draft_tokens
        self._drafted = self.num_draft_tokens
        return Draft.chain(tokens, q)

    def _early_layers(self, token: int, position: int) -> torch.Tensor:
        """The residual stream after layer E of `token` at `position` [1, 1, H]; writes its
        early layers' K/V in the target's cache (one slot)."""
        device = self._target.embed_tokens.weight.device
        ids = torch.tensor([[token]], device=device)
        out = self._target(ids, self._positions(position), self._cache,
                           exit_layer=self.exit_layer, return_hidden=(self.exit_layer,),
                           with_logits=False)
        return out.hidden[0]

    def _positions(self, position: int) -> torch.Tensor:
        return torch.tensor([position], device=self._target.embed_tokens.weight.device)

    # ---- the adapter's own cache --------------------------------------------------------------

    def _reset_own_cache(self, max_length: int) -> None:
        config = self.head.config
        self._own_cache = KVCache.reused(self._own_cache, 1, config.num_kv_heads, max_length,
                                         config.head_dim, self._target.embed_tokens.weight)

    def _consume(self, context: DraftContext) -> None:
        """Bring the adapter cache to the committed context: keep the entries the last draft
        fed for rows that were accepted, feed the committed rows it did not."""
        if self._own_cache is None or self.head.config.kind != "adapter":
            return
        count = 0 if context.features is None else len(context.features.tokens)
        start = len(context.tokens) - 1 - count  # history position of the first committed row
        if start != self._committed:
            raise RuntimeError(
                f"EarlyExitDrafter: its adapter cache holds {self._committed} positions but the "
                f"target's features start at position {start}: call begin() before each "
                f"generation and pass every step's features")
        reused = min(count, self._drafted)
        self._own_cache.truncate(self._committed + reused)
        if reused == count - 1 and self._static is not None:  # one row: a static step
            self._static.feed_adapter(context.features.hidden[0][-1], start + reused)
            self._own_cache.length = start + count
        elif reused < count:
            hidden = context.features.hidden[0][reused:][None]  # [1, count - reused, H]
            positions = torch.arange(start + reused, start + count, device=hidden.device)
            self.head(hidden.to(self._target.embed_tokens.weight), positions, self._own_cache,
                      target_norm=self._target.norm)
        self._committed = self._own_cache.length
        self._drafted = 0


class _StaticDraft:
    """The k greedy draft steps of one drafter in static shapes: each token's layers [0, E)
    in the target's cache and the exit (the adapter in its own cache), at slot tensors, under
    masks built on the device; captured once on CUDA and replayed."""

    shared_by_forks = True  # a batch's rows draft eagerly: forks never use it

    def __init__(self, drafter: EarlyExitDrafter, target_cache: KVCache,
                 own_cache: KVCache | None, sampling: SamplingParams) -> None:
        self.drafter, self.target_cache, self.own_cache = drafter, target_cache, own_cache
        device = target_cache.k.device
        # Sampled drafts draw from the steps' own generator, the caller's stream carried
        # through it (`CapturedSteps`).
        self.sampling = sampling
        self.root = torch.zeros(1, dtype=torch.long, device=device)
        self.base = torch.zeros(1, dtype=torch.long, device=device)  # the target cache's length
        self.own_base = torch.zeros(1, dtype=torch.long, device=device)  # the adapter's
        width = drafter._target.config.hidden_size
        self.row = torch.zeros(width, dtype=target_cache.k.dtype, device=device)  # to feed
        self.steps = CapturedSteps(device, draws=not sampling.greedy)
        self.key = _static_key(drafter, target_cache, own_cache, sampling)

    @classmethod
    def kept(cls, kept: _StaticDraft | None, drafter: EarlyExitDrafter, setup: DecodeSetup
             ) -> _StaticDraft:
        """`kept` if it drafts over the same caches and weights, else a new one."""
        key = _static_key(drafter, setup.target_cache, drafter._own_cache, setup.sampling)
        if kept is not None and kept.key == key:
            return kept
        return cls(drafter, setup.target_cache, drafter._own_cache, setup.sampling)

    def run(self, root: torch.Tensor, base: int, own_base: int,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft after `root` [1], the target's cache holding `base` slots and the
        adapter's `own_base`: its tokens [k] and, sampled, their laws [k, V] (copies)."""
        self.root.copy_(root)
        self.base.fill_(base)
        self.own_base.fill_(own_base)
        tokens, laws = self.steps.run("draft", self._draft,
                                      None if self.sampling.greedy else generator)
        return tokens.clone(), None if laws is None else laws.clone()

    def feed_adapter(self, hidden: torch.Tensor, position: int) -> None:
        """Feed one committed row's layer-E state [H] at `position` into the adapter's cache."""
        self.row.copy_(hidden)
        self.own_base.fill_(position)
        self.steps.run("feed", self._feed)

    def _feed(self) -> torch.Tensor:
        slots = torch.arange(self.own_cache.max_slots, device=self.own_base.device)
        return self.drafter.head(self.row[None, None], self.own_base,
                                 SlotView(self.own_cache, self.own_base),
                                 target_norm=self.drafter._target.norm,
                                 mask=slots[None] <= self.own_base)

    def _draft(self) -> torch.Tensor:
        drafter, target = self.drafter, self.drafter._target
        slots = torch.arange(self.target_cache.max_slots, device=self.base.device)
        token, tokens, laws = self.root, [], []
        for step in range(drafter.num_draft_tokens):
            slot = self.base + step  # [1], also the token's position
            out = target(token[None], slot, SlotView(self.target_cache, slot),
                         mask=slots[None] <= slot, exit_layer=drafter.exit_layer,
                         return_hidden=(drafter.exit_layer,), with_logits=False)
            own, mask = None, None
            if self.own_cache is not None:
                own_slot = self.own_base + step
                own = SlotView(self.own_cache, own_slot)
                mask = torch.arange(self.own_cache.max_slots, device=slot.device)[None] <= own_slot
            logits = drafter.head.logits(out.hidden[0], slot, target, own, mask)[0]  # [1, V]
            token, law = draw_on_device(logits, self.sampling, self.steps.generator)
            tokens.append(token)
            laws.append(law)
        return torch.cat(tokens), None if self.sampling.greedy else torch.cat(laws)


def _static_key(drafter: EarlyExitDrafter, target_cache: KVCache, own_cache: KVCache | None,
                sampling: SamplingParams) -> tuple:
    """What a captured draft reads: the caches' tensors, every weight, and the law's
    warping."""
    caches = tuple((c.k.data_ptr(), c.max_slots) for c in (target_cache, own_cache)
                   if c is not None)
    return sampling, caches, weights_of(drafter.head, drafter._target)
