"""The objectives a draft's law is fitted to the target's by (`selfspec.divergences`): each is
zero exactly where the laws agree, matches a hand computation, masks, has finite gradients that
lower it, and TV is the verifier's rejection rate; every trainer takes every name."""

import math

import pytest
import torch
from helpers import FAST_LAW_SAMPLES

from selfspec.divergences import (
    DIVERGENCES,
    acceptance,
    divergence,
    divergence_loss,
    target_log_probs,
)
from selfspec.heads.medusa import medusa_loss
from selfspec.verify import verify_linear

NAMES = list(DIVERGENCES)
P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.5, 0.3])


def by_hand(name: str) -> float:
    """The 3-token example's value, from the definitions."""
    p, q = P.tolist(), Q.tolist()
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    tv = 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))  # 0.3
    lam = math.exp(-3 * (1 - tv))
    return {"kl": kl, "tv": tv,
            "reverse_kl": sum(b * math.log(b / a) for a, b in zip(p, q, strict=True)),
            "jsd": 0.5 * sum(a * math.log(a / c) + b * math.log(b / c)
                             for a, b, c in zip(p, q, m, strict=True)),
            "lk": lam * kl + (1 - lam) * tv}[name]


@pytest.mark.parametrize("name", NAMES)
def test_each_objective_matches_a_hand_computation_on_three_tokens(name):
    value = divergence(name)(Q.log() + 1.5, P.log())  # logits: any shift of log q
    assert float(value) == pytest.approx(by_hand(name), rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_each_objective_is_zero_exactly_where_the_laws_agree(name):
    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, 9, generator=g) * 2  # [rows, V]
    law = target_log_probs(target)
    same = divergence(name)(target + 0.7, law)  # the same law from shifted logits
    assert same.abs().max() < 1e-6
    other = divergence(name)(torch.randn(6, 9, generator=g), law)
    assert (other > 1e-3).all()


@pytest.mark.parametrize("name", NAMES)
def test_the_mask_keeps_its_rows_alone_and_none_kept_is_zero(name):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 7, generator=g, requires_grad=True)
    target = torch.randn(2, 4, 7, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 1]], dtype=torch.bool)
    kept = divergence_loss(name, logits, target, mask)
    alone = divergence_loss(name, logits[mask], target[mask])
    torch.testing.assert_close(kept, alone)
    probs = divergence_loss(name, logits, target.softmax(-1), mask, target_is_logits=False)
    torch.testing.assert_close(kept, probs)
    none = divergence_loss(name, logits, target, torch.zeros_like(mask))
    none.backward()
    assert float(none.detach()) == 0.0 and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_one_step_lowers_the_objective_with_finite_gradients(name):
    target = torch.tensor([[2.0, 0.5, -1.0, 0.0]])
    logits = torch.zeros(1, 4, requires_grad=True)  # a uniform draft
    before = divergence_loss(name, logits, target)
    before.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    with torch.no_grad():
        logits -= 0.5 * logits.grad
        after = divergence_loss(name, logits, target)
        tv_after = divergence_loss("tv", logits, target)
    assert float(after) < float(before.detach())
    assert float(tv_after) < float(divergence_loss("tv", torch.zeros(1, 4), target))
    # at the optimum: the smooth objectives' gradient is zero; TV's |p - q| has a kink there,
    # its subgradient q_j (g_j - E_q g), |g| <= 1/2, finite and within q_j
    exact = target.clone().requires_grad_(True)
    divergence_loss(name, exact, target).backward()
    if name in ("tv", "lk"):
        assert (exact.grad.abs() <= target.softmax(-1) + 1e-6).all()
    else:
        assert exact.grad.abs().max() < 1e-6


def test_tv_is_the_verifiers_rejection_rate():
    g = torch.Generator().manual_seed(2)
    p, q = torch.randn(5, generator=g).softmax(-1), torch.randn(5, generator=g).softmax(-1)
    tv = float(divergence("tv")(q.log(), p.log()))
    assert tv == pytest.approx(1 - float(torch.minimum(p, q).sum()), abs=1e-6)
    assert float(acceptance(q.log(), p.log())) == pytest.approx(1 - tv, abs=1e-6)
    # a one-token draft drawn from q, kept or not by the verifier, FAST_LAW_SAMPLES times
    draws = torch.multinomial(q, FAST_LAW_SAMPLES, replacement=True, generator=g)
    rows = torch.stack([p, torch.full_like(p, 0.2)])  # p, then the law after the draft
    kept = sum(verify_linear(x[None], q[None], rows, generator=g).num_accepted for x in draws)
    rate = kept / FAST_LAW_SAMPLES
    error = math.sqrt((1 - tv) * tv / FAST_LAW_SAMPLES)
    assert abs(rate - (1 - tv)) < 4 * error, (rate, 1 - tv)


def test_an_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown objective 'l2': choose one of kl, tv, "
                                         "reverse_kl, jsd, lk"):
        divergence("l2")


def test_medusa_head_k_meets_the_targets_law_of_the_token_it_predicts():
    g = torch.Generator().manual_seed(3)
    batch, length, heads, vocab = 2, 7, 3, 6
    teacher = torch.randn(batch, length, vocab, generator=g)  # position i: law of token i + 1
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    aligned = torch.randn(batch, length, heads, vocab, generator=g)
    for k in range(heads):  # head k at t predicts token t + k + 2: the law at t + k + 1
        aligned[:, : length - k - 2, k] = teacher[:, k + 1: length - 1]
    out = medusa_loss(aligned, tokens, teacher_logits=teacher, divergence=divergence("tv"))
    assert float(out.loss) < 1e-6
    assert all(out.metrics[f"medusa/head{k}_top1"] == 1.0 for k in range(heads))
    early = torch.roll(aligned, shifts=1, dims=1)  # each head one position off
    assert float(medusa_loss(early, tokens, teacher_logits=teacher,
                             divergence=divergence("tv")).loss) > 0.1


def test_lk_blends_kl_and_tv_by_a_weight_that_carries_no_gradient():
    g = torch.Generator().manual_seed(4)
    law = target_log_probs(torch.randn(3, 6, generator=g))
    start = torch.randn(3, 6, generator=g)

    def grad(name: str) -> torch.Tensor:
        logits = start.clone().requires_grad_(True)
        divergence(name)(logits, law).sum().backward()
        return logits.grad

    weight = torch.exp(-3 * acceptance(start, law))[:, None]  # [rows, 1]
    torch.testing.assert_close(grad("lk"), weight * grad("kl") + (1 - weight) * grad("tv"))
