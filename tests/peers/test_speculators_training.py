"""speculators' own trainer on selfspec's rows (scripts/peer_train.py): a tiny feature store
converted to speculators' offline layout, two EAGLE-3 and two DFlash training steps by
speculators 0.9.0 in its venv on the CPU (scripts/speculators_cpu_train.py), each head it
saved loaded by `selfspec.heads.load_head` with speculators' own logits (fp32, within 1e-4),
and replayed by selfspec's evaluator as its decode loop would count it, losslessly. Skipped
without the venv (scripts/peers.sh speculators)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama, train_and_heldout_store
from peers.test_speculators import (
    ANCHORS,
    BLOCK,
    MASK,
    assert_close,
    dflash_logits,
    eagle_logits,
)
from safetensors.torch import load_file, save_file

from selfspec import Transformer, generate
from selfspec.drafters import DFlashDrafter, EagleDrafter
from selfspec.heads import DFlashHead, EagleHead, load_head
from selfspec.measure.replay import record_greedy, replay

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".peers" / "speculators" / "venv" / "bin" / "python"
SIDE = Path(__file__).with_name("speculators_trained_side.py")
V, H, LAYERS, T = 64, 32, 8, 16
FUSED = (2, 4, 5)  # HF hidden_states ids, as selfspec numbers them
DRAFT_V, STEPS = 24, 2
KINDS = ["eagle3", "dflash"]
HEADS = {"eagle3": EagleHead, "dflash": DFlashHead}
# each head's own settings: EAGLE-3's draft vocabulary; DFlash's block and mask token as
# tests/peers/test_speculators.py scores them, two anchors a row
OPTIONS = {"eagle3": ["--draft-vocab-size", str(DRAFT_V)],
           "dflash": ["--block-size", str(BLOCK), "--mask-token-id", str(MASK), "--anchors", "2"]}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason="speculators' venv is absent: build it "
                                                     "with scripts/peers.sh speculators"),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A store of a random 8-layer target: 6 training rows and 2 held out, 16 tokens each."""
    folder = tmp_path_factory.mktemp("peer_train")
    tiny_llama(0, vocab=V, layers=LAYERS, hidden=H).save_pretrained(folder / "target")
    target = Transformer.from_pretrained(folder / "target").eval()
    train_and_heldout_store(target, folder / "store", (*FUSED, LAYERS), length=T)
    return folder, target


@pytest.fixture(scope="module", params=KINDS)
def trained(request, work):
    """Two steps of speculators' trainer of that kind on the store."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import peer_train

    folder, target = work
    kind = request.param
    summary = peer_train.main([
        kind, "--store", str(folder / "store"), "--target", str(folder / "target"),
        "--out", str(folder / kind), "--steps", str(STEPS), "--batch", "2", "--warmup", "1",
        "--layers", *map(str, FUSED), "--threads", "1", *OPTIONS[kind]])
    return kind, folder / kind, target, summary


def test_speculators_trains_the_asked_steps_with_finite_losses(trained):
    _, _, _, summary = trained
    assert len(summary["losses"]) == STEPS and all(map(math.isfinite, summary["losses"]))
    assert (summary["train_rows"], summary["heldout_rows"]) == (6, 2)
    assert summary["tokens_per_s"] > 0


@pytest.mark.parametrize("where", ["head", "export"])
def test_its_head_loads_in_selfspec_with_speculators_logits(trained, where):
    """Read from speculators' folder, and from the selfspec export the runner writes of it
    (what selfspec's evaluators read)."""
    kind, out, target, summary = trained
    head = load_head(summary[where], target=target, allow_other_base=True)
    assert isinstance(head, HEADS[kind]) and head.config.target_layers == FUSED
    torch.manual_seed(7)
    hidden = torch.randn(T, 3 * H)
    inputs = {"input_ids": torch.randint(0, V - 1, (T,)), "positions": torch.arange(T),
              "eagle3_hidden": hidden, "dflash_hidden": hidden.clone(),
              "anchors": torch.tensor(ANCHORS)}
    save_file(inputs, str(out / "inputs.safetensors"))
    done = subprocess.run([str(PYTHON), str(SIDE), kind, str(out / "inputs.safetensors"),
                           summary["head"], str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = load_file(str(out / "logits.safetensors"))[kind]
    if kind == "eagle3":
        assert head.config.draft_vocab_size == DRAFT_V
        assert_close(eagle_logits("eagle3", head, target, inputs), theirs)
    else:
        assert (head.config.block_size, head.config.mask_token_id) == (BLOCK, MASK)
        assert_close(dflash_logits(head, target, inputs), theirs)


def test_selfspecs_replay_counts_its_drafts_as_decoding_does(trained):
    kind, _, target, summary = trained
    head = load_head(summary["export"], target=target)

    def drafter():
        if kind == "eagle3":
            return EagleDrafter(head, total_tokens=4, depth=2, top_k=2)
        return DFlashDrafter(head)

    prompt, n = [5, 6, 7, 8], 12
    live = generate(target, prompt, drafter=drafter(), max_new_tokens=n)
    assert live.tokens == generate(target, prompt, max_new_tokens=n).tokens  # lossless
    replayed = replay(target, drafter(), record_greedy(target, prompt, n))
    assert (replayed.steps, replayed.accepted) == (live.stats.steps, live.stats.accepted)
    assert replayed.steps > 0
