"""The training losses (each beside its head: heads/medusa.py, heads/eagle_losses.py,
heads/early_exit.py, heads/dflash.py; the KL to a teacher in selfspec/divergences.py) against
hand computations: Medusa, EAGLE, exits, KL."""

import math

import pytest
import torch

from selfspec.divergences import kl_to_teacher, soft_cross_entropy
from selfspec.heads.dflash import dflash_loss
from selfspec.heads.eagle_losses import eagle3_loss, eagle_loss
from selfspec.heads.early_exit import exit_loss
from selfspec.heads.medusa import medusa_loss

# ---- Medusa ----------------------------------------------------------------------------------

B, T, K, V = 2, 12, 3, 50


@pytest.fixture
def tokens() -> torch.Tensor:
    """[B, T] distinct tokens per row and no token 0 (the argmax of an all-zero row)."""
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(V - 1, generator=g)[:T] + 1 for _ in range(B)])


def pointed_logits(tokens: torch.Tensor, offset: int = 2) -> torch.Tensor:
    """[B, T, K, V]: head k at t puts (almost) all mass on tokens[t + k + offset]."""
    logits = torch.zeros(B, T, K, V)
    for k in range(K):
        for t in range(T - k - offset):
            logits[torch.arange(B), t, k, tokens[:, t + k + offset]] = 40.0
    return logits


def test_heads_pointing_at_their_targets_have_zero_loss(tokens):
    out = medusa_loss(pointed_logits(tokens), tokens)
    assert out.loss.item() < 1e-6
    for k in range(K):
        assert out.metrics[f"medusa/head{k}_top1"] == 1.0
        assert out.metrics[f"medusa/head{k}_loss"] < 1e-6


@pytest.mark.parametrize("offset", [1, 3])  # one position early (the LM head's job) or late
def test_heads_off_by_one_position_are_never_right(tokens, offset):
    out = medusa_loss(pointed_logits(tokens, offset), tokens)
    assert out.loss.item() > 10
    assert all(out.metrics[f"medusa/head{k}_top1"] == 0.0 for k in range(K))


def test_the_mask_drops_predicted_tokens(tokens):
    logits = pointed_logits(tokens)
    j = 7  # corrupt every head's prediction of token j
    for k in range(K):
        logits[:, j - k - 2, k] = 0.0
        logits[:, j - k - 2, k, 0] = 40.0
    unmasked = medusa_loss(logits, tokens)
    assert all(unmasked.metrics[f"medusa/head{k}_top1"] < 1.0 for k in range(K))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, j] = False
    masked = medusa_loss(logits, tokens, mask)
    assert masked.loss.item() < 1e-6
    assert all(masked.metrics[f"medusa/head{k}_top1"] == 1.0 for k in range(K))


def test_a_head_without_valid_positions_counts_zero_and_keeps_gradients_finite(tokens):
    logits = torch.zeros(B, T, K, V, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 2:4] = True  # only head 0 (positions 0, 1) and head 1 (position 0) predict these
    out = medusa_loss(logits, tokens, mask, decay=0.5)
    assert out.loss.item() == pytest.approx(math.log(V) * (1 + 0.5))
    assert out.metrics["medusa/head2_loss"] == 0.0 == out.metrics["medusa/head2_top1"]
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("decay", [1.0, 0.8, 0.5])
def test_head_losses_are_weighted_by_decay(tokens, decay):
    logits = torch.zeros(B, T, K, V)
    logits[:, :, 1, 0] = 3.0  # head 1 is worse than uniform
    out = medusa_loss(logits, tokens, decay=decay)
    per_head = [out.metrics[f"medusa/head{k}_loss"] for k in range(K)]
    assert per_head[0] == pytest.approx(math.log(V)) == per_head[2]
    assert per_head[1] > per_head[0]
    expected = sum(decay**k * loss for k, loss in enumerate(per_head))
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "logits_shape, tokens_shape, mask_shape, message",
    [
        ((B, T, V), (B, T), None, r"head_logits must be \[B, T, K, V\]"),
        ((B, T, K, V), (B, T + 1), None, r"tokens must be integer ids of shape \[B, T\]"),
        ((B, T, K, V), (B, T), (B, T - 1), "loss_mask must have the tokens' shape"),
    ],
)
def test_bad_loss_inputs_are_clear_errors(logits_shape, tokens_shape, mask_shape, message):
    mask = None if mask_shape is None else torch.ones(mask_shape)
    with pytest.raises(ValueError, match=message):
        medusa_loss(torch.zeros(logits_shape), torch.zeros(tokens_shape, dtype=torch.long), mask)


