"""speculators' own trainer on selfspec's rows (scripts/peer_train.py): a tiny feature store
converted to speculators' offline layout, two EAGLE-3 training steps by speculators 0.9.0 in
its venv on the CPU (scripts/speculators_cpu_train.py), the head it saved loaded by
`selfspec.heads.load_head` with speculators' own logits (fp32, within 1e-4), and replayed by
selfspec's evaluator as its decode loop would count it, losslessly. Skipped without the venv
(scripts/peers.sh speculators)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama, train_and_heldout_store
from peers.test_speculators import assert_close, eagle3_logits
from safetensors.torch import load_file, save_file

from selfspec import Transformer, generate
from selfspec.drafters import EagleDrafter
from selfspec.heads import EagleHead, load_head
from selfspec.measure.replay import record_greedy, replay

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".peers" / "speculators" / "venv" / "bin" / "python"
SIDE = Path(__file__).with_name("speculators_trained_side.py")
V, H, LAYERS, T = 64, 32, 8, 16
FUSED = (2, 4, 5)  # HF hidden_states ids, as selfspec numbers them
DRAFT_V, STEPS = 24, 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason="speculators' venv is absent: build it "
                                                     "with scripts/peers.sh speculators"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of speculators' EAGLE-3 trainer on a store of a random 8-layer target."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import peer_train

    work = tmp_path_factory.mktemp("peer_train")
    tiny_llama(0, vocab=V, layers=LAYERS, hidden=H).save_pretrained(work / "target")
    target = Transformer.from_pretrained(work / "target").eval()
    train_and_heldout_store(target, work / "store", (*FUSED, LAYERS), length=T)
    summary = peer_train.main([
        "eagle3", "--store", str(work / "store"), "--target", str(work / "target"),
        "--out", str(work / "out"), "--steps", str(STEPS), "--batch", "2", "--warmup", "1",
        "--draft-vocab-size", str(DRAFT_V), "--layers", *map(str, FUSED), "--threads", "1"])
    return work, target, summary


def test_speculators_trains_the_asked_steps_with_finite_losses(trained):
    _, _, summary = trained
    assert len(summary["losses"]) == STEPS and all(map(math.isfinite, summary["losses"]))
    assert (summary["train_rows"], summary["heldout_rows"]) == (6, 2)
    assert summary["tokens_per_s"] > 0


def test_its_head_loads_in_selfspec_with_speculators_logits(trained):
    work, target, summary = trained
    head = load_head(summary["head"], target=target, allow_other_base=True)
    assert isinstance(head, EagleHead)
    assert head.config.target_layers == FUSED and head.config.draft_vocab_size == DRAFT_V
    torch.manual_seed(7)
    inputs = {"input_ids": torch.randint(0, V, (T,)), "positions": torch.arange(T),
              "eagle3_hidden": torch.randn(T, 3 * H)}
    save_file(inputs, str(work / "inputs.safetensors"))
    done = subprocess.run([str(PYTHON), str(SIDE), str(work / "inputs.safetensors"),
                           summary["head"], str(work)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = load_file(str(work / "logits.safetensors"))["eagle3"]
    assert_close(eagle3_logits(head, target, inputs), theirs)


def test_selfspecs_replay_counts_its_drafts_as_decoding_does(trained):
    _, target, summary = trained
    head = load_head(summary["head"], target=target, allow_other_base=True)

    def drafter():
        return EagleDrafter(head, total_tokens=4, depth=2, top_k=2)

    prompt, n = [5, 6, 7, 8], 12
    live = generate(target, prompt, drafter=drafter(), max_new_tokens=n)
    assert live.tokens == generate(target, prompt, max_new_tokens=n).tokens  # lossless
    replayed = replay(target, drafter(), record_greedy(target, prompt, n))
    assert (replayed.steps, replayed.accepted) == (live.stats.steps, live.stats.accepted)
    assert replayed.steps > 0
