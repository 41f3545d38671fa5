"""What registry entries share (from_config/methods/entry.py): shipped head folders."""

import pytest
from omegaconf import OmegaConf

from selfspec import from_config


def test_heads_that_ship_are_found_by_the_models_name(tmp_path):
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "medusa_heads": "shipped",
                            "eagle_head": str(tmp_path)})
    assert from_config.head_folder(cfg, "eagle_head") == tmp_path  # a path is a path
    with pytest.raises(FileNotFoundError, match="medusa_heads=shipped: none ship for model=tiny"):
        from_config.head_folder(cfg, "medusa_heads")
