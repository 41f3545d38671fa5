"""The decoder (model/transformer.py): parity with transformers, cache, tree mask, exits, errors."""

import dataclasses

import pytest
import torch
from helpers import WINDOW, assert_hf_parity, hf_logits, hf_model, tiny_llama, tiny_model

from selfspec.model import MLP, ModelConfig, Rope, Transformer
from selfspec.tree import Tree

VOCAB = 64


# ---- parity with transformers ----------------------------------------------------------------


def test_llama3_rope_scaling_matters_at_tested_positions():
    hf = hf_model("llama3")
    ours = Transformer.from_hf(hf).eval()
    assert ours.config.num_kv_heads == 2 and ours.config.rope_scaling["rope_type"] == "llama3"
    tokens = assert_hf_parity(ours, hf, seq_len=100)
    ours.ropes["full"] = Rope.of(dataclasses.replace(ours.config, rope_scaling=None))
    with torch.no_grad():
        unscaled = ours(tokens, torch.arange(100)).logits
    assert (unscaled - hf_logits(hf, tokens)).abs().max() > 1e-2


def test_qwen2_has_qkv_bias_and_tied_head():
    ours = Transformer.from_hf(hf_model("qwen2"))
    attn = ours.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    assert ours.lm_head.weight is ours.embed_tokens.weight


# ---- every family, against transformers -----------------------------------------------------

ALL_FAMILIES = ("llama", "qwen3", "gemma3", "gemma2", "olmo2", "granite", "phi3", "qwen3_moe",
                "mixtral", "gpt_oss")
SLIDING = ("gemma3", "gemma2", "gpt_oss")  # a window of WINDOW tokens on their even layers
MOE = ("qwen3_moe", "mixtral", "gpt_oss")
LONGROPE_FROM = 16  # tiny Phi-3's original context: LongRoPE's long factors from there on


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def pair(request):
    """(family, transformers' random tiny model of it, ours converted from it)."""
    hf = tiny_model(request.param, 0)
    return request.param, hf, Transformer.from_hf(hf).eval()


def test_every_family_reads_what_sets_it_apart(pair):
    family, hf, ours = pair
    c = ours.config
    assert c.model_type == hf.config.model_type
    assert bool(c.sliding_layers) == (family in (*SLIDING, "mixtral"))
    if family in SLIDING:
        assert c.sliding_window == WINDOW and c.sliding_layers == {0}
    if family.startswith("gemma"):
        assert c.embedding_multiplier == c.hidden_size ** 0.5 and c.tie_word_embeddings
        assert c.attention_scale == 12 ** -0.5 and c.norm_scale == "one_plus_weight"
        assert ours.layers[0].post_feedforward_layernorm.weight.shape == (c.hidden_size,)
    assert (c.qk_norm, c.head_dim) == {
        "qwen3": ("head", 16), "gemma3": ("head", 16), "olmo2": ("projection", 8),
        "qwen3_moe": ("head", 16)}.get(family, (None, c.head_dim))
    assert (c.num_experts, c.num_experts_per_tok) == ((8, 2) if family in MOE else (0, 0))
    assert c.moe_layers == {"qwen3_moe": {1}, "mixtral": {0, 1}, "gpt_oss": {0, 1}}.get(
        family, set())
    if family == "mixtral":
        assert c.sliding_layers == {0, 1}
    if family == "qwen3_moe":
        assert isinstance(ours.layers[0].mlp, MLP) and c.expert_width == 16
    if family == "gpt_oss":
        assert c.attention_sinks and c.router_bias and c.expert_bias and c.attention_out_bias
        assert c.rope_scaling["rope_type"] == "yarn" and c.expert_act == "clamped_swiglu"
        assert ours.layers[1].self_attn.sinks.shape == (4,)
    if family == "gemma3":
        assert (c.local_rope_theta, c.rope_theta, c.rope_scaling["rope_type"]) == \
            (1e4, 1e6, "linear")
    if family == "phi3":
        assert c.rotary_dim == 4 and c.rope_scaling["rope_type"] == "longrope"


@torch.no_grad()
def test_every_family_gives_transformers_logits(pair):
    """A prefill longer than the window (Phi-3: within its original context, where
    transformers' LongRoPE uses the short factors for every row)."""
    family, hf, ours = pair
    seq = LONGROPE_FROM if family == "phi3" else 24
    assert_hf_parity(ours, hf, seq_len=seq)


