"""SpecForge's own DFlash trainer on selfspec's rows: a tiny feature store converted to
SpecForge's offline layout (`selfspec.training.specforge_data`), two training steps by
`specforge train` (0.2.0, in its venv, on the CPU: one process, `NO_SHARD`, sdpa attention),
its checkpoint exported by its own `to_hf` exporter and loaded by `selfspec.heads.load_head`
with SpecForge's own logits (fp32, within 1e-4). Skipped without the venv
(scripts/peers.sh specforge)."""

import re

import pytest
import torch
from dflash_interop import (
    BLOCK,
    MASK,
    STREAMS,
    TOLERANCE,
    block_logits,
    make_inputs,
    make_target,
    max_difference,
    peer_python,
    peer_sizes,
    run_side,
)
from helpers import train_and_heldout_store

from selfspec.heads import DFlashHead, load_head
from selfspec.training.specforge_data import write_specforge_dflash_rows

ROW_LENGTH, STEPS = 16, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not peer_python("specforge").is_file(),
                       reason="SpecForge's venv is absent: build it with "
                              "scripts/peers.sh specforge"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store of a random 8-layer target (6 training rows of 16 tokens), its training rows in
    SpecForge's layout, SpecForge's DFlash trained on them and exported; its logits."""
    folder = tmp_path_factory.mktemp("specforge_train")
    target = make_target(folder / "target")
    store, _ = train_and_heldout_store(target, folder / "store", STREAMS, length=ROW_LENGTH)
    rows = write_specforge_dflash_rows(store, folder / "features", STREAMS)
    sizes = peer_sizes(target, seed=3) | {"steps": STEPS, "batch": 1, "lr": 3e-3,
                                          "anchors": 2, "seq_len": ROW_LENGTH}
    inputs = make_inputs()
    theirs, _ = run_side("specforge", "train", folder / "out", inputs, folder / "target", sizes,
                         features=str(folder / "features"))
    return folder, target, inputs, rows, theirs["dflash"]


def test_the_rows_are_written_as_specforge_reads_them(trained):
    folder, target, _, rows, _ = trained
    files = sorted((folder / "features").glob("*.ckpt"))
    assert rows == 6 and len(files) == 6
    row = torch.load(files[0])
    assert row["input_ids"].shape == row["loss_mask"].shape == (ROW_LENGTH,)
    assert row["hidden_states"].shape == (ROW_LENGTH, len(STREAMS) * target.config.hidden_size)
    with torch.no_grad():  # the fused streams, in order, from the target's own forward
        streams = target(row["input_ids"][None], torch.arange(ROW_LENGTH),
                         return_hidden=STREAMS).hidden
    assert torch.allclose(row["hidden_states"], torch.cat(streams, -1)[0], atol=1e-5)


def test_specforge_trained_the_steps_asked(trained):
    folder = trained[0]
    log = (folder / "out" / "specforge_train.log").read_text()
    losses = [float(x) for x in re.findall(r"step \d+: \{[^}]*'loss': ([0-9.eE+-]+)", log)]
    assert len(losses) == STEPS and all(0 < loss < 20 for loss in losses)


def test_the_head_specforge_trained_loads_in_selfspec_with_its_logits(trained):
    folder, target, inputs, _, theirs = trained
    head = load_head(folder / "out" / "dflash", target=target, allow_other_base=True)
    assert isinstance(head, DFlashHead) and head.config.target_layers == STREAMS
    assert (head.config.block_size, head.config.mask_token_id) == (BLOCK, MASK)
    assert max_difference(block_logits(head, target, inputs), theirs) < TOLERANCE

