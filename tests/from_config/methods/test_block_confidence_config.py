"""The block confidence in the configs (from_config/methods/dflash.py and eagle.py): a
dflash[/tree{N}]/conf{t} row per threshold, the trainers' confidence_head and
confidence_threshold, and the settings that cannot go together refused in one line."""

import pytest

from selfspec.from_config.methods import entry
from selfspec.from_config.methods.dflash import check_dflash_settings, meta_head
from selfspec.from_config.methods.eagle import check_eagle_settings


def test_a_row_per_confidence_threshold_beside_each_shape(cfg_of):
    cfg = cfg_of("sweep", "dflash.tree_nodes=[null,6]", "dflash.confidence_threshold=[null,0.5]")
    variants = entry("dflash").variants(cfg, True)
    assert [v.label() for v in variants] == ["dflash", "dflash/conf0.5", "dflash/tree6",
                                             "dflash/tree6/conf0.5"]
    assert variants[-1].tree_nodes == 6 and variants[-1].confidence_threshold == 0.5
    with pytest.raises(ValueError, match=r"dflash.confidence_threshold: give numbers in \(0, 1\)"):
        entry("dflash").variants(cfg_of("sweep", "dflash.confidence_threshold=[1.5]"), True)


@pytest.mark.slow  # two trainer configs checked (~1 s)
def test_the_dflash_trainer_builds_and_drafts_with_a_confidence_head(cfg_of):
    cfg = cfg_of("train_dflash", "dflash.confidence_head=true", "dflash.confidence_threshold=0.5")
    check_dflash_settings(cfg)
    assert meta_head(cfg).config.confidence_head
    assert not meta_head(cfg_of("train_dflash")).config.confidence_head
    with pytest.raises(ValueError, match="needs a head trained with a confidence head"):
        check_dflash_settings(cfg_of("train_dflash", "dflash.confidence_threshold=0.5"))


@pytest.mark.slow  # three EAGLE-3 trainer configs checked (~1 s)
def test_the_eagle_trainer_takes_a_confidence_for_p_eagle_alone(cfg_of):
    peagle = ("eagle.version=3", "eagle.parallel=4")
    check_eagle_settings(cfg_of("train_eagle", *peagle, "eagle.confidence_head=true",
                                "eagle.confidence_threshold=0.5"))
    with pytest.raises(ValueError, match="eagle.confidence_head=true sizes a P-EAGLE block"):
        check_eagle_settings(cfg_of("train_eagle", "eagle.confidence_head=true"))
    with pytest.raises(ValueError, match="cuts a P-EAGLE head's chain"):
        check_eagle_settings(cfg_of("train_eagle", "eagle.version=2",
                                    "eagle.confidence_threshold=0.5"))
