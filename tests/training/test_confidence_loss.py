"""Training a block drafter's confidence (`confidence_loss` of heads/base.py and
`parallel_confidence_loss` of heads/eagle_losses.py; the DFlash and P-EAGLE objectives with
confidence_head): by hand on small cases, a position counted only after every earlier one was
accepted, its gradient kept from the block's layers, and a few steps that teach it the block's
hit rates."""

import math

import torch
from helpers import continuation_rows, dflash_head_config, random_eagle_head

from selfspec.from_config.methods.dflash import DFlashObjective
from selfspec.from_config.methods.eagle import Eagle3Objective
from selfspec.heads import DFlashHead, EagleConfig
from selfspec.heads.base import confidence_loss
from selfspec.heads.eagle_losses import parallel_confidence_loss


def bce(logit: float, label: float) -> float:
    p = 1 / (1 + math.exp(-logit))
    return -(label * math.log(p) + (1 - label) * math.log(1 - p))


def test_a_position_counts_only_after_every_earlier_one_was_accepted():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.3], [1.5, 0.2, -0.4, 0.0]])
    accepted = torch.tensor([[True, True, False, True], [True, False, True, True]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    out = confidence_loss(logits, accepted, valid)
    # counted: row 0 positions 1-3 (4 follows a rejection), row 1 positions 1-2
    counted = [(0.5, 1), (-1.0, 1), (2.0, 0), (1.5, 1), (0.2, 0)]
    expected = sum(bce(x, y) for x, y in counted) / len(counted)
    assert math.isclose(float(out.loss), expected, rel_tol=1e-6)
    error = sum(abs(1 / (1 + math.exp(-x)) - y) for x, y in counted) / len(counted)
    assert math.isclose(out.metrics["confidence_error"], error, rel_tol=1e-6)
    # a position after an uncounted one does not count either
    hidden = confidence_loss(logits, accepted, torch.tensor([[True, False, True, True]] * 2))
    assert math.isclose(float(hidden.loss), (bce(0.5, 1) + bce(1.5, 1)) / 2, rel_tol=1e-6)


def test_p_eagles_copies_are_an_anchors_positions_in_order():
    g = torch.Generator().manual_seed(0)
    batch, length, vocab, count = 2, 7, 6, 3
    # every copy of every anchor: copy j at position p drafts after the real pair p - j
    copies = torch.arange(count).repeat_interleave(length)
    positions = torch.arange(length).repeat(count)
    kept = positions >= copies
    copies, positions = copies[kept], positions[kept]
    target_logits = torch.randn(batch, length, vocab, generator=g)
    logits = torch.randn(batch, len(copies), vocab, generator=g)
    confidence = torch.randn(batch, len(copies), generator=g)
    every = torch.ones(vocab, dtype=torch.bool)
    out = parallel_confidence_loss(confidence, logits, copies, positions, target_logits, every,
                                   count)
    top = target_logits.argmax(-1)  # [B, T]: position i's law scores token i + 1
    terms = []
    for b in range(batch):
        for anchor in range(length):
            for j in range(count):
                row = ((copies == j) & (positions == anchor + j)).nonzero()
                if anchor + j + 2 >= length or len(row) == 0:
                    break
                n = int(row[0, 0])
                hit = int(logits[b, n].argmax() == top[b, anchor + j + 1])
                terms.append(bce(float(confidence[b, n]), hit))
                if not hit:
                    break
    assert math.isclose(float(out.loss), sum(terms) / len(terms), rel_tol=1e-5)


ROWS = {tuple(range(2, 8)): list(range(8, 30)), (9, 3, 5): [7, 7, 8, 9] * 5}


def dflash_head(target, confidence_head: bool) -> DFlashHead:
    torch.manual_seed(0)
    return DFlashHead(dflash_head_config(target, confidence_head=confidence_head))


def test_dflash_confidence_learns_and_its_gradient_stays_out_of_the_block(target):
    head, plain = dflash_head(target, True), dflash_head(target, False)
    tokens, mask = continuation_rows(ROWS)
    plain.load_state_dict({k: v for k, v in head.state_dict().items()
                           if not k.startswith("confidence.")})
    grads, metrics = [], []
    for h in (head, plain):
        objective = DFlashObjective(target, h, anchors=4).eval()  # the same held-out anchors
        out = objective(tokens, mask)
        out.loss.backward()
        grads.append({n: p.grad for n, p in h.named_parameters() if p.grad is not None})
        metrics.append(out.metrics)
    for name, grad in grads[1].items():  # the block's layers get what they get without it
        torch.testing.assert_close(grads[0][name], grad)
    assert grads[0]["confidence.weight"].abs().sum() > 0
    assert "dflash/confidence_loss" in metrics[0] and "dflash/confidence_loss" not in metrics[1]

    objective = DFlashObjective(target, head, anchors=4).eval()
    features = objective.block_features(tokens)
    optimizer = torch.optim.Adam(head.confidence.parameters(), lr=0.1)
    first = None
    for _ in range(15):
        optimizer.zero_grad()
        out = objective.loss(tokens, mask, features)
        out.loss.backward()
        optimizer.step()
        first = first or out.metrics["dflash/confidence_loss"]
    assert out.metrics["dflash/confidence_loss"] < 0.8 * first, (first, out.metrics)


def test_p_eagles_objective_trains_its_confidence(target):
    config = EagleConfig.for_target(target.config, 3, draft_vocab_size=48,
                                    target_layers=(0, 1, 2), parallel=3, mask_token_id=63,
                                    confidence_head=True)
    head = random_eagle_head(config, seed=1).train()
    tokens, mask = continuation_rows({tuple(range(2, 8)): list(range(8, 24))})
    objective = Eagle3Objective(target, head, keep=1.0)
    out = objective(tokens, mask)
    out.loss.backward()
    assert head.confidence.weight.grad.abs().sum() > 0
    assert math.isfinite(out.metrics["peagle/confidence_loss"])
    assert 0 < out.metrics["peagle/confidence_error"] < 1
