"""Feature stores from configs (from_config/features.py): the layers a store keeps, what
claims its folder, and a trainer without a store."""

import pytest

from selfspec.from_config.features import data_settings_key, store_layers, trainer_features


def test_store_layers_name_eagle3s_fused_layers_and_exit_layers(cfg_of):
    cfg = cfg_of("store", "store.layers=[eagle3,10,15]")
    assert store_layers(cfg, 30) == (2, 10, 15, 27)  # sorted, once each
    assert store_layers(cfg_of("store", "store.layers=[]"), 30) == ()
    # each trainer's name for its default streams (its TrainerEntry.store_layers)
    assert store_layers(cfg_of("store", "store.layers=[dflash,eagle3]"), 30) == (2, 15, 27, 28)
    with pytest.raises(ValueError, match=r"store.layers: each entry is a layer count in \[0, 8\], "
                                         r"dflash or eagle3, got 'eagle2'"):
        store_layers(cfg_of("store", "store.layers=[eagle2]"), 8)


def test_the_rows_settings_claim_a_store_folder_and_the_cache_folder_does_not(cfg_of):
    base = data_settings_key(cfg_of("store"))
    assert data_settings_key(cfg_of("store", "train_data.cache_dir=/elsewhere")) == base
    for changed in ("train_data.max_answers=10", "trainer.seq_len=64",
                    "train_data.source=sharegpt"):
        assert data_settings_key(cfg_of("store", changed)) != base, changed


def test_a_trainer_without_a_store_runs_the_target(cfg_of):
    cfg = cfg_of("train_eagle", "run_dir=/tmp/unused")
    assert cfg.trainer.features is None
    assert trainer_features(cfg, None, None, None) is None
