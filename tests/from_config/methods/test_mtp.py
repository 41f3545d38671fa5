"""The mtp registry entry (from_config/methods/mtp.py): its rows, its checks, when a sweep runs
it, and the drafter each row builds."""

import pytest
from mtp_reference import mtp_target
from omegaconf import OmegaConf

from selfspec.drafters.eagle_static import DynamicShape, StaticShape
from selfspec.from_config.methods import entry
from selfspec.from_config.methods.entry import Loaded
from selfspec.from_config.methods.mtp import MtpVariant
from selfspec.tree import Tree


def settings(**mtp):
    return OmegaConf.create({"mtp": {"total_tokens": [None], "top_k": 3,
                                     "sampled_children": True} | mtp})


def test_rows_are_a_chain_and_a_tree_per_node_count():
    mtp = entry("mtp")
    rows = mtp.variants(settings(total_tokens=[None, 8]), True)
    assert [row.label() for row in rows] == ["mtp", "mtp/tree8"]
    with pytest.raises(ValueError, match=r"mtp.total_tokens: give null \(a chain\) or node"):
        mtp.variants(settings(total_tokens=[0]), True)
    with pytest.raises(ValueError, match=r"mtp.total_tokens \[4\] < the longest draft length"):
        mtp.check(settings(total_tokens=[None, 4]), (2, 6))
    with pytest.raises(ValueError, match="mtp.top_k must be an integer >= 1"):
        mtp.check(settings(top_k=0), (2,))


def test_a_sweep_runs_it_where_the_model_names_modules():
    mtp = entry("mtp")
    assert mtp.default_when(OmegaConf.create({"model": {"arch": {"mtp_modules": 1}}}))
    assert not mtp.default_when(OmegaConf.create({"model": {"arch": {"num_layers": 2}}}))
    assert not mtp.default_when(OmegaConf.create({"model": {"arch": None}}))


def test_each_row_drafts_its_shape_with_the_targets_modules():
    target = mtp_target("nextn", seed=1)
    loaded = Loaded(settings(top_k=2), target)
    chain = entry("mtp").drafter(loaded, MtpVariant(), 3)
    assert chain.shape == StaticShape(Tree.chain(3)) and chain.head.module is target.mtp[0]
    tree = entry("mtp").drafter(loaded, MtpVariant(total_tokens=6), 3)
    assert tree.shape == DynamicShape(total_tokens=6, depth=3, top_k=2)
