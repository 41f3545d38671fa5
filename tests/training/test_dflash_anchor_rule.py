"""DFlash's two anchor rules (`anchor_blocks`): selfspec's "next" (a >= 1 whose token a + 1 is
supervised) and SpecForge's (a >= 0 with tokens a and a + 1 both supervised), the one
dflash=published trains with."""

import pytest
import torch
from helpers import dflash_head_config, random_dflash_head

from selfspec.from_config.methods.dflash import DFlashObjective, anchor_blocks
from selfspec.heads import DFlashHead

LENGTH = 20


def drawn_anchors(rule: str, target, supervised: list[int]) -> set[int]:
    """Every anchor the rule draws from one row (more anchors asked than there are places)."""
    tokens = torch.randint(2, 63, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, LENGTH, dtype=torch.bool)
    mask[0, supervised] = True
    config = DFlashHead(dflash_head_config(target, block_size=4)).config
    blocks = anchor_blocks(tokens, mask, config, LENGTH, torch.Generator().manual_seed(1), rule)
    anchors = blocks.positions.view(1, -1, 4)[0, :, 0]
    picked = blocks.valid.any(-1)[0]
    assert len(anchors[picked].unique()) == int(picked.sum())  # each once
    return set(anchors[picked].tolist())


SUPERVISED = [0, 1, 2, 3, 12, 13, 14, 15, 16]


@pytest.mark.parametrize("rule, expected", [
    ("next", {1, 2, *range(11, 16)}),  # a >= 1, a + 1 supervised
    ("specforge", {0, 1, 2, *range(12, 16)}),  # a and a + 1 supervised, a = 0 allowed
])
def test_each_rule_roots_blocks_where_it_says(target, rule, expected):
    assert drawn_anchors(rule, target, SUPERVISED) == expected


def test_a_block_rooted_at_zero_has_no_context_and_trains(target):
    """SpecForge's rule may root a block at position 0: it sees only itself (no context, so
    nothing reaches fc, which reads the context), and its loss is finite and moves the
    layers."""
    head = random_dflash_head(dflash_head_config(target, block_size=4), seed=2)
    objective = DFlashObjective(target, head, anchors=1, anchor_rule="specforge").train()
    tokens = torch.randint(2, 63, (1, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, :2] = True  # only (0, 1): anchor 0 is the one place
    blocks = anchor_blocks(tokens, mask, head.config, 1, None, "specforge")
    assert blocks.positions[0, 0] == 0 and not blocks.mask[0, :4, :8].any()
    loss = objective(tokens, mask).loss
    assert loss.isfinite() and loss > 0
    loss.backward()
    assert head.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    fc = head.fc.weight.grad  # it reads the context, which this block does not see
    assert fc is None or not fc.any()
    with pytest.raises(ValueError, match="anchor_rule must be one of next, specforge"):
        DFlashObjective(target, head, anchor_rule="both")
