"""The DFlash entry (from_config/methods/dflash.py): its rows, configs that build heads,
drafters and objectives, and settings refused before anything loads."""

import pytest
import torch
from helpers import tiny_llama, toy

from selfspec import from_config
from selfspec.from_config.methods import entry
from selfspec.heads.draft_vocab import rarest_token
from selfspec.model import Transformer
from selfspec.training.loop import TokenRows


def test_dflash_rows_and_lengths_fold_into_the_heads_block(quick_build, cfg_of, dflash_dir):
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[dflash]", f"dflash_head={dflash_dir}",
                 "dflash.tree_nodes=[null,6]", "num_draft_tokens=[2,4,8]")
    method = entry("dflash")
    variants = method.variants(cfg, True)
    assert [v.label() for v in variants] == ["dflash", "dflash/tree6"]
    assert method.lengths(cfg, variants[0], (2, 4, 8)) == (2, 4)  # blocks of 5: at most 4
    plan = from_config.plan_sweep(cfg, 1, greedy_only=True)
    assert {p.method for p in plan.grid.points()} == {"dflash", "dflash/tree6"}
    with pytest.raises(ValueError, match="dflash.tree_nodes: give node counts >= 1"):
        method.variants(cfg_of("sweep", "dflash.tree_nodes=[0]"), True)
    with pytest.raises(ValueError, match="dflash needs a trained head: set dflash_head="):
        method.check(cfg_of("sweep", *toy(quick_build)), (2,))


@pytest.mark.parametrize("overrides", [[], ["dflash.loss=kl", "dflash.draft_vocab_size=32",
                                             "dflash.tree_nodes=6", "dflash.mask_token_id=3"]])
def test_dflash_training_configs_build_their_head_drafter_and_objective(cfg_of, overrides):
    cfg = cfg_of("train_dflash", "dflash.target_layers=[0,1,2]", "dflash.block_size=4",
                 "run_dir=/tmp/unused", *overrides)
    from_config.check_dflash_settings(cfg)
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 60, (6, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    training = from_config.dflash_training(cfg, target, rows)
    head = training.head
    assert head.config == training.config and head.config.target_layers == (0, 1, 2)
    if overrides:
        assert head.config.mask_token_id == 3 and training.objective.teacher
        assert set(head.draft_vocab.target_ids.tolist()) < set(tokens.unique().tolist())
    else:  # the rarest token of the rows: one they never hold, the highest such id
        assert head.config.mask_token_id == 63
    drafter = from_config.dflash_drafter(cfg, head)
    assert drafter.k == 3 and drafter.shape.nodes == (6 if overrides else None)
    assert training.objective(rows.tokens, rows.loss_mask).loss.isfinite()


def test_the_rarest_token_is_the_highest_id_among_the_least_counted():
    assert rarest_token(torch.tensor([3, 0, 5, 0, 2])) == 3
    assert rarest_token(torch.tensor([1, 1])) == 1


@pytest.mark.parametrize("override, message", [
    ("dflash.loss=mse", "dflash.loss must be ce"),
    ("dflash.gamma=0", "dflash.gamma must be > 0"),
    ("dflash.anchors=0", "dflash.anchors must be an integer >= 1"),
    ("dflash.block_size=1", "dflash.block_size must be an integer >= 2"),
    ("dflash.num_draft_tokens=9", r"num_draft_tokens must be in 1\.\.8"),
])
def test_impossible_dflash_settings_are_refused_before_anything_loads(cfg_of, override, message):
    cfg = cfg_of("train_dflash", override, "run_dir=/tmp/unused")
    with pytest.raises(ValueError, match=message):
        from_config.check_dflash_settings(cfg)
