import copy
import dataclasses
import json

import pytest
import torch
from helpers import tiny_llama
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from selfspec.model import Linear, ModelConfig, Transformer, rope_inv_freq, use_packed_products
from selfspec.tree import Tree

VOCAB = 64
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    attn_implementation="eager",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
HF_MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY)),
    "llama3": lambda: LlamaForCausalLM(
        LlamaConfig(
            **TINY,
            num_key_value_heads=2,
            rope_scaling=LLAMA3_ROPE,
            head_dim=16,  # != hidden / heads; wavelengths 6 (kept), 20 (blended), 63+ (scaled)
            max_position_embeddings=256,
        )
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY, num_key_value_heads=2)),
    "qwen2": lambda: Qwen2ForCausalLM(
        Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=True)
    ),
}


def _hf_model(name: str) -> torch.nn.Module:
    """A seeded tiny HF model with weights large enough that logits are far from zero."""
    torch.manual_seed(0)
    model = HF_MODELS[name]().float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.2)
    return model


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(tokens)
    return model(input_ids=tokens, attention_mask=mask).logits.float()


def _assert_parity(ours: Transformer, hf: torch.nn.Module, seq_len: int) -> torch.Tensor:
    tokens = torch.randint(VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens, torch.arange(seq_len)).logits
    expected = _hf_logits(hf, tokens)
    assert expected.abs().max() > 1.0  # a meaningful comparison, not near-zero logits
    assert (logits - expected).abs().max() < 1e-4
    return tokens


# ---- parity with transformers --------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama3", "mistral", "qwen2"])
def test_from_pretrained_matches_transformers(name, tmp_path):
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path).eval()
    assert ours.config.model_type == ("llama" if name == "llama3" else name)
    _assert_parity(ours, hf, seq_len=100 if name == "llama3" else 24)


def test_llama3_rope_scaling_matters_at_tested_positions():
    hf = _hf_model("llama3")
    ours = Transformer.from_hf(hf).eval()
    assert ours.config.num_kv_heads == 2 and ours.config.rope_scaling["rope_type"] == "llama3"
    tokens = _assert_parity(ours, hf, seq_len=100)
    ours.inv_freq = rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None))
    with torch.no_grad():
        unscaled = ours(tokens, torch.arange(100)).logits
    assert (unscaled - _hf_logits(hf, tokens)).abs().max() > 1e-2


def test_qwen2_has_qkv_bias_and_tied_head():
    ours = Transformer.from_hf(_hf_model("qwen2"))
    attn = ours.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert ours.lm_head.weight is ours.embed_tokens.weight


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("mistral")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_parity(Transformer.from_pretrained(tmp_path).eval(), hf, seq_len=16)


def test_from_pretrained_casts_dtype(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path)
    model = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]]), torch.arange(3)).logits.dtype == torch.float32


# ---- cache, tree mask, early exit ----------------------------------------------------------


def _tiny_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return Transformer(ModelConfig(**{**fields, **overrides})).eval()


@torch.no_grad()
def test_incremental_decoding_equals_full_forward():
    model = _tiny_model()
    tokens = torch.randint(VOCAB, (2, 12))
    full = model(tokens, torch.arange(12)).logits
    cache = model.new_cache(batch_size=2, max_slots=12)
    steps = [model(tokens[:, :5], torch.arange(5), cache).logits]
    for t in range(5, 12):
        steps.append(model(tokens[:, t : t + 1], torch.tensor([t]), cache).logits)
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


@torch.no_grad()
def _tree_forward(model: Transformer, prompt: torch.Tensor, tree_tokens: torch.Tensor):
    """Prefill the prompt, then one forward over [root, nodes...]; returns (logits, cache)."""
    cache = model.new_cache(max_slots=32)
    model(prompt, torch.arange(prompt.shape[1]), cache)
    positions = prompt.shape[1] + TREE.positions_with_root
    out = model(tree_tokens[None], positions, cache, mask=TREE.mask_with_root)
    return out.logits[0], cache  # [N+1, V]


