"""Interop with SpecForge 0.2.0, proven with its own classes in its own venv: selfspec's
`--to dflash` DFlash export and `--to sglang` EAGLE-3 and P-EAGLE exports load in its
`AutoDraftModel.from_pretrained`, and the drafts it builds from a draft config and writes as its
exporters do load in `selfspec.heads.load_head`; in both directions the two sides' logits agree
on the same inputs (fp32, within 1e-4). DFlash takes the fused streams from each side's own
forward of the target, and is scored both block by block as SpecForge drafts and all blocks at
once by its training forward (`OnlineDFlashModel`, its anchors fixed); EAGLE-3 is scored on
the same random fused streams, one step of SpecForge's training forward (its draft model's
backbone and logits; not its loss, whose Triton kernel needs a GPU); P-EAGLE (one layer, 4
tokens a forward) on the same streams by its training forward (`OnlinePEagleModel`) up to
the logits, its sampled rows fixed: every position at depth 0, three anchors at depths 1-3.

SpecForge's side runs in a subprocess (tests/peers/specforge_side.py) with the python of the
venv `scripts/peers.sh specforge` builds; without it these tests skip.
"""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from dflash_interop import (
    BLOCK,
    MASK,
    ROPE_THETA,
    STREAMS,
    TOLERANCE,
    H,
    T,
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
from eagle_interop import eagle3_logits, peagle_logits, peagle_rows
from helpers import random_eagle_head
from safetensors.torch import load_file, save_file

from selfspec import Transformer
from selfspec.heads import DFlashHead, EagleConfig, EagleHead, load_head
from selfspec.heads.export import export_head

DRAFT_V = 24
EAGLE3_STREAMS = (2, 4, 5)  # ours; SpecForge's eagle_config counts one less
PARALLEL = 4  # P-EAGLE's tokens a forward (SpecForge's num_depths)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not peer_python("specforge").is_file(),
                       reason="SpecForge's venv is absent: build it with "
                              "scripts/peers.sh specforge"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    target = make_target(folder)
    torch.manual_seed(8)
    inputs = make_inputs() | {"eagle3_hidden": torch.randn(T, 3 * H)}
    inputs |= peagle_rows(T, inputs["anchors"].tolist(), PARALLEL)
    return folder, target, inputs


def eagle_logits(kind: str, head: EagleHead, target: Transformer, inputs: dict
                 ) -> torch.Tensor:
    ids, fused = inputs["input_ids"], inputs["eagle3_hidden"]
    if kind == "peagle":
        return peagle_logits(head, target, ids, fused, inputs["anchors"].tolist())
    return eagle3_logits(head, target, ids, fused)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, setup):
    """A random selfspec DFlash head (--to dflash), EAGLE-3 and P-EAGLE head (--to sglang),
    loaded and scored by SpecForge's own classes; with selfspec's logits."""
    folder, target, inputs = setup
    out = tmp_path_factory.mktemp("to_specforge")
    dflash = random_head(target, seed=5)
    eagle = random_eagle_head(replace(EagleConfig.for_target(
        target.config, 3, draft_vocab_size=DRAFT_V, target_layers=EAGLE3_STREAMS),
        rope_theta=ROPE_THETA), seed=4)
    export_head(dflash, "dflash", out / "dflash", base_model=str(folder),
                target_layers_count=target.config.num_layers)
    peagle = random_eagle_head(replace(EagleConfig.for_target(
        target.config, 3, draft_vocab_size=DRAFT_V, target_layers=EAGLE3_STREAMS,
        parallel=PARALLEL, mask_token_id=MASK), rope_theta=ROPE_THETA), seed=6)
    export_head(eagle, "sglang", out / "eagle3", base_model=str(folder))
    export_head(peagle, "sglang", out / "peagle", base_model=str(folder))
    theirs, read = run_side("specforge", "load", out, inputs, folder)
    ours = {"dflash": block_logits(dflash, target, inputs),
            "eagle3": eagle_logits("eagle3", eagle, target, inputs),
            "peagle": eagle_logits("peagle", peagle, target, inputs)}
    return out, ours, theirs, read


