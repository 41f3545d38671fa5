"""Training objectives (objectives.py): what each trains, row alignment, TTT, cached states."""

import math

import pytest
import torch
from helpers import (
    EAGLE3_LAYERS,
    dflash_head_config,
    eagle_head_config,
    fit_exits,
    medusa2_objective,
    perturbed_lora,
    random_eagle_head,
    reduced_medusa_heads,
    tiny_llama,
)

from selfspec import Transformer, generate
from selfspec.divergences import kl_to_teacher, soft_cross_entropy
from selfspec.from_config.methods.dflash import DFlashObjective
from selfspec.from_config.methods.eagle import Eagle3Objective, EagleObjective
from selfspec.from_config.methods.medusa import Medusa2Objective
from selfspec.from_config.methods.small_model import DraftModelObjective
from selfspec.heads import MedusaConfig, MedusaHeads
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.heads.eagle_losses import eagle_loss
from selfspec.heads.early_exit import exit_loss
from selfspec.model.kv_cache import KVCache
from selfspec.model.lora import LINEAR_LAYERS

# ---- Medusa ----------------------------------------------------------------------------------


def test_shared_lm_head_heads_train_their_blocks_and_leave_the_target_frozen(target):
    from selfspec.from_config.methods.medusa import MedusaObjective

    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2,
                                     shared_lm_head=True))
    objective = MedusaObjective(target, heads)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    objective(tokens, torch.ones_like(tokens)).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())
    assert target.lm_head.weight.grad is None and not target.lm_head.weight.requires_grad


def test_cached_features_give_the_same_loss_and_run_the_target_once_per_row(target):
    from selfspec.from_config.methods.medusa import MedusaObjective

    heads = reduced_medusa_heads(target, list(range(0, 64, 2)))
    rows = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(rows)
    plain = MedusaObjective(target, heads)(rows, mask)
    cached = MedusaObjective(target, heads, cache_features=True)
    calls = []
    hook = target.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        for batch in ([0, 1], [1, 2], [2, 0, 1]):  # rows seen again in later batches
            out = cached(rows[batch], mask[batch])
    finally:
        hook.remove()
    assert sorted(calls) == [1, 2]  # rows 0 and 1, then row 2: each row's forward once
    torch.testing.assert_close(out.loss, MedusaObjective(target, heads)(rows[[2, 0, 1]], mask).loss)
    assert plain.loss.isfinite()


# ---- Medusa-2 --------------------------------------------------------------------------------

TOKENS = torch.randint(2, 64, (3, 20), generator=torch.Generator().manual_seed(7))  # [B, T]
POSITIONS = torch.arange(TOKENS.shape[1])


def toy_target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


def test_the_objective_trains_heads_and_adapters_towards_the_original_target():
    objective = medusa2_objective()
    perturbed_lora(objective.target)
    original = toy_target()  # an untouched copy: the teacher must be exactly this model
    out = objective(TOKENS, torch.ones_like(TOKENS))
    with torch.no_grad():
        adapted_logits = objective.target(TOKENS, POSITIONS).logits
        expected_kl = kl_to_teacher(adapted_logits, original(TOKENS, POSITIONS).logits)
    assert out.metrics["medusa/lm_kl"] == pytest.approx(float(expected_kl), rel=1e-5)
    assert out.metrics["medusa/lm_kl"] > 1e-4
    out.loss.backward()
    for name, param in objective.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name  # the target's own weights never train


def test_adapters_learn_at_a_fraction_of_the_heads_rate():
    objective = medusa2_objective()
    heads, adapters = objective.param_groups(1e-3)
    assert heads["lr"] == 1e-3 and adapters["lr"] == pytest.approx(2.5e-4)
    assert {id(p) for p in heads["params"]} == {id(p) for p in objective.heads.parameters()}
    assert len(adapters["params"]) == 2 * 2 * len(LINEAR_LAYERS)
    with pytest.raises(ValueError, match="adapter_lr_scale must be > 0"):
        Medusa2Objective(objective.target, objective.heads, adapter_lr_scale=0.0)


def test_the_kl_term_pulls_a_drifted_adapted_target_back():
    objective = medusa2_objective()
    perturbed_lora(objective.target, std=0.2)
    objective.lm_weight = 100.0  # the KL term dominates the heads' loss
    adapters = [p for p in objective.target.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2)
    kls = []
    for _ in range(20):
        out = objective(TOKENS, torch.ones_like(TOKENS))
        kls.append(out.metrics["medusa/lm_kl"])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert math.isfinite(kls[-1]) and kls[-1] < kls[0] / 4, kls