@torch.no_grad()
def test_every_family_steps_one_token_as_transformers_does_with_its_cache(pair):
    """One-token steps over our cache against transformers' own cached steps, far past the
    window (and past Phi-3's original context)."""
    family, hf, ours = pair
    from transformers import DynamicCache

    tokens = torch.randint(64, (1, 26), generator=torch.Generator().manual_seed(3))
    cache, theirs = ours.new_cache(max_slots=26), DynamicCache(config=hf.config)
    got = [ours(tokens[:, :6], torch.arange(6), cache).logits[:, -1]]
    expected = [hf(input_ids=tokens[:, :6], cache=theirs, use_cache=True).logits[:, -1]]
    for t in range(6, 26):
        got.append(ours(tokens[:, t:t + 1], torch.tensor([t]), cache).logits[:, -1])
        expected.append(hf(input_ids=tokens[:, t:t + 1], cache=theirs,
                           use_cache=True).logits[:, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected).float(), atol=1e-4,
                               rtol=1e-4)


WIDE_TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0],
                             [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])  # deeper than the window


@torch.no_grad()
def test_every_family_verifies_a_tree_as_plain_forwards_along_each_path(pair):
    """A tree forward after a prompt longer than the window: each node's logits are those of
    transformers' plain forward of the prompt and its path (a node sees its ancestors and
    the committed tokens within its own window, counted by position)."""
    family, hf, ours = pair
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(64, (1, 9), generator=g)
    tree_tokens = torch.randint(64, (WIDE_TREE.num_nodes + 1,), generator=g)
    cache = ours.new_cache(max_slots=32)
    ours(prompt, torch.arange(9), cache)
    out = ours(tree_tokens[None], 9 + WIDE_TREE.positions_with_root, cache,
               mask=WIDE_TREE.mask_with_root).logits[0]
    for node in range(-1, WIDE_TREE.num_nodes):
        path = [0] + [i + 1 for i in WIDE_TREE.path_to(node)]
        seq = torch.cat([prompt[0], tree_tokens[path]])[None]
        expected = hf_logits(hf, seq)[0, -1] if seq.shape[1] <= LONGROPE_FROM or \
            family != "phi3" else ours(seq, torch.arange(seq.shape[1])).logits[0, -1]
        torch.testing.assert_close(out[node + 1], expected, atol=1e-4, rtol=1e-4)


def test_every_family_decodes_greedily_as_transformers_generate(pair):
    """Far past the window. Phi-3 within its original context: where a generation crosses
    it, transformers' Phi-3 drops its cache and recomputes every row with the long factors,
    where our cache keeps each row as it was computed (its one-token steps past the original
    context agree with transformers': above)."""
    from selfspec import generate

    family, hf, ours = pair
    prompt, new = [5, 9, 2, 7, 7, 3, 11, 4], 8 if family == "phi3" else 20
    theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 8, dtype=torch.long),
                         max_new_tokens=new, do_sample=False, pad_token_id=1, eos_token_id=None)
    assert generate(ours, prompt, max_new_tokens=new).tokens == theirs[0, 8:].tolist()


@torch.no_grad()
def test_a_window_counts_by_position_not_by_slot(monkeypatch):
    """Sibling nodes share a position but not a slot: a node's window reaches back by its
    depth, so the last of six siblings sees as much of the prompt as the first. A window
    counted by slot (planted here) cuts the prompt short for the later siblings, and the
    test catches it."""
    import selfspec.model.transformer as decoder

    hf = tiny_model("gemma3", 0)
    ours = Transformer.from_hf(hf).eval()
    siblings = Tree.from_paths([[i] for i in range(6)])
    g = torch.Generator().manual_seed(5)
    prompt, tokens = torch.randint(64, (1, 9), generator=g), torch.randint(64, (7,), generator=g)

    def last_sibling() -> torch.Tensor:
        cache = ours.new_cache(max_slots=32)
        ours(prompt, torch.arange(9), cache)
        return ours(tokens[None], 9 + siblings.positions_with_root, cache,
                    mask=siblings.mask_with_root).logits[0, 6]

    expected = hf_logits(hf, torch.cat([prompt[0], tokens[[0, 6]]])[None])[0, -1]
    torch.testing.assert_close(last_sibling(), expected, atol=1e-4, rtol=1e-4)
    by_position = decoder.window_mask

    def by_slot(mask, positions, keys, window, t):
        slots = torch.arange(keys.shape[-1])
        return by_position(mask, slots[-t:], slots, window, t)

    monkeypatch.setattr(decoder, "window_mask", by_slot)
    assert (last_sibling() - expected).abs().max() > 1e-3


