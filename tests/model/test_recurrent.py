"""The Gated DeltaNet layer (model/recurrent.py) against transformers' own
Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet on random weights (fp32), and its state per
row: a tree's node continues its parent, a cache commits the accepted row's state and
truncates back over the forwards it kept (model/recurrent_cache.py)."""

from dataclasses import replace

import pytest
import torch

from selfspec.model.kv_cache import KVCache
from selfspec.model.recurrent import DeltaNetDims, GatedDeltaNet, parents_of
from selfspec.model.recurrent_cache import HybridCache, RecurrentState

transformers = pytest.importorskip("transformers", reason="pip install transformers")
modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                               reason="pip install 'transformers>=5'")
qwen3_5_modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                                       reason="pip install 'transformers>=5.2'")

DIMS = DeltaNetDims(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                    value_head_dim=6, conv_kernel=4, eps=1e-6)


def hf_layer(seed: int = 0, qwen3_5: bool = False):
    """transformers' layer (Qwen3.5's with qwen3_5) and its config, random weights."""
    kind = transformers.Qwen3_5TextConfig if qwen3_5 else transformers.Qwen3NextConfig
    extra = {} if qwen3_5 else {"num_experts": 0}
    config = kind(
        vocab_size=64, hidden_size=DIMS.hidden_size, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        linear_num_key_heads=DIMS.num_key_heads, linear_num_value_heads=DIMS.num_value_heads,
        linear_key_head_dim=DIMS.key_head_dim, linear_value_head_dim=DIMS.value_head_dim,
        linear_conv_kernel_dim=DIMS.conv_kernel, rms_norm_eps=DIMS.eps,
        layer_types=["linear_attention"], **extra)
    torch.manual_seed(seed)
    layer = (qwen3_5_modeling.Qwen3_5GatedDeltaNet if qwen3_5
             else modeling.Qwen3NextGatedDeltaNet)(config, 0).float()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.3)
    return config, layer


def our_layer(seed: int = 0, qwen3_5: bool = False) -> GatedDeltaNet:
    _, hf = hf_layer(seed, qwen3_5)
    layer = GatedDeltaNet(replace(DIMS, split_projections=qwen3_5))
    layer.load_state_dict(hf.state_dict())
    return layer


def hybrid_cache() -> HybridCache:
    """The cache of a model whose one layer is recurrent (no attention layer: only the
    length counts on the KV side)."""
    return HybridCache(KVCache(0, 1, 1, 200, 1), RecurrentState([0], 1, DIMS),
                       attention_layers=())


def fed(layer: GatedDeltaNet, cache: HybridCache, x: torch.Tensor,
        parents: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's output over x through the cache, which then advances."""
    out = layer(x, parents, cache.recurrent(0))
    cache.advance(x.shape[1])
    return out


@pytest.mark.parametrize("qwen3_5", [False, True], ids=["qwen3_next", "qwen3_5"])
@torch.no_grad()
def test_a_sequence_matches_transformers(qwen3_5):
    _, hf = hf_layer(qwen3_5=qwen3_5)
    x = torch.randn(2, 9, DIMS.hidden_size)
    ours = our_layer(qwen3_5=qwen3_5)(x, None)
    torch.testing.assert_close(ours, hf(x), atol=1e-5, rtol=1e-5)
    assert hf(x).abs().max() > 0.1  # not a vanishing output


@torch.no_grad()
def test_cached_steps_match_transformers_cache():
    """A prefill, then one-token steps from the committed state, against transformers'
    DynamicCache (its chunked prefill and its recurrent step)."""
    config, hf = hf_layer()
    layer = our_layer()
    x = torch.randn(1, 10, DIMS.hidden_size)
    cache = transformers.DynamicCache(config=config)
    ours_cache = hybrid_cache()
    hf_out = [hf(x[:, :6], cache=cache)]
    ours = [fed(layer, ours_cache, x[:, :6])]
    for i in range(6, 10):
        hf_out.append(hf(x[:, i:i + 1], cache=cache))
        ours.append(fed(layer, ours_cache, x[:, i:i + 1]))
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(hf_out, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache.state.states[0], cache.layers[0].recurrent_states[0],
                               atol=1e-5, rtol=1e-5)


# A tree over 6 new rows: 0 the root, 1 and 2 its children, 3 under 1, 4 and 5 under 3.
PARENTS = [-1, 0, 0, 1, 3, 3]


def tree_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, node)
        node = PARENTS[node]
    return path


