"""Gemma 4's decoder (`gemma4_text`) as configuration of the one decoder: parity with
transformers' `Gemma4ForCausalLM` on a tiny random model (logits, cached one-token steps,
greedy generate), folders written by either library read by the other, and the parts not
read yet refused in one line."""

import json

import pytest
import torch
from gemma4_models import gemma4_config, gemma4_model
from helpers import WINDOW

from selfspec.model import ModelConfig, Transformer

# The published models' full layers are wider than their sliding ones (global_head_dim 512
# against 256, and with keys as values their own K/V heads): here 32 against 16, one K/V head.
WIDER_FULL = {"global_head_dim": 32, "num_global_key_value_heads": 1}


@pytest.fixture(scope="module", params=["one_width", "wider_full"])
def pair(request):
    hf = gemma4_model(**(WIDER_FULL if request.param == "wider_full" else {}))
    return hf, Transformer.from_hf(hf).eval()


def test_gemma4_reads_what_sets_it_apart(pair):
    _, ours = pair
    c = ours.config
    assert (c.model_type, c.norm_scale, c.attention_scale, c.qk_norm) == \
        ("gemma4_text", "weight_fp32", 1.0, "head")
    assert c.v_norm and c.value_from_key and c.layer_scalars and c.post_norms
    assert c.sliding_layers == {0, 2} and c.sliding_window == WINDOW
    assert c.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (c.rope_theta, c.local_rope_theta, c.final_logit_softcapping) == (1e6, 1e4, 4.0)
    assert ours.layers[1].self_attn.v_proj is None and ours.layers[0].self_attn.v_proj is not None
    wide = c.full_head_dim is not None
    assert (c.full_head_dim, c.full_kv_heads) == ((32, 1) if wide else (None, None))
    assert c.cache_dims == ((2, 32, 32) if wide else (2, 16, 16))
    assert ours.layers[1].self_attn.k_proj.out_features == (32 if wide else 32)  # 1 x 32, 2 x 16
    assert ours.layers[1].self_attn.q_proj.out_features == (128 if wide else 64)
    # a quarter of the full layers' frequency pairs turn (2 of 8, or 4 of 16), the rest stay
    assert ours.ropes["full"].inv_freq.count_nonzero() == (4 if wide else 2)


@torch.no_grad()
def test_gemma4_gives_transformers_logits_past_its_window(pair):
    hf, ours = pair
    tokens = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()
    got = ours(tokens, torch.arange(24)).logits
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max() < 1e-4


@torch.no_grad()
def test_gemma4_steps_one_token_as_transformers_does_with_its_cache(pair):
    from transformers import DynamicCache

    hf, ours = pair
    tokens = torch.randint(64, (1, 16), generator=torch.Generator().manual_seed(3))
    cache, theirs = ours.new_cache(max_slots=16), DynamicCache(config=hf.config)
    got = [ours(tokens[:, :6], torch.arange(6), cache).logits[:, -1]]
    expected = [hf(input_ids=tokens[:, :6], cache=theirs, use_cache=True).logits[:, -1]]
    for t in range(6, 16):
        got.append(ours(tokens[:, t:t + 1], torch.tensor([t]), cache).logits[:, -1])
        expected.append(hf(input_ids=tokens[:, t:t + 1], cache=theirs,
                           use_cache=True).logits[:, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected).float(), atol=1e-4,
                               rtol=1e-4)


def test_gemma4_decodes_greedily_as_transformers_generate(pair):
    from selfspec import generate

    hf, ours = pair
    prompt = [5, 9, 2, 7, 7, 3, 11, 4]
    theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 8, dtype=torch.long),
                         max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    assert generate(ours, prompt, max_new_tokens=12).tokens == theirs[0, 8:].tolist()


@pytest.mark.slow
@torch.no_grad()
def test_gemma4_folders_are_read_both_ways(pair, tmp_path):
    """transformers' saved folder loads here, and ours (values from keys, layer scalars)
    loads in transformers as Gemma4ForCausalLM, with the same logits."""
    from transformers import AutoModelForCausalLM

    hf, ours = pair
    hf.save_pretrained(tmp_path / "theirs")
    tokens = torch.randint(64, (1, 12), generator=torch.Generator().manual_seed(5))
    expected = ours(tokens, torch.arange(12)).logits
    read = Transformer.from_pretrained(tmp_path / "theirs")
    assert (read(tokens, torch.arange(12)).logits - expected).abs().max() < 1e-6
    ours.save_pretrained(tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(back).__name__ == "Gemma4ForCausalLM"
    assert (back(input_ids=tokens).logits.float() - expected).abs().max() < 1e-4


def test_gemma4_parts_not_read_yet_are_refused_in_one_line():
    """Per-layer embeddings (transformers' default: 256 a layer) and K/V shared across layers
    are refused, naming what."""
    for extra, named in (({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input=256"),
                         ({"num_kv_shared_layers": 2}, "num_kv_shared_layers=2")):
        config = gemma4_config(**extra).to_dict()
        with pytest.raises(ValueError, match=named) as caught:
            ModelConfig.from_hf(config)
        assert "\n" not in str(caught.value)
    absent = json.loads(json.dumps(gemma4_config().to_dict()))
    del absent["hidden_size_per_layer_input"]
    with pytest.raises(ValueError, match="hidden_size_per_layer_input=256"):
        ModelConfig.from_hf(absent)


def test_gemma4_without_values_from_keys_reads_its_v_proj():
    hf = gemma4_model(value_from_key=False)
    ours = Transformer.from_hf(hf).eval()
    assert not ours.config.value_from_key and ours.layers[1].self_attn.v_proj is not None
    tokens = torch.randint(64, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits.float()
        assert (ours(tokens, torch.arange(10)).logits - expected).abs().max() < 1e-4


@torch.no_grad()
def test_gemma4_fuses_its_products_without_a_v_proj(pair):
    """Full layers whose keys double as values fuse q and k alone (the compiled stages' one
    product), and give the same q, k and v."""
    from selfspec.model.transformer import fuse_projections

    hf, _ = pair
    ours = Transformer.from_hf(hf).eval()
    x = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(0))
    plain = [ours.layers[i].self_attn.projections(x) for i in (0, 1)]
    assert fuse_projections(ours)
    assert ours.layers[1].self_attn.fused.weight.shape[0] == \
        ours.layers[1].self_attn.q_proj.out_features + ours.layers[1].self_attn.k_proj.out_features
    for i in (0, 1):
        for a, b in zip(plain[i], ours.layers[i].self_attn.projections(x, fused=True),
                        strict=True):
            torch.testing.assert_close(a, b)


def test_gemma4_configs_round_trip_through_config_json(pair):
    _, ours = pair
    assert ModelConfig.from_hf(ours.config.to_hf()) == ours.config