# ---- EAGLE -----------------------------------------------------------------------------------


def test_eagle_loss_weighs_its_two_terms_and_respects_rows():
    g = torch.Generator().manual_seed(0)
    predicted, features = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    head_logits = torch.randn(2, 5, 11, generator=g)
    target_logits = torch.randn(2, 5, 11, generator=g)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    out = eagle_loss(predicted, head_logits, features, target_logits, valid, 1.0, 0.1)
    rows = valid.float()
    feature = torch.nn.functional.smooth_l1_loss(predicted, features, reduction="none").mean(-1)
    token = soft_cross_entropy(head_logits, target_logits) - soft_cross_entropy(target_logits,
                                                                                   target_logits)
    expected_f, expected_t = (feature * rows).sum() / 8, (token * rows).sum() / 8
    assert out.metrics["eagle/feature_loss"] == pytest.approx(float(expected_f), rel=1e-6)
    assert out.metrics["eagle/token_loss"] == pytest.approx(float(expected_t), rel=1e-6)
    assert float(out.loss) == pytest.approx(float(expected_f + 0.1 * expected_t), rel=1e-6)
    perfect = eagle_loss(features, target_logits, features, target_logits)
    assert perfect.metrics["eagle/feature_loss"] == 0.0 and perfect.metrics["eagle/top1"] == 1.0
    assert abs(perfect.metrics["eagle/token_loss"]) < 1e-6  # the KL to its own law
    predicted.requires_grad_(True)
    none = eagle_loss(predicted, head_logits, features, target_logits, torch.zeros_like(valid))
    none.loss.backward()
    assert float(none.loss.detach()) == 0.0 and torch.isfinite(predicted.grad).all()
    with pytest.raises(ValueError, match=r"valid must be \[B, T\]"):
        eagle_loss(predicted, head_logits, features, target_logits, valid[:, :3])


def test_eagle3_loss_skips_rows_whose_target_token_is_not_a_draft_token():
    target_logits = torch.zeros(1, 5, 6)
    target_logits[0, :, 5] = 9.0  # the target's argmax is id 5 everywhere
    t2d = torch.tensor([True, True, True, True, False, True])
    step = torch.zeros(1, 4, 5, requires_grad=True)
    assert eagle3_loss([step], target_logits, t2d).metrics["eagle3/step0_top1"] == 0.0
    t2d[5] = False
    t2d[4] = True
    out = eagle3_loss([step], target_logits, t2d)
    assert float(out.loss) == 0.0  # no row counts
    out.loss.backward()
    assert torch.isfinite(step.grad).all()


def test_eagle3_loss_matches_a_row_by_row_hand_computation():
    torch.manual_seed(0)
    batch, length, vocab, steps = 2, 9, 12, 3
    target_logits = torch.randn(batch, length, vocab)
    t2d = torch.rand(vocab) < 0.6
    t2d[target_logits[0, 3].argmax()] = False  # some rows' target token is no draft token
    step_logits = [torch.randn(batch, length - 1, int(t2d.sum())) for _ in range(steps)]
    mask = torch.rand(batch, length) < 0.8
    out = eagle3_loss(step_logits, target_logits, t2d, mask, decay=0.7)
    total = 0.0
    for j, logits in enumerate(step_logits):
        losses, hits = [], []
        for b in range(batch):
            for t in range(length - 2 - j):
                teacher = target_logits[b, t + 1 + j]  # the law of token t + 2 + j
                if not (mask[b, t + 2 + j] and t2d[teacher.argmax()]):
                    continue
                law = teacher[t2d].softmax(-1)
                losses.append(float((law * (law.log() - logits[b, t].log_softmax(-1))).sum()))
                hits.append(float(logits[b, t].argmax() == law.argmax()))
        step = sum(losses) / max(len(losses), 1)
        total += 0.7**j * step
        assert out.metrics[f"eagle3/step{j}_loss"] == pytest.approx(step, rel=1e-5)
        assert out.metrics[f"eagle3/step{j}_top1"] == pytest.approx(sum(hits) / len(hits))
    assert float(out.loss) == pytest.approx(total, rel=1e-5)
    # scored from the step outputs, only the counted rows reach `scores`: the same loss
    lift = torch.nn.Linear(5, int(t2d.sum()))
    hidden = [torch.randn(batch, length - 1, 5) for _ in range(steps)]
    seen = []
    scored = eagle3_loss(hidden, target_logits, t2d, mask, decay=0.7,
                         scores=lambda rows: seen.append(len(rows)) or lift(rows))
    direct = eagle3_loss([lift(h) for h in hidden], target_logits, t2d, mask, decay=0.7)
    assert float(scored.loss) == pytest.approx(float(direct.loss), rel=1e-6)
    assert scored.metrics == pytest.approx(direct.metrics)
    assert all(m < batch * (length - 2) for m in seen)