def test_parents_are_read_off_a_tree_mask():
    assert parents_of(tree_mask(PARENTS), 6, "cpu").tolist() == [PARENTS]
    assert parents_of(None, 3, "cpu") is None  # causal: each row continues the one before
    assert parents_of(tree_mask([-1, 0, 1]), 3, "cpu").tolist() == [[-1, 0, 1]]
    history = torch.cat([torch.ones(6, 4, dtype=torch.bool), tree_mask(PARENTS)], dim=1)
    assert parents_of(history, 6, "cpu").tolist() == [PARENTS]


@pytest.mark.parametrize("why, new_rows, mask", [
    ("a row that skips its parent's parent", 3, [[1, 0, 0], [1, 1, 0], [0, 1, 1]]),
    ("a committed slot hidden", 2, [[0, 1, 0], [1, 1, 1]]),
])
def test_a_mask_that_is_not_a_forest_of_paths_is_refused(why, new_rows, mask):
    with pytest.raises(ValueError, match="recurrent layer"):
        parents_of(torch.tensor(mask, dtype=torch.bool), new_rows, "cpu")


@torch.no_grad()
def test_each_tree_node_continues_its_parent():
    """A tree forward's row i equals a chain forward over the path to i, from the same
    committed state (its output and its state after it)."""
    layer = our_layer()
    history, rows = torch.randn(1, 5, DIMS.hidden_size), torch.randn(1, 6, DIMS.hidden_size)
    tree = hybrid_cache()
    fed(layer, tree, history)
    out = fed(layer, tree, rows, parents_of(tree_mask(PARENTS), 6, "cpu"))
    for node in range(6):
        chain = hybrid_cache()
        fed(layer, chain, history)
        path = path_to(node)
        chain_out = fed(layer, chain, rows[:, path])
        torch.testing.assert_close(out[:, node], chain_out[:, -1], atol=1e-6, rtol=1e-6)
        for name in ("states", "windows"):
            tree_snapshots = tree.state.recorded[0].snapshots
            chain_snapshots = chain.state.recorded[0].snapshots
            torch.testing.assert_close(getattr(tree_snapshots, name)[:, node + 1],
                                       getattr(chain_snapshots, name)[:, -1])


@torch.no_grad()
def test_a_commit_keeps_the_accepted_nodes_state():
    """After a tree forward, committing a path leaves the state of a forward over exactly the
    committed tokens."""
    layer = our_layer()
    history, rows = torch.randn(1, 5, DIMS.hidden_size), torch.randn(1, 6, DIMS.hidden_size)
    reference = hybrid_cache()
    fed(layer, reference, torch.cat([history, rows[:, path_to(4)]], 1))
    cache = hybrid_cache()
    fed(layer, cache, history)
    fed(layer, cache, rows, parents_of(tree_mask(PARENTS), 6, "cpu"))
    cache.commit([5 + i for i in path_to(4)])
    assert cache.length == reference.length == 9
    torch.testing.assert_close(cache.state.states, reference.state.states)
    torch.testing.assert_close(cache.state.windows, reference.state.windows)
    with pytest.raises(ValueError, match="rolls back only within the forwards kept"):
        cache.truncate(6)  # the commit moved the slots: no state of an older slot is kept


@torch.no_grad()
def test_a_truncate_reaches_back_over_the_forwards_since_the_commit(monkeypatch):
    """A prefill and one-token steps (a draft model's), rolled back into any of them, leave
    the state of a forward over the kept tokens; a long chain keeps only its two ends."""
    layer, x = our_layer(), torch.randn(1, 9, DIMS.hidden_size)

    def state_after(n: int) -> torch.Tensor:
        cache = hybrid_cache()
        fed(layer, cache, x[:, :n])
        return cache.state.states

    cache = hybrid_cache()
    fed(layer, cache, x[:, :5])
    for i in range(5, 9):
        fed(layer, cache, x[:, i:i + 1])
    for n in (7, 6, 3):
        cache.truncate(n)
        assert cache.length == n
        torch.testing.assert_close(cache.state.states, state_after(n))
    monkeypatch.setattr("selfspec.model.recurrent.MAX_SNAPSHOT_ROWS", 4)
    long = hybrid_cache()
    fed(layer, long, x[:, :2])
    fed(layer, long, x[:, 2:])  # 7 rows: only the states before and after them
    with pytest.raises(ValueError, match="keeps only the states before and after it"):
        long.truncate(5)
    long.truncate(2)
    torch.testing.assert_close(long.state.states, state_after(2))