# ---- EAGLE-1 ---------------------------------------------------------------------------------


def test_the_eagle_objective_aligns_features_tokens_and_mask(target):
    """Row t reads (f_t, token t+1), learns f_{t+1} and the target's law at t+1, and counts
    when token t+2 does: checked against a row-by-row computation."""
    head = random_eagle_head(eagle_head_config(target, 1), seed=3)
    tokens = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, 5] = 0
    out = EagleObjective(target, head).eval()(tokens, mask)
    with torch.no_grad():
        full = target(tokens, torch.arange(9))
        features, predicted, logits, rows = [], [], [], []
        for b in range(2):
            for t in range(8):  # rows t = 0..T-2
                pairs = head(target.embed_tokens(tokens[b:b + 1, 1:t + 2]),
                             full.last_hidden[b:b + 1, :t + 1], torch.arange(t + 1))
                predicted.append(pairs[0, -1])
                features.append(full.last_hidden[b, t + 1])
                logits.append(full.logits[b, t + 1])
                rows.append(t + 2 < 9 and bool(mask[b, t + 2]))
        predicted, features, logits = (torch.stack(x)[None] for x in (predicted, features, logits))
        expected = eagle_loss(predicted, head.logits(predicted, target.lm_head), features, logits,
                              torch.tensor(rows)[None])
    assert float(out.loss.detach()) == pytest.approx(float(expected.loss), rel=1e-5)
    assert out.metrics["eagle/top1"] == expected.metrics["eagle/top1"]


def test_feature_noise_is_for_training_only_and_from_the_generator(target):
    head = random_eagle_head(eagle_head_config(target, 1), seed=3)
    tokens = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)

    def loss(noise: float, train: bool, seed: int) -> float:
        objective = EagleObjective(target, head, feature_noise=noise,
                                   generator=torch.Generator().manual_seed(seed))
        return float(objective.train(train)(tokens, mask).loss.detach())

    clean = loss(0.0, True, 0)
    assert loss(0.5, False, 0) == clean  # evaluation never adds noise
    assert loss(0.5, True, 0) != clean
    assert loss(0.5, True, 0) == loss(0.5, True, 0) != loss(0.5, True, 1)


# ---- EAGLE-3 training-time test --------------------------------------------------------------


def step_by_step(head, target, tokens, steps):
    """Each row t of each step j computed as drafting does, alone with a fresh cache: the
    pairs (f_s, token s+1) for s <= t, then j pairs (own output, token t+1+i) at t+i."""
    with torch.no_grad():
        out = target(tokens, torch.arange(tokens.shape[1]), return_hidden=head.config.target_layers)
    feature = head.target_feature(out.last_hidden, out.hidden)  # [B, T, h]
    length = tokens.shape[1]
    hidden = torch.zeros(steps, tokens.shape[0], length - 1, head.config.hidden_size)
    for b in range(tokens.shape[0]):
        for t in range(length - 1):
            cache = KVCache(1, 1, head.config.num_kv_heads, t + steps + 1, head.config.head_dim)
            embeds = target.embed_tokens(tokens[b:b + 1, 1:t + 2])
            last = head(embeds, feature[b:b + 1, :t + 1], torch.arange(t + 1), cache)[:, -1:]
            hidden[0, b, t] = last[0, 0]
            for j in range(1, steps):
                token = tokens[b, t + 1 + j] if t + 1 + j < length else torch.tensor(0)
                embed = target.embed_tokens(token.view(1, 1))
                if t + 1 + j >= length:
                    embed = torch.zeros_like(embed)  # past the row's end, as unroll pads
                last = head(embed, last, torch.tensor([t + j]), cache)
                hidden[j, b, t] = last[0, 0]
    return hidden, out.logits


