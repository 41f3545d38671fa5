"""SpecForge's own DFlash trainer on selfspec's rows (scripts/peer_train.py dflash --peer
specforge): a tiny feature store converted to SpecForge's offline layout
(`selfspec.training.specforge_data`), two training steps by `specforge train` (0.2.0, in its
venv, on the CPU: one process, `NO_SHARD`, sdpa attention, fp32; scripts/specforge_cpu_train.py),
its checkpoint exported by its own `to_hf` exporter and loaded by `selfspec.heads.load_head`,
from SpecForge's folder and from the selfspec export the runner writes, with SpecForge's own
logits (fp32, within 1e-4). Skipped without the venv (scripts/peers.sh specforge)."""

import math
import sys

import pytest
import torch
from dflash_interop import (
    BLOCK,
    DRAFT_LAYERS,
    ROOT,
    STREAMS,
    TOLERANCE,
    block_logits,
    make_inputs,
    make_target,
    max_difference,
    peer_python,
    run_side,
)
from helpers import train_and_heldout_store

from selfspec.heads import DFlashHead, load_head

ROW_LENGTH, STEPS = 16, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not peer_python("specforge").is_file(),
                       reason="SpecForge's venv is absent: build it with "
                              "scripts/peers.sh specforge"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store of a random 8-layer target (6 training rows of 16 tokens, the first 3 tokens
    unsupervised), SpecForge's DFlash trained on it by peer_train.py; SpecForge's logits of
    the head it exported."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import peer_train

    folder = tmp_path_factory.mktemp("specforge_train")
    target = make_target(folder / "target")
    train_and_heldout_store(target, folder / "store", STREAMS, length=ROW_LENGTH)
    summary = peer_train.main([
        "dflash", "--peer", "specforge", "--store", str(folder / "store"),
        "--target", str(folder / "target"), "--out", str(folder / "out"),
        "--steps", str(STEPS), "--batch", "2", "--warmup", "1", "--anchors", "2",
        "--block-size", str(BLOCK), "--num-layers", str(DRAFT_LAYERS),
        "--layers", *map(str, STREAMS), "--threads", "1"])
    inputs = make_inputs()
    theirs, _ = run_side("specforge", "load", folder / "out", inputs, folder / "target")
    return folder, target, inputs, summary, theirs


def test_the_rows_are_written_as_specforge_reads_them(trained):
    folder, target, _, summary, _ = trained
    files = sorted((folder / "out" / "features").glob("*.ckpt"))
    assert summary["train_rows"] == len(files) == 6
    row = torch.load(files[0])
    assert row["input_ids"].shape == row["loss_mask"].shape == (ROW_LENGTH,)
    with torch.no_grad():  # the fused streams, in order, from the target's own forward
        streams = target(row["input_ids"][None], torch.arange(ROW_LENGTH),
                         return_hidden=STREAMS).hidden
    assert torch.allclose(row["hidden_states"], torch.cat(streams, -1)[0], atol=1e-5)


def test_specforge_trains_the_asked_steps_with_finite_losses(trained):
    summary = trained[3]
    assert summary["peer"] == "specforge" and len(summary["losses"]) == STEPS
    assert all(map(math.isfinite, summary["losses"])) and math.isfinite(summary["tokens_per_s"])


@pytest.mark.parametrize("where", ["head", "export"])
def test_its_head_loads_in_selfspec_with_specforges_logits(trained, where):
    _, target, inputs, summary, theirs = trained
    head = load_head(summary[where], target=target, allow_other_base=True)
    assert isinstance(head, DFlashHead) and head.config.target_layers == STREAMS
    assert (head.config.block_size, head.config.mask_token_id) == \
        (BLOCK, summary["mask_token_id"])
    ours = block_logits(head, target, inputs)
    assert max_difference(ours, theirs["dflash"]) < TOLERANCE
    assert max_difference(ours, theirs["dflash_training"]) < TOLERANCE
