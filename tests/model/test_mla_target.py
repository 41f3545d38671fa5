"""DeepSeek-V3 as configuration of the one decoder: multi-head latent attention (a compressed
latent and one roped key cached per token, both low-rank products, interleaved RoPE, YaRN
scaling the softmax), sigmoid routing over groups with a correction bias, a routed scaling
factor and shared experts, its first layer dense. Loaded from a folder transformers'
DeepseekV3ForCausalLM saved, in parity with it (logits, cached steps, a tree over the latent
cache and its commit, greedy), written back; its NextN modules (latent attention and experts
too) load and draft losslessly."""

import copy
import dataclasses

import pytest
import torch
from helpers import adam_fit, continuation_rows, random_preset, tiny_model

from selfspec import generate
from selfspec.drafters.mtp import MtpDrafter
from selfspec.heads.base import LossOutput
from selfspec.model import ModelConfig, Transformer
from selfspec.model.loading import with_random_mtp
from selfspec.model.mla import LatentAttention
from selfspec.model.moe import grouped_sigmoid_routing
from selfspec.tree import Tree

transformers = pytest.importorskip("transformers", reason="pip install transformers")
pytest.importorskip("transformers.models.deepseek_v3", reason="pip install 'transformers>=5'")

TOKENS = torch.tensor([[3, 17, 42, 8, 8, 21, 5, 60, 33, 9, 12, 30, 31, 32]])
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def hf_deepseek(seed: int = 0):
    """A tiny random DeepseekV3ForCausalLM (fp32, 3 layers), its correction biases drawn too
    (they start at 0)."""
    model = tiny_model("deepseek_v3", seed, layers=3)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(ours loaded from the folder transformers saved, transformers' model)."""
    hf = hf_deepseek()
    folder = tmp_path_factory.mktemp("deepseek_v3")
    hf.save_pretrained(folder)
    return Transformer.from_pretrained(folder), hf


@torch.no_grad()
def test_a_saved_folder_loads_with_transformers_logits(deepseek):
    ours, hf = deepseek
    config = ours.config
    assert (config.kv_lora_rank, config.q_lora_rank, config.head_dim, config.v_head_dim) == \
        (16, 12, 8, 6)
    assert config.rope_interleave and config.rope_scaling["mscale_all_dim"] == 0.8
    assert config.moe_layers == {1, 2} and config.router_scoring == "sigmoid"
    assert (config.router_groups, config.router_top_groups, config.routed_scaling_factor) == \
        (4, 2, 2.5)
    assert config.shared_expert_intermediate_size == 32 and config.mtp_modules == 0
    expected = hf(TOKENS).logits
    got = ours(TOKENS, torch.arange(TOKENS.shape[1])).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.5  # a wrong weight would be far off


@torch.no_grad()
def test_the_cache_holds_the_latent_and_the_roped_key_and_steps_as_the_full_forward(deepseek):
    """Per token and layer: one roped key (head_dim) and one latent (kv_lora_rank), not K/V
    per head; a prefill, one-token steps and a four-token step give the full forward's
    logits."""
    ours, hf = deepseek
    cache = ours.new_cache(max_slots=32)
    assert cache.k.shape == (3, 1, 1, 32, 8) and cache.v.shape == (3, 1, 1, 32, 16)
    steps = [ours(TOKENS[:, :4], torch.arange(4), cache).logits[0]]
    for i in range(4, 8):
        steps.append(ours(TOKENS[:, i:i + 1], torch.tensor([i]), cache).logits[0])
    steps.append(ours(TOKENS[:, 8:], torch.arange(8, 14), cache).logits[0])
    torch.testing.assert_close(torch.cat(steps), hf(TOKENS).logits[0], atol=1e-4, rtol=1e-4)
    assert cache.length == 14


@torch.no_grad()
def test_a_tree_over_the_latent_cache_and_its_commit(deepseek):
    """Each node of a tree forward has transformers' logits for the prompt and its path; the
    commit of one path leaves the latent cache of a plain forward over it, and the next step
    continues as that one does."""
    ours, hf = deepseek
    prompt, tree_tokens = TOKENS[:, :6], TOKENS[0, 6:6 + TREE.num_nodes + 1]
    cache = ours.new_cache(max_slots=32)
    ours(prompt, torch.arange(6), cache)
    out = ours(tree_tokens[None], 6 + TREE.positions_with_root, cache,
               mask=TREE.mask_with_root).logits[0]
    for node in range(-1, TREE.num_nodes):
        path = [0] + [i + 1 for i in TREE.path_to(node)]
        seq = torch.cat([prompt[0], tree_tokens[path]])[None]
        torch.testing.assert_close(out[node + 1], hf(seq).logits[0, -1], atol=1e-4, rtol=1e-4)
    path = [0] + [i + 1 for i in TREE.path_to(5)]  # root, node 0, node 2, node 5
    cache.commit(6 + torch.tensor(path))
    reference = ours.new_cache(max_slots=32)
    ours(torch.cat([prompt[0], tree_tokens[path]])[None], torch.arange(10), reference)
    torch.testing.assert_close(cache.k[:, :, :, :10], reference.k[:, :, :, :10])
    torch.testing.assert_close(cache.v[:, :, :, :10], reference.v[:, :, :, :10])
    step = torch.tensor([[7, 7]])
    torch.testing.assert_close(ours(step, torch.arange(10, 12), cache).logits,
                               ours(step, torch.arange(10, 12), reference).logits)


@torch.no_grad()
def test_a_commit_that_leaves_the_latents_behind_is_caught(deepseek, monkeypatch):
    """A planted bug: commit moves the roped keys of the accepted path but not their latents;
    the step after the commit then attends to a rejected node's latent and its logits part
    from a plain forward's over the path."""
    from selfspec.model.kv_cache import KVCache

    def keys_only(cache, accepted_slots):
        slots = torch.as_tensor(accepted_slots)
        start = int(slots[0])
        cache.k[:, :, :, start:start + len(slots)] = cache.k.index_select(3, slots)
        cache.length = start + len(slots)

    ours, _ = deepseek
    prompt, tree_tokens = TOKENS[:, :6], TOKENS[0, 6:6 + TREE.num_nodes + 1]
    path = [0] + [i + 1 for i in TREE.path_to(5)]  # node 5 sits past its siblings' slots
    cache = ours.new_cache(max_slots=32)
    ours(prompt, torch.arange(6), cache)
    ours(tree_tokens[None], 6 + TREE.positions_with_root, cache, mask=TREE.mask_with_root)
    monkeypatch.setattr(KVCache, "commit", keys_only)
    cache.commit(6 + torch.tensor(path))
    seq = torch.cat([prompt[0], tree_tokens[path], torch.tensor([7])])[None]
    got = ours(seq[:, 10:], torch.tensor([10]), cache).logits[0, -1]
    assert (got - ours(seq, torch.arange(11)).logits[0, -1]).abs().max() > 1e-2


@pytest.mark.slow
@torch.no_grad()
def test_greedy_decoding_matches_transformers_generate(deepseek):
    ours, hf = deepseek
    prompt = TOKENS[0, :5].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           pad_token_id=1, eos_token_id=None)[0, 5:].tolist()
    assert generate(ours, prompt, max_new_tokens=12).tokens == expected