# ---- cache, tree mask, early exit ------------------------------------------------------------


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


# ---- the first layers as a draft model -------------------------------------------------------


@pytest.fixture(scope="module")
def target3() -> Transformer:
    """The 3-layer toy target draft models are cut from."""
    return Transformer.from_hf(tiny_llama(0, layers=3))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_the_first_layers_are_the_targets_early_exit(target3, layers):
    draft = target3.first_layers(layers)
    tokens = torch.tensor([[2, 3, 4, 5]])
    positions = torch.arange(tokens.shape[1])
    assert draft.config.num_layers == layers and len(draft.layers) == layers
    torch.testing.assert_close(draft(tokens, positions).logits,
                               target3(tokens, positions, exit_layer=layers).logits)
    draft.layers[0].mlp.up_proj.weight.data.zero_()  # a copy: the target is untouched
    assert target3.layers[0].mlp.up_proj.weight.abs().sum() > 0


@pytest.mark.parametrize("layers", [0, 4])
def test_impossible_cuts_are_refused(target3, layers):
    with pytest.raises(ValueError, match=r"num_layers must be in 1..3"):
        target3.first_layers(layers)


# ---- errors ----------------------------------------------------------------------------------


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


# ---- packed products -------------------------------------------------------------------------


def test_only_a_model_whose_weights_outgrow_a_cache_packs_them():
    small = _tiny_model()  # 0.1 MB
    with torch.device("meta"):  # 64k x 256 embedding and head: 128 MB in fp32
        large = Transformer(ModelConfig(vocab_size=1 << 16, hidden_size=256,
                                        intermediate_size=512, num_layers=1, num_heads=4,
                                        num_kv_heads=2, head_dim=64))
    assert not small.lm_head.packed_products and not small.layers[0].mlp.up_proj.packed_products
    assert large.lm_head.packed_products and large.layers[0].mlp.up_proj.packed_products


# ---- fused products (a compiled static step's) -----------------------------------------------


def test_fused_products_give_the_separate_ones_and_leave_the_model_as_it_was(tmp_path):
    """Qwen2's q/k/v biases fuse too; the parameters become views (same names, values, state
    dict, and a folder that saves and loads), and the fused products equal the separate
    ones."""
    from selfspec.model import fuse_projections
    from selfspec.model.transformer import EAGER_STAGES, LayerStages, attention_inputs, layer_output

    model = Transformer.from_hf(hf_model("qwen2")).eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    tokens = torch.randint(model.config.vocab_size, (1, 9))
    with torch.no_grad():
        expected = model(tokens, torch.arange(9)).logits
    assert fuse_projections(model) and fuse_projections(model)  # idempotent
    attn = model.layers[0].self_attn
    assert attn.fused.bias is not None and attn.q_proj.weight.data_ptr() == \
        attn.fused.weight.data_ptr()
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())

    def fused(function):
        return lambda *args, **kwargs: function(*args, **kwargs, fused=True)

    with torch.no_grad():
        got = model(tokens, torch.arange(9),
                    stages=LayerStages(fused(attention_inputs), fused(layer_output))).logits
        plain = model(tokens, torch.arange(9), stages=EAGER_STAGES).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(plain, expected)
    again = Transformer.from_pretrained(model.save_pretrained(tmp_path / "saved"))
    assert all(torch.equal(again.state_dict()[n], t) for n, t in before.items())


def test_a_replaced_weight_is_fused_anew():
    from selfspec.model import fuse_projections

    model = Transformer.from_hf(tiny_llama(0))
    fuse_projections(model)
    mlp = model.layers[1].mlp
    mlp.up_proj.weight = torch.nn.Parameter(torch.ones_like(mlp.up_proj.weight))
    old = mlp.fused.weight
    fuse_projections(model)
    assert mlp.fused.weight is not old
    assert torch.equal(mlp.fused.weight[mlp.gate_proj.out_features:], mlp.up_proj.weight)


def test_weights_fused_during_inference_still_train():
    """A decode (under inference_mode) that fuses must leave parameters autograd can save:
    Medusa-2 trains LoRA adapters through the target it decodes with."""
    from selfspec.model import fuse_projections

    model = Transformer.from_hf(tiny_llama(0))
    with torch.inference_mode():
        fuse_projections(model)
    assert not model.layers[0].self_attn.q_proj.weight.is_inference()
    hidden = torch.randn(1, 3, model.config.hidden_size, requires_grad=True)
    model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3),
          hidden_in=hidden).logits.sum().backward()
    assert hidden.grad is not None
