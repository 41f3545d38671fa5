"""A feature store's rows in SpecForge's offline DFlash layout (training/specforge_data.py):
one file a row, in the store's order, holding its tokens, selfspec's loss mask as it is and
the fused streams (HF's hidden_states, concatenated in the order asked); a store without a
stream is refused before anything is written. SpecForge's own trainer on such rows is checked
in tests/peers/test_specforge_training.py."""

import pytest
import torch
from helpers import tiny_llama, train_and_heldout_store

from selfspec import Transformer
from selfspec.training.specforge_data import write_specforge_dflash_rows

LAYERS = (3, 1)  # a draft's order need not be the store's


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0, layers=4).eval()


@pytest.fixture(scope="module")
def store(hf_target, tmp_path_factory):
    target = Transformer.from_hf(hf_target).eval()
    return train_and_heldout_store(target, tmp_path_factory.mktemp("store"), (1, 3))


@pytest.mark.parametrize("held_out", [False, True])
def test_each_row_holds_its_tokens_mask_and_streams_in_the_order_asked(hf_target, store,
                                                                      tmp_path, held_out):
    features, rows = store
    written = write_specforge_dflash_rows(features, tmp_path, LAYERS, held_out=held_out)
    first = 6 if held_out else 0
    assert written == (2 if held_out else 6)
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == written
    for i, path in enumerate(files):
        row = torch.load(path)
        tokens = rows.tokens[first + i]
        assert torch.equal(row["input_ids"], tokens)
        assert torch.equal(row["loss_mask"], rows.loss_mask[first + i])
        with torch.no_grad():
            hf = hf_target(tokens[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hf[layer][0] for layer in LAYERS], dim=-1)  # [T, 2 H]
        assert row["hidden_states"].dtype == torch.float32
        torch.testing.assert_close(row["hidden_states"], expected, atol=1e-5, rtol=1e-5)


def test_a_store_without_a_stream_is_refused(store, tmp_path):
    features, _ = store
    with pytest.raises(ValueError, match=r"not \[2\].*including \[1, 2\]"):
        write_specforge_dflash_rows(features, tmp_path / "rows", (1, 2))
    assert not (tmp_path / "rows").exists()