def test_the_training_time_test_equals_drafting_step_by_step(target):
    head = random_eagle_head(eagle_head_config(target, 3), seed=5).init_from_target(target)
    tokens = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, 4] = 0
    steps = 4
    with torch.no_grad():
        out = target(tokens, torch.arange(8), return_hidden=EAGLE3_LAYERS)
        feature = head.target_feature(out.last_hidden, out.hidden)[:, :-1]
        unrolled = head.unroll(target.embed_tokens(tokens), feature, steps)
        expected, target_logits = step_by_step(head, target, tokens, steps)
        for j in range(steps):
            torch.testing.assert_close(unrolled[j], expected[j], atol=1e-5, rtol=1e-5)
        loss = Eagle3Objective(target, head, steps=steps)(tokens, mask)
    # The loss, summed by hand: step j row t scores token t+2+j by the KL from the target's law at
    # t+1+j restricted to the draft vocabulary, when that token counts and the target's
    # argmax is a draft token.
    t2d, total = head.t2d, 0.0
    for j in range(steps):
        terms = []
        for b in range(2):
            for t in range(8 - 2 - j):
                teacher = target_logits[b, t + 1 + j]
                if mask[b, t + 2 + j] and t2d[teacher.argmax()]:
                    law = teacher[t2d]  # the KL: cross-entropy less the law's entropy
                    terms.append(float(soft_cross_entropy(head.logits(expected[j, b, t]).detach(),
                                                          law) - soft_cross_entropy(law, law)))
        step = sum(terms) / max(len(terms), 1)
        assert loss.metrics[f"eagle3/step{j}_loss"] == pytest.approx(step, rel=1e-4)
        total += 0.8**j * step
    assert float(loss.loss) == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("version", [1, 3])
def test_cached_target_states_give_the_same_loss_and_run_the_target_once(target, version):
    head = random_eagle_head(eagle_head_config(target, version), seed=3).init_from_target(target)
    tokens = torch.randint(2, 64, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(tokens)
    make = EagleObjective if version == 1 else Eagle3Objective
    plain, cached = (make(target, head, cache_features=c).eval() for c in (False, True))
    forwards = []
    hook = target.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            expected = plain(tokens, mask)
            runs = len(forwards)
            first, second = cached(tokens, mask), cached(tokens[[2, 0]], mask[[2, 0]])
    finally:
        hook.remove()
    assert runs == 1 and len(forwards) == 2  # the cache ran the target once, for all rows
    torch.testing.assert_close(first.loss, expected.loss)
    with torch.no_grad():
        reordered = plain(tokens[[2, 0]], mask[[2, 0]])
    torch.testing.assert_close(second.loss, reordered.loss)


# ---- draft models ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target3() -> Transformer:
    """The 3-layer toy target draft models are cut from."""
    return Transformer.from_hf(tiny_llama(0, layers=3))


def test_the_objective_trains_only_the_drafts_unfrozen_weights(target3):
    draft = target3.first_layers(1)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    objective = DraftModelObjective(target3, draft)
    tokens = torch.randint(64, (2, 12))
    out = objective(tokens, torch.ones_like(tokens))
    out.loss.backward()
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    assert draft.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target3.parameters())
    assert 0 <= out.metrics["draft/top1"] <= 1 and out.metrics["draft/kl"] > 0


