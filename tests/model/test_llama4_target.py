"""Llama 4's text decoder as configuration of the one decoder: RoPE over adjacent pairs,
chunked local attention on the RoPE layers, a NoPE layer (full attention, its queries'
temperature tuned by position), L2 q/k norms, a mixture of experts weighing each expert's
input beside a shared expert, dense layers between the sparse ones. Loaded from a folder
transformers' Llama4ForCausalLM saved, in parity with it (logits past several chunks, cached
steps, a tree across a chunk's end and its commit, greedy), written back."""

import pytest
import torch
from helpers import WINDOW, random_preset, tiny_model

from selfspec import generate
from selfspec.model import ModelConfig, Transformer
from selfspec.tree import Tree

transformers = pytest.importorskip("transformers", reason="pip install transformers")
pytest.importorskip("transformers.models.llama4", reason="pip install 'transformers>=5'")

TOKENS = torch.tensor([[3, 17, 42, 8, 8, 21, 5, 60, 33, 9, 12, 30, 31, 32]])
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # positions 6-9


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(ours loaded from the folder transformers saved, transformers' model)."""
    hf = tiny_model("llama4", 0, layers=4)
    folder = tmp_path_factory.mktemp("llama4")
    hf.save_pretrained(folder)
    return Transformer.from_pretrained(folder), hf


@torch.no_grad()
def test_a_saved_folder_loads_with_transformers_logits(llama4):
    ours, hf = llama4
    config = ours.config
    assert config.chunked_layers == {0, 1, 2} and config.attention_chunk_size == WINDOW
    assert config.no_rope_layers == (3,) and config.temperature_tuning
    assert (config.qk_norm, config.rope_interleave, config.router_scoring) == \
        ("l2", True, "sigmoid_input")
    assert config.moe_layers == {1, 3} and config.intermediate_size == 64
    assert (config.expert_width, config.shared_expert_intermediate_size) == (16, 16)
    expected = hf(TOKENS).logits
    got = ours(TOKENS, torch.arange(TOKENS.shape[1])).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.5  # a wrong weight would be far off


@torch.no_grad()
def test_cached_steps_give_the_full_forwards_logits(llama4):
    """A prefill, one-token steps across chunk ends and a six-token step."""
    ours, hf = llama4
    cache = ours.new_cache(max_slots=32)
    steps = [ours(TOKENS[:, :3], torch.arange(3), cache).logits[0]]
    for i in range(3, 8):
        steps.append(ours(TOKENS[:, i:i + 1], torch.tensor([i]), cache).logits[0])
    steps.append(ours(TOKENS[:, 8:], torch.arange(8, 14), cache).logits[0])
    torch.testing.assert_close(torch.cat(steps), hf(TOKENS).logits[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_tree_across_a_chunks_end_and_its_commit(llama4):
    """Each node of a tree (positions 6 to 9: its deeper nodes in the next chunk, seeing
    only the ancestors there) has transformers' logits for the prompt and its path; a commit
    of one path continues as a plain forward over it."""
    ours, hf = llama4
    prompt, tree_tokens = TOKENS[:, :6], TOKENS[0, 6:6 + TREE.num_nodes + 1]
    cache = ours.new_cache(max_slots=32)
    ours(prompt, torch.arange(6), cache)
    out = ours(tree_tokens[None], 6 + TREE.positions_with_root, cache,
               mask=TREE.mask_with_root).logits[0]
    for node in range(-1, TREE.num_nodes):
        path = [0] + [i + 1 for i in TREE.path_to(node)]
        seq = torch.cat([prompt[0], tree_tokens[path]])[None]
        torch.testing.assert_close(out[node + 1], hf(seq).logits[0, -1], atol=1e-4, rtol=1e-4)
    path = [0] + [i + 1 for i in TREE.path_to(5)]
    cache.commit(6 + torch.tensor(path))
    seq = torch.cat([prompt[0], tree_tokens[path], torch.tensor([7, 7])])[None]
    torch.testing.assert_close(ours(seq[:, 10:], torch.arange(10, 12), cache).logits[0],
                               hf(seq).logits[0, 10:], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@torch.no_grad()
def test_greedy_decoding_matches_transformers_generate(llama4):
    ours, hf = llama4
    prompt = TOKENS[0, :5].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           pad_token_id=1, eos_token_id=None)[0, 5:].tolist()
    assert generate(ours, prompt, max_new_tokens=16).tokens == expected


@pytest.mark.slow
def test_the_config_round_trips_and_transformers_reads_our_folder(llama4, tmp_path):
    ours, hf = llama4
    written = ours.config.to_hf()
    assert written["no_rope_layers"] == [1, 1, 1, 0] and written["moe_layers"] == [1, 3]
    assert ModelConfig.from_hf(written) == ours.config
    folder = ours.save_pretrained(tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits)


@torch.no_grad()
def test_the_static_dispatch_weighs_each_experts_input_as_the_eager_one():
    """Both dispatches of a Llama 4 block (gathered experts for few tokens, every expert for
    many) equal the eager one, which weighs the input; weighing the output is told apart."""
    ours = Transformer.from_hf(tiny_model("llama4", 1, layers=2))
    block = ours.layers[1].mlp
    for tokens in (1, 6):
        x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
        routing = block.route(x)
        eager = block.eager_dispatch(x, routing)
        torch.testing.assert_close(block.static_dispatch(x, routing), eager)
        block.weighs_input = False
        assert (block.eager_dispatch(x, routing) - eager).abs().max() > 1e-3
        block.weighs_input = True


def test_a_rope_less_layer_must_attend_in_full():
    with pytest.raises(ValueError, match="no_rope_layers"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                    num_heads=2, num_kv_heads=2, head_dim=4, model_type="llama4_text",
                    layer_types=("chunked_attention",) * 2, attention_chunk_size=4,
                    no_rope_layers=(1,))


def test_the_random_preset_is_llama4_shaped():
    config = random_preset("random-llama4", weights=False).config
    assert config.chunked_layers == {0, 1, 2} and config.no_rope_layers == (3,)
    assert config.moe_layers == {1, 3} and config.router_scoring == "sigmoid_input"
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.slow  # transformers builds the decoder
def test_the_random_preset_loads_and_decodes_losslessly_through_a_lookup():
    from selfspec.drafters import NgramDrafter
    from selfspec.model.loading import load

    target = load(random_preset("random-llama4", weights=True))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # past a chunk of 8
    drafted = generate(target, prompt, drafter=NgramDrafter(3), max_new_tokens=16)
    assert drafted.tokens == generate(target, prompt, max_new_tokens=16).tokens
    assert drafted.stats.drafted > 0
