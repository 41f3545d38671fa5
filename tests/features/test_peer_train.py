"""scripts/peer_train.py's passes: speculators stops at --max-steps only after a step, so a pass
begun after the last step would still run one; the runner asks for exactly the passes the
steps need (the trainer itself runs in tests/peers/test_speculators_training.py)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("peer_train", ROOT / "scripts" / "peer_train.py")
peer_train = importlib.util.module_from_spec(spec)
sys.modules["peer_train"] = peer_train  # its dataclass looks its module up
spec.loader.exec_module(peer_train)


@pytest.mark.parametrize(("steps", "rows", "batch"),
                         [(2, 6, 2), (3, 6, 2), (4, 6, 2), (400, 6152, 4), (1, 1, 8), (9, 7, 2)])
def test_the_passes_hold_the_steps_and_none_begins_after_the_last(steps, rows, batch):
    per_pass = math.ceil(rows / batch)  # a last, short batch is a step too
    passes = peer_train.epochs_for(steps, rows, batch)
    assert (passes - 1) * per_pass < steps <= passes * per_pass


def test_specforges_eagle3_is_refused_before_anything_runs(tmp_path):
    """SpecForge's EAGLE-3 loss is a Triton kernel: --peer specforge trains DFlash only."""
    with pytest.raises(ValueError, match="Triton kernel.*--peer speculators"):
        peer_train.main(["eagle3", "--peer", "specforge", "--store", str(tmp_path / "store"),
                         "--target", str(tmp_path / "target"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