def test_cached_features_give_the_same_loss(target3):
    tokens, mask = torch.randint(64, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    draft = target3.first_layers(2)
    losses = [DraftModelObjective(target3, draft, cache_features=cache)(tokens, mask).loss
              for cache in (False, True)]
    torch.testing.assert_close(losses[0], losses[1])


def test_a_negative_hard_weight_is_refused(target3):
    with pytest.raises(ValueError, match="hard_weight must be >= 0"):
        DraftModelObjective(target3, target3.first_layers(1), hard_weight=-1.0)


def test_a_draft_vocabulary_restricts_both_laws(target3):
    tokens, mask = torch.randint(64, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    kept = torch.tensor([1, 5, 6, 20, 33, 50])
    vocab = draft_vocabulary(kept, 64, len(kept))
    draft = target3.first_layers(2)
    positions = torch.arange(9)
    student = draft(tokens, positions).logits[..., kept]
    teacher = target3(tokens, positions).logits[..., kept]
    expected = exit_loss(student, teacher, tokens, mask).loss
    got = DraftModelObjective(target3, draft, draft_vocab=vocab)(tokens, mask).loss
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="hard_weight > 0 with a draft vocabulary"):
        DraftModelObjective(target3, draft, hard_weight=0.5, draft_vocab=vocab)


# ---- early exit ------------------------------------------------------------------------------

EXIT_PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 6, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


@pytest.fixture(scope="module")
def target4() -> Transformer:
    """A 4-layer toy target, so that an exit E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=4))


@pytest.fixture(scope="module")
def greedy4(target4) -> dict:
    """Plain greedy continuations of EXIT_PROMPTS on target4, 24 tokens each."""
    return {tuple(p): generate(target4, p, max_new_tokens=24).tokens for p in EXIT_PROMPTS}


@pytest.fixture(scope="module")
def fitted_exits(target4, greedy4):
    return fit_exits(target4, greedy4)


def test_one_run_trains_several_exits_towards_the_target(target4, greedy4, fitted_exits):
    heads, metrics = fitted_exits
    assert set(heads) == {1, 2, 3}
    assert {f"exit/E{e}_kl" for e in heads} <= set(metrics)
    _, before = fit_exits(target4, greedy4, steps=1)
    for e in heads:
        assert metrics[f"exit/E{e}_kl"] < before[f"exit/E{e}_kl"]


# ---- DFlash ----------------------------------------------------------------------------------


def test_anchors_are_drawn_among_positions_whose_next_token_is_supervised(target):
    from selfspec.from_config.methods.dflash import anchor_blocks
    from selfspec.heads import DFlashHead

    tokens = torch.randint(2, 63, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[:, 12:17] = True
    mask[2] = False  # a row with nothing supervised counts nothing
    config = DFlashHead(dflash_head_config(target, block_size=4)).config
    blocks = anchor_blocks(tokens, mask, config, 6, torch.Generator().manual_seed(1))
    anchors = blocks.positions.view(3, 6, 4)[..., 0]  # [B, A]
    drawn = blocks.valid.any(-1)
    assert set(anchors[0][drawn[0]].tolist()) == set(range(11, 16))  # all 5 there are, once
    assert not blocks.valid[2].any()
    assert (blocks.labels == tokens.gather(1, blocks.label_positions.clamp(max=19).flatten(1))
            .view_as(blocks.labels)).all()
    assert (blocks.valid <= mask.gather(1, blocks.label_positions.clamp(max=19).flatten(1))
            .view_as(blocks.valid)).all()
    ids = blocks.tokens.view(3, 6, 4)
    assert (ids[..., 1:] == config.mask_token_id).all()
    assert (ids[..., 0] == tokens.gather(1, anchors)).all()


@pytest.mark.parametrize("options", [{}, {"teacher": True}, {"draft_vocab_size": 40}])
def test_dflash_training_lowers_the_loss_and_leaves_the_target_frozen(target, options):
    from selfspec.heads import DFlashHead

    teacher = options.pop("teacher", False)
    head = DFlashHead(dflash_head_config(target, **options)).init_from_target(target)
    if head.config.draft_vocab_size is not None:
        head.set_draft_vocab(draft_vocabulary(torch.arange(40), 64, 40))
    objective = DFlashObjective(target, head, anchors=8, teacher=teacher)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    rows = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6 + [9, 10]]
    tokens, mask = torch.tensor(rows), torch.ones(2, 20, dtype=torch.bool)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        out = objective(tokens, mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0] - 0.5, losses  # against a law: its entropy stays
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert all(p.grad is None for p in target.parameters())
    objective.eval()  # held-out evaluation draws the same blocks every time
    assert objective(tokens, mask).metrics == objective(tokens, mask).metrics


# ---- PARD ------------------------------------------------------------------------------------


def test_pards_replicated_rows_see_what_a_parallel_draft_sees(target):
    """Copy j's position p of the replicated rows gives the draft's logits after the real
    tokens up to p - j and j mask tokens: what drafting computes at its j-th mask."""
    from selfspec.training.objectives import parallel_rows

    draft = target.first_layers(1)
    tokens = torch.randint(2, 60, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    rows = parallel_rows(tokens, mask, 3, 63)
    with torch.no_grad():
        logits = draft(rows.tokens, rows.positions, mask=rows.mask).logits  # [B, 3 T, V]
        for b, j, p in [(0, 0, 5), (1, 1, 4), (0, 2, 13), (1, 2, 2)]:
            ids = tokens[b, :p - j + 1].tolist() + [63] * j
            alone = draft(torch.tensor([ids]), torch.arange(len(ids))).logits[0, -1]
            torch.testing.assert_close(logits[b, j * 14 + p], alone, atol=1e-5, rtol=1e-5)
    assert not rows.loss_mask[:, 2, :3].any() and rows.loss_mask[:, 2, 3:].all()
    with pytest.raises(ValueError, match="parallel must be an integer >= 1, with a "
                                         "mask_token_id"):
        DraftModelObjective(target, draft, parallel=3)
