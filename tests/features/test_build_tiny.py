"""The tiny-model recipe end to end at toy size (``--quick``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from helpers import suite_threads

from selfspec.training.checkpoints import checkpoint_problem

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SNIPPET = 'def f(x):\n\t  return  x  +1 \r\n\n    # caf\u00e9 \U0001f642\n  """doc"""  \n'



def test_tokenizer_round_trips_source_exactly(quick_build):
    from transformers import AutoTokenizer

    for folder in ("tokenizer", "target", "draft"):
        tok = AutoTokenizer.from_pretrained(quick_build / folder)
        assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
        ids = tok(SNIPPET)["input_ids"]
        assert tok.decode(ids) == SNIPPET


def test_models_load_and_draft_is_smaller(quick_build):
    from transformers import AutoModelForCausalLM

    configs = {}
    for folder in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(quick_build / folder, dtype=torch.float32)
        logits = model(input_ids=torch.tensor([[0, 5, 7]])).logits
        assert logits.shape == (1, 3, model.config.vocab_size)
        configs[folder] = model.config
    t, d = configs["target"], configs["draft"]
    assert d.vocab_size == t.vocab_size
    assert (d.hidden_size, d.num_hidden_layers) <= (t.hidden_size, t.num_hidden_layers)
    assert d.hidden_size * d.num_hidden_layers < t.hidden_size * t.num_hidden_layers


def test_cards_and_curves(quick_build):
    for folder, name in (("target", "selfspec-tiny"), ("draft", "selfspec-tiny-draft")):
        card = (quick_build / folder / "README.md").read_text()
        assert card.startswith(f"# {name}\n") and "held-out loss" in card
        assert "build_tiny.py --quick" in card
        curve = json.loads((quick_build / folder / "loss_curve.json").read_text())
        assert curve["final"]["heldout_loss"] > 0 and curve["curve"]
        assert {"step", "train_loss", "heldout_loss", "tokens_seen", "elapsed_s"} <= set(
            curve["curve"][-1])
        assert curve["curve"][-1]["heldout_loss"] is not None
    checkpoints = (quick_build / "_work" / "target" / "checkpoints").glob("step_*")
    assert any(checkpoint_problem(folder) is None for folder in checkpoints)  # fit's run folder


def test_existing_checkpoint_needs_resume_or_fresh(quick_build):
    build_tiny = importlib.import_module("build_tiny")  # cached by the fixture
    threads = str(suite_threads())  # main sets torch's threads for the session
    with pytest.raises(FileExistsError, match="--resume"):
        build_tiny.main(["--quick", "--out", str(quick_build), "--stage", "target",
                         "--threads", threads])


def test_resume_keeps_finished_stages(quick_build, capsys):
    build_tiny = importlib.import_module("build_tiny")  # cached by the fixture
    build_tiny.main(["--quick", "--out", str(quick_build), "--resume",
                     "--threads", str(suite_threads())])
    out = capsys.readouterr().out
    assert all(f"[{stage}] kept" in out for stage in ("tokenizer", "target", "draft"))