@torch.no_grad()
def test_tree_masked_forward_matches_each_root_to_node_path():
    model = _tiny_model()
    prompt, tree_tokens = torch.randint(VOCAB, (1, 7)), torch.randint(VOCAB, (TREE.num_nodes + 1,))
    logits, cache = _tree_forward(model, prompt, tree_tokens)
    assert cache.length == 7 + TREE.num_nodes + 1
    for node in range(-1, TREE.num_nodes):
        path = [0] + [i + 1 for i in TREE.path_to(node)]
        seq = torch.cat([prompt[0], tree_tokens[path]])[None]
        expected = model(seq, torch.arange(seq.shape[1])).logits[0, -1]
        torch.testing.assert_close(logits[node + 1], expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_commit_accepted_path_equals_cache_of_plain_forward():
    model = _tiny_model()
    prompt, tree_tokens = torch.randint(VOCAB, (1, 7)), torch.randint(VOCAB, (TREE.num_nodes + 1,))
    _, cache = _tree_forward(model, prompt, tree_tokens)
    path = [0] + [i + 1 for i in TREE.path_to(6)]  # root, node 0, node 3, node 6
    cache.commit(7 + torch.tensor(path))
    reference = model.new_cache(max_slots=32)
    model(torch.cat([prompt[0], tree_tokens[path]])[None], torch.arange(7 + len(path)), reference)
    assert cache.length == reference.length == 11
    torch.testing.assert_close(cache.k[:, :, :, :11], reference.k[:, :, :, :11])
    torch.testing.assert_close(cache.v[:, :, :, :11], reference.v[:, :, :, :11])
    nxt = torch.tensor([[5, 9]])
    got = model(nxt, torch.arange(11, 13), cache).logits
    torch.testing.assert_close(got, model(nxt, torch.arange(11, 13), reference).logits)


@torch.no_grad()
def test_exit_layer_uses_shared_norm_and_head():
    model = _tiny_model()
    tokens = torch.randint(VOCAB, (2, 6))
    full = model(tokens, torch.arange(6), return_hidden=(0, 1, 2, 3))
    early = model(tokens, torch.arange(6), exit_layer=2, return_hidden=(2,))
    torch.testing.assert_close(early.hidden[0], full.hidden[2])
    torch.testing.assert_close(early.logits, model.lm_head(model.norm(full.hidden[2])))
    torch.testing.assert_close(full.hidden[0], model.embed_tokens(tokens))
    torch.testing.assert_close(full.last_hidden, model.norm(full.hidden[3]))


@torch.no_grad()
def test_resume_from_hidden_equals_full_forward_with_cache():
    model = _tiny_model()
    tokens = torch.randint(VOCAB, (1, 6))
    full = model(tokens, torch.arange(6)).logits
    cache = model.new_cache(max_slots=6)
    draft = model(tokens, torch.arange(6), cache, exit_layer=1, return_hidden=(1,))
    cache.truncate(0)  # the upper layer never saw these tokens; redo them all
    resumed = model(tokens, torch.arange(6), cache, start_layer=1, hidden_in=draft.hidden[0])
    torch.testing.assert_close(resumed.logits, full, atol=1e-5, rtol=0)


def test_positions_per_batch_row():
    model = _tiny_model()
    tokens = torch.randint(VOCAB, (2, 4))
    positions = torch.stack([torch.arange(4), torch.arange(10, 14)])
    with torch.no_grad():
        out = model(tokens, positions).logits
        row1 = model(tokens[1:], torch.arange(10, 14)).logits
    torch.testing.assert_close(out[1:], row1, atol=1e-5, rtol=0)


# ---- errors --------------------------------------------------------------------------------


def test_unsupported_model_type_and_rope_scaling():
    base = LlamaConfig(**TINY).to_dict()
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    legacy = {
        **base,
        "rope_parameters": None,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = ModelConfig.from_hf(legacy)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_missing_folder_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Transformer.from_pretrained(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**TINY).to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Transformer.from_pretrained(tmp_path)


@torch.no_grad()
def test_forward_overflowing_cache_raises():
    model = _tiny_model()
    cache = model.new_cache(max_slots=4)
    with pytest.raises(ValueError, match="6 slots needed"):
        model(torch.zeros(1, 6, dtype=torch.long), torch.arange(6), cache)


def test_bad_forward_arguments():
    model = _tiny_model()
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden_in"):
        model(tokens, torch.arange(3), start_layer=1)
    with pytest.raises(ValueError, match="return_hidden"):
        model(tokens, torch.arange(3), exit_layer=1, return_hidden=(2,))
    with pytest.raises(ValueError, match="mask"):
        model(tokens, torch.arange(3), mask=torch.ones(2, 2, dtype=torch.bool))


def test_a_model_read_from_a_file_computes_the_same_bits_as_the_one_saved(tmp_path):
    """Weights read from safetensors lie at odd offsets; MKL's few-row products sum in an order
    that depends on a weight's alignment, so loading realigns them (`selfspec.model.aligned`)."""
    model = Transformer.from_hf(tiny_llama(0, layers=2, hidden=64))
    model.save_pretrained(tmp_path)
    loaded = Transformer.from_pretrained(tmp_path)
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())
    tokens = torch.randint(64, (1, 16))
    for t in (1, 3, 16):
        positions = torch.arange(t)
        assert torch.equal(loaded(tokens[:, :t], positions).logits,
                           model(tokens[:, :t], positions).logits)


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 2, 48), (1, 3, 48), (3, 5, 48), (1, 8, 48),
                                   (2, 64, 48), (2, 100, 48)])
