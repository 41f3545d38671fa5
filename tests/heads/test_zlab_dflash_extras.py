"""z-lab's dflash 0.1.0 reads settings from a DFlash draft's config.json that selfspec's
DFlashHead does not compute (heads/dflash_layouts.py's `ZLAB_EXTRAS`): a folder that sets one
is refused, naming it, and one that leaves them at their neutral values reads as before."""

import json

import pytest
from helpers import dflash_head_config, random_dflash_head

from selfspec.heads import DFlashHead, load_head
from selfspec.heads.export import export_head

REFUSED = [
    ({"dflash_config": {"input_embedding_scale": 2.0}}, "input_embedding_scale 2.0"),
    ({"output_multiplier": 0.5}, "output_multiplier 0.5"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
    ({"dflash_config": {"conv_kernel_size": 4}}, "conv_kernel_size 4"),
    ({"architectures": ["DFlash2DraftModel"]}, "architecture DFlash2DraftModel"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"is_causal": True}, "is_causal true"),
]
NEUTRAL = {"dflash_config": {"input_embedding_scale": 1.0}, "output_multiplier": 1.0,
           "final_logit_softcapping": 0.0, "is_causal": False}


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash")
    config = dflash_head_config(target, target_layers=(1, 2))  # the engines: no stream 0
    export_head(random_dflash_head(config, seed=1), "dflash", folder,
                base_model="org/toy")
    return folder


def with_config(folder, tmp_path, change: dict):
    """A copy of the exported folder, its config.json changed (dflash_config merged)."""
    config = json.loads((folder / "config.json").read_text())
    d = config["dflash_config"] | change.get("dflash_config", {})
    config |= change | {"dflash_config": d}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(("change", "named"), REFUSED)
def test_a_zlab_setting_selfspec_does_not_compute_is_refused(exported, target, tmp_path,
                                                            change, named):
    with pytest.raises(ValueError, match=named):
        load_head(with_config(exported, tmp_path, change), target=target, allow_other_base=True)


def test_neutral_zlab_settings_read_as_before(exported, target, tmp_path):
    head = load_head(with_config(exported, tmp_path, NEUTRAL), target=target,
                     allow_other_base=True)
    assert isinstance(head, DFlashHead)


def test_top_level_target_layer_ids_are_read_as_zlab_reads_them(exported, target, tmp_path):
    """dflash takes `target_layer_ids` from dflash_config or else the top level."""
    config = json.loads((exported / "config.json").read_text())
    ids = config["dflash_config"].pop("target_layer_ids")
    (tmp_path / "config.json").write_text(json.dumps(config | {"target_layer_ids": ids}))
    (tmp_path / "model.safetensors").symlink_to(exported / "model.safetensors")
    head = load_head(tmp_path, target=target, allow_other_base=True)
    assert head.config.target_layers == tuple(i + 1 for i in ids) == (1, 2)
