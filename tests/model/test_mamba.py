"""The Mamba-2 layer (model/mamba.py) against transformers' own BambaMixer on random weights
(fp32): a sequence, a prefill then one-token steps, and a tree's node continuing its parent."""

import pytest
import torch

from selfspec.model.kv_cache import KVCache
from selfspec.model.mamba import Mamba2Dims, Mamba2Mixer
from selfspec.model.recurrent import parents_of
from selfspec.model.recurrent_cache import HybridCache, RecurrentState

transformers = pytest.importorskip("transformers", reason="pip install transformers")
bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba",
                            reason="pip install 'transformers>=5'")

DIMS = Mamba2Dims(hidden_size=32, num_heads=4, head_dim=16, num_groups=2, state_size=8,
                  conv_kernel=4, eps=1e-5)


def layers(seed: int = 0):
    """(transformers' BambaMixer, ours with its weights), random (std 0.3), and its config."""
    config = transformers.BambaConfig(
        vocab_size=64, hidden_size=DIMS.hidden_size, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[],
        mamba_n_heads=DIMS.num_heads, mamba_d_state=DIMS.state_size,
        mamba_n_groups=DIMS.num_groups, mamba_expand=2, mamba_chunk_size=4,
        rms_norm_eps=DIMS.eps)
    torch.manual_seed(seed)
    hf = bamba.BambaMixer(config, 0).float()
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(0, 0.3)
    ours = Mamba2Mixer(DIMS)
    ours.load_state_dict(hf.state_dict())
    return hf, ours, config


def cache() -> HybridCache:
    return HybridCache(KVCache(0, 1, 1, 64, 1), RecurrentState([0], 1, DIMS), ())


def fed(layer, into: HybridCache, x, parents=None):
    out = layer(x, parents, into.recurrent(0))
    into.advance(x.shape[1])
    return out


@torch.no_grad()
def test_a_sequence_and_cached_steps_match_transformers():
    hf, ours, config = layers()
    x = torch.randn(2, 9, DIMS.hidden_size)
    torch.testing.assert_close(ours(x, None), hf(x), atol=1e-5, rtol=1e-5)
    assert hf(x).abs().max() > 0.1
    hf_cache, ours_cache = transformers.DynamicCache(config=config), cache()
    expected = [hf(x[:1, :6], cache=hf_cache)] + [hf(x[:1, i:i + 1], cache=hf_cache)
                                                 for i in range(6, 9)]
    got = [fed(ours, ours_cache, x[:1, :6])] + [fed(ours, ours_cache, x[:1, i:i + 1])
                                                for i in range(6, 9)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(expected, 1), atol=1e-5,
                               rtol=1e-5)


@torch.no_grad()
def test_each_tree_node_continues_its_parent_and_a_commit_keeps_its_state():
    _, ours, _ = layers()
    parents = [-1, 0, 0, 1, 3, 3]
    mask = torch.eye(6, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    history, rows = torch.randn(1, 5, DIMS.hidden_size), torch.randn(1, 6, DIMS.hidden_size)
    tree = cache()
    fed(ours, tree, history)
    out = fed(ours, tree, rows, parents_of(mask, 6, "cpu"))
    path = [0, 1, 3, 4]  # node 4's path
    chain = cache()
    fed(ours, chain, history)
    chain_out = fed(ours, chain, rows[:, path])
    torch.testing.assert_close(out[:, path], chain_out, atol=1e-6, rtol=1e-6)
    tree.commit([5 + i for i in path])
    torch.testing.assert_close(tree.state.states, chain.state.states)
    torch.testing.assert_close(tree.state.windows, chain.state.windows)
