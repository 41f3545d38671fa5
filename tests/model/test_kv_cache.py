import pytest
import torch

from selfspec.model import ModelConfig, Transformer
from selfspec.model.kv_cache import BatchRows, KVCache

LAYERS, HEADS, DIM = 2, 2, 4


def _cache(max_slots: int = 8, batch: int = 1) -> KVCache:
    return KVCache(LAYERS, batch, HEADS, max_slots, DIM)


def _fill(cache: KVCache, t: int) -> torch.Tensor:
    """Write t slots whose values encode their slot index; returns them [L, 1, H, t, D]."""
    values = torch.arange(cache.length, cache.length + t, dtype=torch.float32)
    values = values.view(1, 1, 1, t, 1).expand(LAYERS, 1, HEADS, t, DIM)
    for layer in range(LAYERS):
        cache.write(layer, values[layer], -values[layer])
    cache.advance(t)
    return values


def _slot_ids(cache: KVCache) -> list[int]:
    return cache.k[0, 0, 0, : cache.length, 0].long().tolist()


def test_write_returns_views_up_to_new_tokens_and_advance_is_separate():
    cache = _cache()
    _fill(cache, 3)
    new = torch.full((1, HEADS, 2, DIM), 7.0)
    k_all, v_all = cache.write(0, new, -new)
    assert cache.length == 3
    assert k_all.shape == (1, HEADS, 5, DIM) and v_all.shape == (1, HEADS, 5, DIM)
    assert k_all[0, 0, :, 0].tolist() == [0, 1, 2, 7, 7]
    assert k_all.data_ptr() == cache.k.data_ptr()  # a view, no copy
    cache.advance(2)
    assert cache.length == 5


def test_truncate_rolls_back_and_validates():
    cache = _cache()
    _fill(cache, 5)
    cache.truncate(2)
    assert cache.length == 2
    _fill(cache, 1)
    assert _slot_ids(cache) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        cache.truncate(4)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    cache.reset()
    assert cache.length == 0


def test_commit_compacts_accepted_slots_in_every_layer():
    cache = _cache(max_slots=10)
    _fill(cache, 8)
    cache.commit(torch.tensor([3, 5, 7]))
    assert cache.length == 6
    assert _slot_ids(cache) == [0, 1, 2, 3, 5, 7]
    assert torch.equal(cache.k[:, :, :, :6], -cache.v[:, :, :, :6])
    assert torch.equal(cache.k[1, 0, 1, :6, 0], torch.tensor([0.0, 1, 2, 3, 5, 7]))


def test_commit_of_contiguous_slots_is_a_truncate():
    cache = _cache()
    _fill(cache, 6)
    cache.commit([2, 3])
    assert cache.length == 4 and _slot_ids(cache) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "slots, message",
    [
        ([3, 2], "increasing"),
        ([1, 1], "increasing"),
        ([2, 6], r"\[0, 6\)"),
        ([-1], r"\[0, 6\)"),
        ([], "non-empty"),
    ],
)
def test_commit_rejects_bad_slots(slots, message):
    cache = _cache()
    _fill(cache, 6)
    with pytest.raises(ValueError, match=message):
        cache.commit(torch.tensor(slots, dtype=torch.long))
    assert cache.length == 6


def test_overflow_says_how_many_slots_are_needed():
    cache = _cache(max_slots=4)
    _fill(cache, 3)
    with pytest.raises(ValueError, match=r"5 slots needed.*max_slots is 4"):
        cache.write(0, torch.zeros(1, HEADS, 2, DIM), torch.zeros(1, HEADS, 2, DIM))
    with pytest.raises(ValueError, match="max_slots"):
        cache.advance(2)
    assert cache.length == 3


def test_write_rejects_wrong_shape():
    with pytest.raises(ValueError, match="shape"):
        _cache().write(0, torch.zeros(1, HEADS + 1, 1, DIM), torch.zeros(1, HEADS + 1, 1, DIM))


# ---- with a model: rolling back a linear draft ---------------------------------------------


def _tiny_model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return Transformer(config).eval()


@torch.no_grad()
def test_truncate_after_rejected_draft_matches_never_drafting():
    model = _tiny_model()
    prompt, draft, fix = torch.randint(50, (1, 6)), torch.randint(50, (1, 4)), torch.tensor([[7]])
    cache = model.new_cache(max_slots=16)
    model(prompt, torch.arange(6), cache)
    model(draft, torch.arange(6, 10), cache)
    cache.truncate(8)  # keep 2 of the 4 drafted tokens
    out = model(fix, torch.arange(8, 9), cache)
    reference = model(torch.cat([prompt, draft[:, :2], fix], 1), torch.arange(9))
    torch.testing.assert_close(out.logits[:, -1], reference.logits[:, -1], atol=1e-5, rtol=0)


def test_packing_a_batch_moves_the_unfinished_rows_first_and_their_views_follow():
    cache = KVCache(2, 4, 1, 8, 2)
    batch = BatchRows(cache, 4)
    for b, view in enumerate(batch.views):  # row b: b + 1 slots of value b
        view.k[:, :, :, : b + 1] = float(b)
        view.length = b + 1
    batch.pack([1, 3])  # rows 0 and 2 finished
    assert batch.views[1].k.data_ptr() == cache.k[:, 0:1].data_ptr()
    assert batch.views[3].k.data_ptr() == cache.k[:, 1:2].data_ptr()
    first = batch.first(2)
    assert first.k.shape[1] == 2
    assert (first.k[:, 0, :, :2] == 1).all() and (first.k[:, 1, :, :4] == 3).all()
    batch.pack([3])  # row 1 finished too
    assert batch.views[3].k.data_ptr() == cache.k[:, 0:1].data_ptr()
    assert (batch.views[3].k[..., :4, :] == 3).all() and batch.views[3].length == 4
