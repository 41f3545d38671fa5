"""The DFlash entry (from_config/methods/dflash.py): its rows and the lengths it folds."""

import pytest
import torch
from helpers import toy

from selfspec.from_config.methods import entry
from selfspec.from_config.sweeps import plan_sweep
from selfspec.heads.draft_vocab import rarest_token


def test_dflash_rows_and_lengths_fold_into_the_heads_block(quick_build, cfg_of, dflash_dir):
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[dflash]", f"dflash_head={dflash_dir}",
                 "dflash.tree_nodes=[null,6]", "num_draft_tokens=[2,4,8]")
    method = entry("dflash")
    variants = method.variants(cfg, True)
    assert [v.label() for v in variants] == ["dflash", "dflash/tree6"]
    assert method.lengths(cfg, variants[0], (2, 4, 8)) == (2, 4)  # blocks of 5: at most 4
    plan = plan_sweep(cfg, 1, greedy_only=True)
    assert {p.method for p in plan.grid.points()} == {"dflash", "dflash/tree6"}
    with pytest.raises(ValueError, match="dflash.tree_nodes: give node counts >= 1"):
        method.variants(cfg_of("sweep", "dflash.tree_nodes=[0]"), True)
    with pytest.raises(ValueError, match="dflash needs a trained head: set dflash_head="):
        method.check(cfg_of("sweep", *toy(quick_build)), (2,))


def test_the_rarest_token_is_the_highest_id_among_the_least_counted():
    assert rarest_token(torch.tensor([3, 0, 5, 0, 2])) == 3
    assert rarest_token(torch.tensor([1, 1])) == 1