@pytest.mark.parametrize("grad", [False, True])
def test_cpu_linear_computes_what_nn_linear_does(shape, grad):
    """selfspec's Linear runs few-row CPU products its own way (one row twice, W @ x.T, from
    three rows oneDNN over a packed copy of W when no gradient is needed): the same sums as
    nn.Linear, up to float32 rounding, in the input's shape, bias included, row-major as
    F.linear's (SDPA's fused CPU kernel refuses queries whose last dimension is strided)."""
    torch.manual_seed(0)
    layer = Linear(48, 200, bias=True)
    use_packed_products(layer, True)
    x = torch.randn(*shape)
    with torch.set_grad_enabled(grad):
        out = layer(x)
    assert out.shape == (*shape[:-1], 200) and out.requires_grad == grad
    assert out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_the_packed_copy_follows_the_weight_and_is_never_copied():
    torch.manual_seed(0)
    layer = Linear(48, 200, bias=False)
    use_packed_products(layer, True)
    x = torch.randn(4, 48)
    with torch.no_grad():
        before = layer(x)
        assert layer.packed.tensor is not None  # four rows took the packed path
        layer.weight.mul_(2.0)  # changed in place (an optimizer step, load_state_dict)
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(-layer.weight)  # replaced
        torch.testing.assert_close(layer(x), -2 * before, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(layer)
        assert twin.packed.tensor is None and "packed" not in "".join(twin.state_dict())
        torch.testing.assert_close(twin(x), -2 * before, rtol=1e-5, atol=1e-5)


def test_only_a_model_whose_weights_outgrow_a_cache_packs_them():
    small = _tiny_model()  # 0.1 MB
    with torch.device("meta"):  # 64k x 256 embedding and head: 128 MB in fp32
        large = Transformer(ModelConfig(vocab_size=1 << 16, hidden_size=256,
                                        intermediate_size=512, num_layers=1, num_heads=4,
                                        num_kv_heads=2, head_dim=64))
    assert not small.lm_head.packed_products and not small.layers[0].mlp.up_proj.packed_products
    assert large.lm_head.packed_products and large.layers[0].mlp.up_proj.packed_products