@pytest.mark.slow
def test_the_config_round_trips_and_transformers_reads_our_folder(deepseek, tmp_path):
    ours, hf = deepseek
    written = ours.config.to_hf()
    assert (written["first_k_dense_replace"], written["n_shared_experts"]) == (1, 2)
    assert ModelConfig.from_hf(written) == ours.config
    folder = ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits)


def test_routing_chooses_within_the_best_groups_and_weighs_by_the_plain_sigmoid():
    """Four experts in two groups, top 2 from the best group: the second best score (expert
    3, with its bias) lies in the weaker group (its two best sum lower) and is passed over;
    the weights are the chosen experts' sigmoids without the bias, renormalised, scaled."""
    logits = torch.tensor([[1.0, 0.5, -3.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.4])
    routing = grouped_sigmoid_routing(torch.sigmoid(logits), bias, top_k=2, groups=2, top_groups=1,
                                      renormalise=True, scale=2.5)
    assert sorted(routing.experts[0].tolist()) == [0, 1]
    chosen = torch.sigmoid(torch.tensor([1.0, 0.5]))
    expected = 2.5 * chosen / chosen.sum()
    torch.testing.assert_close(routing.weights[0].sort(descending=True).values, expected)


def test_deepseeks_published_fp8_weights_are_refused_naming_the_dequantizing_config(deepseek):
    ours, _ = deepseek
    published = ours.config.to_hf() | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    with pytest.raises(ValueError, match=r"\(fp8\).*FineGrainedFP8Config\(dequantize=True\)"):
        ModelConfig.from_hf(published)


def test_a_refused_latent_config_names_the_problem():
    with pytest.raises(ValueError, match="v_head_dim"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4, model_type="deepseek_v3",
                    kv_lora_rank=4)
    with pytest.raises(ValueError, match="cannot express"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4, kv_lora_rank=4,
                    v_head_dim=4).to_hf()


@pytest.fixture(scope="module")
def with_nextn(deepseek, tmp_path_factory):
    """The target with one random NextN module (as DeepSeek-V3's checkpoints ship it: a
    latent-attention block with experts, after the last layer), written and read back."""
    ours, _ = deepseek
    target = with_random_mtp(Transformer.from_hf(deepseek[1]), dataclasses.replace(
        ours.config, mtp_modules=1, mtp_layout="nextn"), seed=2)
    folder = target.save_pretrained(tmp_path_factory.mktemp("nextn"))
    return target, Transformer.from_pretrained(folder)


@torch.no_grad()
def test_a_folder_with_nextn_layers_loads_its_modules(with_nextn):
    written, loaded = with_nextn
    assert (loaded.config.mtp_modules, loaded.config.mtp_layout) == (1, "nextn")
    block = loaded.mtp[0].block
    assert isinstance(block.self_attn, LatentAttention) and hasattr(block.mlp, "shared_experts")
    hidden, embeds = torch.randn(1, 5, 32), written.embed_tokens(TOKENS[:, 1:6])
    expected = written.mtp_logits(0, written.mtp_forward(0, embeds, hidden, torch.arange(5)))
    torch.testing.assert_close(
        loaded.mtp_logits(0, loaded.mtp_forward(0, embeds, hidden, torch.arange(5))), expected)


@pytest.mark.parametrize("shape", [{"tree": Tree.chain(3)},
                                   {"total_tokens": 6, "depth": 3, "top_k": 2}],
                         ids=["chain", "tree"])
def test_its_nextn_module_drafts_losslessly(with_nextn, shape):
    """Greedy through the module's chain and its EAGLE-2 tree (its own latent cache) equals
    plain greedy, drafts rejected and accepted along the way."""
    _, target = with_nextn
    prompt = TOKENS[0, :6].tolist()
    result = generate(target, prompt, drafter=MtpDrafter(target, **shape), max_new_tokens=12)
    assert result.tokens == generate(target, prompt, max_new_tokens=12).tokens
    assert result.stats.drafted > result.stats.accepted


PROMPTS = [TOKENS[0, :6].tolist(), [5, 6, 7, 5, 6, 7]]


@pytest.mark.slow
def test_its_nextn_module_fit_to_the_targets_answers_drafts_accepted_tokens(with_nextn):
    """The module fit (AdamW, full batch) to predict the target's own greedy continuations
    one token ahead: its drafts are accepted, in chains and trees, eager and static, and a
    batch decodes each row as alone."""
    target = copy.deepcopy(with_nextn[1])  # the fixture's stays untrained
    plain = [generate(target, p, max_new_tokens=16).tokens for p in PROMPTS]
    tokens, mask = continuation_rows(dict(zip(map(tuple, PROMPTS), plain, strict=True)))
    with torch.no_grad():
        hidden = target(tokens, torch.arange(tokens.shape[1])).last_hidden

    def loss() -> LossOutput:
        rows = tokens.shape[1] - 1
        out = target.mtp_forward(0, target.embed_tokens(tokens[:, 1:]), hidden[:, :rows],
                                 torch.arange(rows))
        labels = tokens[:, 2:].masked_fill(~mask[:, 2:], -100)
        logits = target.mtp_logits(0, out[:, :-1])
        return LossOutput(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                            labels.flatten()), {})

    target.requires_grad_(False)
    target.mtp.requires_grad_(True)
    adam_fit(loss, target.mtp.parameters(), steps=40)
    target.requires_grad_(False)
    for shape in ({"tree": Tree.chain(3)}, {"total_tokens": 6, "depth": 3, "top_k": 2}):
        for static in (False, True):
            for prompt, expected in zip(PROMPTS, plain, strict=True):
                result = generate(target, prompt, drafter=MtpDrafter(target, **shape),
                                  max_new_tokens=16, cuda_graphs=static)
                assert result.tokens == expected and result.stats.accepted > 0
    batch = generate(target, PROMPTS, drafter=MtpDrafter(target, tree=Tree.chain(3)),
                     max_new_tokens=16)
    assert [r.tokens for r in batch] == plain


def test_the_random_preset_is_a_latent_moe_with_a_nextn_module():
    config = random_preset("random-deepseek-v3", weights=False).config
    assert config.latent and config.cache_dims == (1, 8, 32)
    assert config.moe_layers == {1, 2} and (config.mtp_modules, config.mtp_layout) == (1, "nextn")
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.slow  # transformers builds the decoder
def test_the_random_preset_loads_and_its_nextn_module_drafts_losslessly():
    from selfspec.model.loading import load

    target = load(random_preset("random-deepseek-v3", weights=True))
    prompt = [5, 6, 7, 5, 6, 7]
    drafted = generate(target, prompt, drafter=MtpDrafter(target, tree=Tree.chain(2)),
                       max_new_tokens=16)
    assert drafted.tokens == generate(target, prompt, max_new_tokens=16).tokens
    assert drafted.stats.drafted > 0
