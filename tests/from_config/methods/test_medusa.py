"""The Medusa entry (from_config/methods/medusa.py): trees build drafters, lengths fold."""

import pytest
from helpers import toy

from selfspec.drafters import MedusaDrafter, MedusaProductDrafter
from selfspec.from_config.methods.medusa import medusa_drafter
from selfspec.from_config.sweeps import plan_sweep
from selfspec.heads import MedusaConfig, MedusaHeads


def test_tree_configs_build_static_and_top_k_product_drafters(cfg_of):
    heads = MedusaHeads(MedusaConfig(8, 64, num_heads=4))
    static = medusa_drafter(cfg_of("sweep", "tree=medusa_small").tree, heads,
                            max_depth=2)
    assert isinstance(static, MedusaDrafter) and static.tree.max_depth == 2
    assert static.max_nodes == 10  # medusa_small's nodes of depth <= 2
    cfg = cfg_of("sweep", "tree=top_k_products", "tree.top_k=3", "tree.max_nodes=100")
    product = medusa_drafter(cfg.tree, heads, max_depth=2)
    assert isinstance(product, MedusaProductDrafter)
    assert (product.depth, product.max_nodes) == (2, 3 + 9)  # the full product tree, 2 deep
    assert medusa_drafter(cfg.tree, heads).depth == 4  # depth null: every head
    with pytest.raises(ValueError, match="needs `choices` .* or `top_k` and `max_nodes`"):
        tree = cfg_of("sweep", "tree=top_k_products", "~tree.top_k").tree
        medusa_drafter(tree, heads)


def test_grid_folds_medusa_lengths_beyond_its_tree(quick_build, cfg_of, heads_dir):
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[ngram,medusa]", f"medusa_heads={heads_dir}",
                 "tree=chain4", "num_draft_tokens=[2,4,6]", "samplings=[greedy]")
    grid = plan_sweep(cfg, 1).grid  # chain4 would be 4 deep; the heads are 2
    assert [(p.method, p.draft_length) for p in grid.points()] == [
        ("ngram", 2), ("ngram", 4), ("ngram", 6), ("medusa", 2)]
