"""Interop with z-lab's dflash 0.1.0 (the reference `DFlashDraftModel`, on transformers 5.15),
proven with its own class in its own venv: selfspec's `--to dflash` export loads in its
`from_pretrained`, and a draft its `save_pretrained` writes loads in `selfspec.heads.load_head`;
in both directions the two sides' logits agree on the same target and tokens (fp32, within
1e-4), each side taking the fused streams from its own forward of the target.

dflash's side runs in a subprocess (tests/peers/dflash_side.py) with the python of the venv
`scripts/peers.sh dflash` builds; without it these tests skip.
"""

import json
from dataclasses import replace

import pytest
from dflash_interop import (
    BLOCK,
    MASK,
    ROPE_THETA,
    STREAMS,
    TOLERANCE,
    block_logits,
    expected_inv_freq_1,
    make_inputs,
    make_target,
    max_difference,
    peer_python,
    peer_sizes,
    random_head,
    run_side,
)

from selfspec.heads import DFlashHead, load_head
from selfspec.heads.export import export_head

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not peer_python("dflash").is_file(),
                       reason="dflash's venv is absent: build it with scripts/peers.sh dflash"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    return folder, make_target(folder), make_inputs()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, setup):
    """A random selfspec DFlash head exported --to dflash, scored by dflash's own class."""
    folder, target, inputs = setup
    out = tmp_path_factory.mktemp("to_dflash")
    head = random_head(target, seed=5)
    export_head(head, "dflash", out / "dflash", base_model=str(folder),
                target_layers_count=target.config.num_layers)
    theirs, read = run_side("dflash", "load", out, inputs, folder)
    return out, block_logits(head, target, inputs), theirs["dflash"], read["dflash"]


def test_a_dflash_export_loads_in_dflash_with_selfspecs_logits(exported, setup):
    out, ours, theirs, read = exported
    config = json.loads((out / "dflash" / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert read["target_layer_ids"] == [s - 1 for s in STREAMS]
    assert (read["block_size"], read["mask_token_id"]) == (BLOCK, MASK)
    head_dim = setup[1].config.head_dim
    assert read["inv_freq_1"] == pytest.approx(expected_inv_freq_1(head_dim), rel=1e-6)
    assert max_difference(ours, theirs) < TOLERANCE


@pytest.fixture(scope="module")
def saved(tmp_path_factory, setup):
    """A random draft made and saved by dflash's own class, with its logits there."""
    folder, target, inputs = setup
    out = tmp_path_factory.mktemp("from_dflash")
    theirs, read = run_side("dflash", "save", out, inputs, folder, peer_sizes(target, seed=2))
    return out, theirs["dflash"], read["dflash"]


def test_a_draft_dflash_saves_loads_in_selfspec_with_its_logits(saved, setup):
    out, theirs, read = saved
    _, target, inputs = setup
    head = load_head(out / "dflash", target=target, allow_other_base=True)
    assert isinstance(head, DFlashHead) and head.config.target_layers == STREAMS
    assert (head.config.block_size, head.config.mask_token_id) == (BLOCK, MASK)
    assert head.config.rope_theta == ROPE_THETA == read["rope_theta"]
    assert max_difference(block_logits(head, target, inputs), theirs) < TOLERANCE


def test_a_stream_read_one_off_would_be_caught(saved, setup):
    """The comparison can fail: the same weights fusing the streams one layer later (the
    off-by-one between the two numberings) leave the tolerance far behind."""
    out, theirs, _ = saved
    _, target, inputs = setup
    head = load_head(out / "dflash", target=target, allow_other_base=True)
    shifted = replace(head.config, target_layers=tuple(s + 1 for s in STREAMS))
    moved = DFlashHead(shifted)
    moved.load_state_dict(head.state_dict())
    assert max_difference(block_logits(moved, target, inputs), theirs) > 100 * TOLERANCE