# ---- early exit ------------------------------------------------------------------------------


def test_exit_loss_is_the_kl_to_the_target_where_the_mask_says():
    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 7)
    same = exit_loss(teacher.clone(), teacher)
    assert abs(same.metrics["kl"]) < 1e-5 and same.metrics["top1"] == 1.0
    student = torch.randn(2, 5, 7)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # row 1 never counts
    masked = exit_loss(student, teacher, loss_mask=mask)
    alone = exit_loss(student[:1], teacher[:1])
    torch.testing.assert_close(masked.loss, alone.loss)
    tokens = torch.randint(0, 7, (2, 5))
    both = exit_loss(student, teacher, tokens, mask, hard_weight=0.5)
    hard = torch.nn.functional.cross_entropy(student[0, :-1], tokens[0, 1:])
    torch.testing.assert_close(both.loss, alone.loss + 0.5 * hard)
    with pytest.raises(ValueError, match="hard_weight > 0 needs the tokens"):
        exit_loss(student, teacher, hard_weight=1.0)


# ---- the KL to a teacher (Medusa-2) ----------------------------------------------------------


def test_kl_to_teacher_matches_a_hand_computation_and_honours_the_mask():
    logits, teacher = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    p, q = teacher.softmax(-1), logits.softmax(-1)
    per_position = (p * (p.log() - q.log())).sum(-1)[:, :-1]  # position t predicts t + 1
    assert kl_to_teacher(logits, teacher).item() == pytest.approx(per_position.mean().item(),
                                                                  rel=1e-5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]])  # counts: (0, 0) and (1, 2)
    expected = (per_position[0, 0] + per_position[1, 2]) / 2
    assert kl_to_teacher(logits, teacher, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl_to_teacher(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_to_teacher(logits, teacher, torch.zeros(2, 4)).item() == 0.0
    with pytest.raises(ValueError, match=r"must both be \[B, T, V\]"):
        kl_to_teacher(logits, teacher[:, :3])


# ---- DFlash ----------------------------------------------------------------------------------


def test_dflash_loss_weighs_slot_k_by_exp_minus_k_minus_1_over_gamma():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 4, V, generator=g)  # [B, A, K, V]
    labels = torch.randint(V, (2, 3, 4), generator=g)
    valid = torch.rand(2, 3, 4, generator=g) > 0.3
    out = dflash_loss(logits, labels, valid, gamma=2.0)
    total = weights = 0.0
    for b in range(2):
        for a in range(3):
            for k in range(4):
                if valid[b, a, k]:
                    w = math.exp(-k / 2.0)  # slot k + 1 weighs exp(-(k + 1 - 1) / gamma)
                    ce = -torch.log_softmax(logits[b, a, k], -1)[labels[b, a, k]]
                    total, weights = total + w * float(ce), weights + w
    assert math.isclose(float(out.loss), total / weights, rel_tol=1e-5)
    hits = (logits.argmax(-1) == labels) & valid
    share = float(hits[..., 1].sum()) / float(valid[..., 1].sum())
    assert out.metrics["dflash/slot2_top1"] == share


def test_dflash_loss_against_the_targets_law_is_the_kl():
    g = torch.Generator().manual_seed(6)
    logits, teacher = torch.randn(1, 2, 3, V, generator=g), torch.randn(1, 2, 3, V, generator=g)
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    labels = torch.zeros(1, 2, 3, dtype=torch.long)  # ignored against a teacher
    out = dflash_loss(logits, labels, valid, gamma=1e9, teacher_logits=teacher)
    expected = (soft_cross_entropy(logits, teacher) - soft_cross_entropy(teacher, teacher)).mean()
    assert math.isclose(float(out.loss), float(expected), rel_tol=1e-5)
    none = dflash_loss(logits, labels, torch.zeros_like(valid), gamma=1.0, teacher_logits=teacher)
    assert float(none.loss) == 0.0  # no valid slot: zero, not NaN
    with pytest.raises(ValueError, match="gamma must be > 0"):
        dflash_loss(logits, labels, valid, gamma=0.0)
