"""A feature store's rows in speculators' offline layout (training/speculators_data.py): each
row's file holds its tokens, the fused streams numbered as HF's hidden_states and the last
layer's output before the norm; training rows come before held-out rows and the ratio splits
exactly there; the loss mask moves to the law that predicts the token; the draft vocabulary is
selfspec's. The datasets folder and speculators' own trainer are checked in
tests/peers/test_speculators_training.py."""

import numpy as np
import pytest
import torch
from helpers import tiny_llama, train_and_heldout_store
from safetensors.torch import load_file

from selfspec import Transformer
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.training.speculators_data import (
    OfflineRows,
    speculators_loss_mask,
    write_draft_vocab,
    write_hidden_states,
)

LAYERS, FINAL = (1, 2), 4  # fused streams of a 4-layer target, and its last layer


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0, layers=FINAL).eval()


@pytest.fixture(scope="module")
def store(hf_target, tmp_path_factory):
    target = Transformer.from_hf(hf_target).eval()
    return train_and_heldout_store(target, tmp_path_factory.mktemp("store"), (*LAYERS, FINAL))


def test_each_row_holds_hf_streams_then_the_last_layers_output_before_the_norm(
        hf_target, store, tmp_path):
    features, rows = store
    written = write_hidden_states(features, tmp_path, LAYERS, FINAL)
    assert (written.train_rows, written.heldout_rows, written.seq_len) == (6, 2, 12)
    for i, tokens in enumerate(rows.tokens):  # training rows, then held-out rows
        row = load_file(str(tmp_path / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(row["token_ids"], tokens)
        with torch.no_grad():  # HF's last hidden state is after its norm; the last slot before
            hf = hf_target(tokens[None], output_hidden_states=True)
            normed = hf_target.model.norm(row["hidden_states"][None, :, -1])[0]
        states = row["hidden_states"]  # [T, 3, H]
        assert states.shape == (12, 3, 32) and states.dtype == torch.float32
        for slot, layer in enumerate(LAYERS):
            torch.testing.assert_close(states[:, slot], hf.hidden_states[layer][0],
                                       atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(normed, hf.hidden_states[FINAL][0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(states[:, -1], hf.hidden_states[FINAL][0], atol=1e-3), \
            "the last slot must precede the norm"


def test_a_store_without_the_last_layer_is_refused(store, tmp_path):
    features, _ = store
    with pytest.raises(ValueError, match=r"not \[3\].*including \[1, 2, 3\]"):
        write_hidden_states(features, tmp_path, LAYERS, 3)


def test_each_trainers_mask_supervises_the_tokens_selfspec_predicts():
    """selfspec and speculators' DFlash: token t is predicted; speculators' EAGLE-3: the law
    at t (over token t + 1) counts."""
    ours = torch.tensor([[0, 0, 1, 1, 0, 1]])
    assert speculators_loss_mask(ours, "eagle3").tolist() == [[0, 1, 1, 0, 1, 0]]
    assert speculators_loss_mask(ours, "dflash").tolist() == ours.tolist()
    with pytest.raises(ValueError, match="kind must be one of eagle3, dflash"):
        speculators_loss_mask(ours, "medusa")


@pytest.mark.parametrize(("train", "heldout"), [(6, 2), (1, 1), (999, 1), (7, 93), (1000, 3)])
def test_the_ratio_splits_exactly_at_the_heldout_rows(tmp_path, train, heldout):
    ratio = OfflineRows(tmp_path, train, heldout, 12, LAYERS, FINAL).train_ratio
    assert 0 < ratio < 1
    assert int((train + heldout) * ratio) == train  # speculators' split of the rows


def test_the_draft_vocabulary_is_selfspecs_of_the_training_rows(store, tmp_path):
    features, rows = store
    d2t, t2d = (np.load(p) for p in write_draft_vocab(features, tmp_path, 64, 24, 5))
    ours = draft_vocabulary(rows.tokens[:5], 64, 24, rows.loss_mask[:5])
    assert d2t.tolist() == ours.d2t.tolist() and t2d.tolist() == ours.t2d.tolist()
    kept = np.arange(24) + d2t  # speculators' rule: target id = draft id + d2t
    assert t2d[kept].all() and t2d.sum() == 24
