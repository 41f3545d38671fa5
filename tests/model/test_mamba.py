"""The Mamba-2 layer (model/mamba.py) against transformers' own BambaMixer on random weights
(fp32): a sequence, a prefill then one-token steps, and a tree's node continuing its parent;
Bamba as a family: a folder transformers saved, in parity (logits, cached steps, greedy),
written back, and speculation on it lossless."""

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


# ---- Bamba: Mamba-2 layers with attention among them, as a family of the one decoder -----

TOKENS = torch.tensor([[3, 17, 42, 8, 8, 21, 5, 60, 33, 9, 12]])


@pytest.fixture(scope="module")
def bamba_target(tmp_path_factory):
    """(ours loaded from the folder transformers' BambaForCausalLM saved, transformers'): four
    layers, attention at layer 2, random weights (norms around 1)."""
    from selfspec.model import Transformer

    config = transformers.BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[2],
        mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2,
        mamba_chunk_size=4, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    folder = tmp_path_factory.mktemp("bamba")
    hf.save_pretrained(folder)
    return Transformer.from_pretrained(folder), hf


@torch.no_grad()
def test_a_bamba_folder_loads_with_transformers_logits_and_cached_steps(bamba_target):
    ours, hf = bamba_target
    assert ours.config.linear_layers == {0, 1, 3} and ours.config.recurrent_mixer == "mamba2"
    expected = hf(TOKENS).logits
    torch.testing.assert_close(ours(TOKENS, torch.arange(11)).logits, expected, atol=1e-4,
                               rtol=1e-4)
    assert expected.std() > 0.5
    cache = ours.new_cache(max_slots=32)
    steps = [ours(TOKENS[:, :4], torch.arange(4), cache).logits[0]]
    steps += [ours(TOKENS[:, i:i + 1], torch.tensor([i]), cache).logits[0] for i in range(4, 7)]
    steps.append(ours(TOKENS[:, 7:], torch.arange(7, 11), cache).logits[0])
    torch.testing.assert_close(torch.cat(steps), expected[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # transformers' generate and from_pretrained
@torch.no_grad()
def test_bamba_greedy_and_its_folder_round_trip(bamba_target, tmp_path):
    from selfspec import generate
    from selfspec.model import ModelConfig

    ours, hf = bamba_target
    prompt = TOKENS[0, :5].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, prompt, max_new_tokens=12).tokens == expected
    assert ModelConfig.from_hf(ours.config.to_hf()) == ours.config
    again = transformers.AutoModelForCausalLM.from_pretrained(
        ours.save_pretrained(tmp_path / "ours"), dtype=torch.float32)
    torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the decoding machinery is the hybrids' (tests/features/test_hybrid_decoding)
@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]],
                         ids=["ngram_chain", "medusa_tree"])
@torch.no_grad()
def test_speculation_on_a_bamba_target_equals_plain_greedy(bamba_target, tree):
    """Chains (n-gram lookup) and trees (random Medusa heads) verified on Mamba-2 layers,
    one prompt and a batch, with rejections in play."""
    from helpers import FAMILY_PROMPTS, random_medusa_heads

    from selfspec import generate
    from selfspec.drafters import MedusaDrafter, NgramDrafter
    from selfspec.heads import MedusaConfig

    ours, _ = bamba_target
    c = ours.config

    def make():
        if tree is None:
            return NgramDrafter(3)
        return MedusaDrafter(random_medusa_heads(MedusaConfig(c.hidden_size, c.vocab_size,
                                                              num_heads=3), seed=3), tree)

    plain = [generate(ours, p, max_new_tokens=12).tokens for p in FAMILY_PROMPTS]
    alone = [generate(ours, p, drafter=make(), max_new_tokens=12) for p in FAMILY_PROMPTS]
    assert [r.tokens for r in alone] == plain
    assert sum(r.stats.drafted - r.stats.accepted for r in alone) > 0
    batch = generate(ours, FAMILY_PROMPTS, drafter=make(), max_new_tokens=12)
    assert [r.tokens for r in batch] == plain