def test_a_dflash_export_loads_in_specforge_with_selfspecs_logits(exported, setup):
    out, ours, theirs, read = exported
    config = json.loads((out / "dflash" / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert read["dflash"]["target_layer_ids"] == [s - 1 for s in STREAMS]
    assert (read["dflash"]["block_size"], read["dflash"]["mask_token_id"]) == (BLOCK, MASK)
    assert read["dflash"]["inv_freq_1"] == pytest.approx(
        expected_inv_freq_1(setup[1].config.head_dim), rel=1e-6)
    assert max_difference(ours["dflash"], theirs["dflash"]) < TOLERANCE
    assert max_difference(ours["dflash"], theirs["dflash_training"]) < TOLERANCE


def test_an_eagle3_export_loads_in_specforge_with_selfspecs_logits(exported, setup):
    out, ours, theirs, read = exported
    config = json.loads((out / "eagle3" / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert read["eagle3"]["rope_theta"] == ROPE_THETA
    assert read["eagle3"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        [s - 1 for s in EAGLE3_STREAMS]
    assert read["eagle3"]["draft_vocab_size"] == DRAFT_V
    assert read["eagle3"]["inv_freq_1"] == pytest.approx(
        expected_inv_freq_1(setup[1].config.head_dim), rel=1e-6)
    assert max_difference(ours["eagle3"], theirs["eagle3"]) < TOLERANCE


def test_a_peagle_export_loads_in_specforge_with_selfspecs_logits(exported, setup):
    out, ours, theirs, read = exported
    config = json.loads((out / "peagle" / "config.json").read_text())
    assert config["architectures"] == ["PEagleDraftModel"]
    assert read["peagle"] == {"mask_token_id": MASK, "num_depths": PARALLEL, "layers": 1,
                              "mask_hidden": [1, 1, 3 * H], "inv_freq_1": pytest.approx(
                                  expected_inv_freq_1(setup[1].config.head_dim), rel=1e-6)}
    assert theirs["peagle"].shape == (T + 3 * (PARALLEL - 1), DRAFT_V)
    assert max_difference(ours["peagle"], theirs["peagle"]) < TOLERANCE


@pytest.fixture(scope="module")
def saved(tmp_path_factory, setup):
    """A random DFlash, EAGLE-3 and P-EAGLE draft built and written by SpecForge, with its
    logits."""
    folder, target, inputs = setup
    out = tmp_path_factory.mktemp("from_specforge")
    sizes = peer_sizes(target, seed=2) | {
        "draft_vocab_size": DRAFT_V, "eagle3_layer_ids": [s - 1 for s in EAGLE3_STREAMS],
        "mask_token_id": MASK, "parallel": PARALLEL}
    theirs, _ = run_side("specforge", "save", out, inputs, folder, sizes)
    return out, theirs


def test_a_dflash_draft_specforge_writes_loads_in_selfspec_with_its_logits(saved, setup):
    out, theirs = saved
    _, target, inputs = setup
    config = json.loads((out / "dflash" / "config.json").read_text())
    assert config["rope_theta"] == ROPE_THETA  # SpecForge's exporters write both conventions
    head = load_head(out / "dflash", target=target, allow_other_base=True)
    assert isinstance(head, DFlashHead) and head.config.target_layers == STREAMS
    assert (head.config.block_size, head.config.mask_token_id) == (BLOCK, MASK)
    assert head.config.rope_theta == ROPE_THETA
    ours = block_logits(head, target, inputs)
    assert max_difference(ours, theirs["dflash"]) < TOLERANCE
    assert max_difference(ours, theirs["dflash_training"]) < TOLERANCE


def test_an_eagle3_draft_specforge_writes_loads_in_selfspec_with_its_logits(saved, setup):
    out, theirs = saved
    _, target, inputs = setup
    head = load_head(out / "eagle3", target=target, allow_other_base=True)
    assert isinstance(head, EagleHead) and head.config.version == 3
    assert head.config.target_layers == EAGLE3_STREAMS
    assert head.config.draft_vocab_size == DRAFT_V and head.config.rope_theta == ROPE_THETA
    assert int(head.t2d.sum()) == DRAFT_V and bool(head.t2d[: 2 * DRAFT_V : 2].all())
    assert max_difference(eagle_logits("eagle3", head, target, inputs),
                          theirs["eagle3"]) < TOLERANCE


def test_a_peagle_draft_specforge_writes_loads_in_selfspec_with_its_logits(saved, setup):
    out, theirs = saved
    _, target, inputs = setup
    head = load_head(out / "peagle", target=target, allow_other_base=True)
    assert isinstance(head, EagleHead) and head.loaded_from.count("SpecForge's PEagleDraftModel")
    assert (head.config.parallel, head.config.mask_token_id) == (PARALLEL, MASK)
    assert head.config.target_layers == EAGLE3_STREAMS and head.config.rope_theta == ROPE_THETA
    assert max_difference(eagle_logits("peagle", head, target, inputs),
                          theirs["peagle"]) < TOLERANCE


def test_a_specforge_peagle_draft_with_a_trained_embedding_is_refused(saved, setup, tmp_path):
    """SpecForge's P-EAGLE trainer trains the draft's embedding and saves it, and its draft
    embeds with it; selfspec's heads embed with the target's, so such a folder is refused."""
    out, _ = saved
    shutil.copytree(out / "peagle", tmp_path / "peagle")
    weights = load_file(str(tmp_path / "peagle" / "model.safetensors"))
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] * 1.1
    save_file(weights, str(tmp_path / "peagle" / "model.safetensors"))
    with pytest.raises(ValueError, match="holds its own embed_tokens"):
        load_head(tmp_path / "peagle", target=setup[1], allow_other_base=True)
