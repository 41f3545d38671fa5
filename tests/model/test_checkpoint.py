"""Hugging Face checkpoint I/O (model/checkpoint.py): folders of every family load and save."""

import json

import pytest
import torch
from helpers import HF_TINY, assert_hf_parity, hf_logits, hf_model, tiny_llama, tiny_model
from transformers import LlamaConfig

from selfspec.model import Transformer


@pytest.mark.parametrize("name", ["llama", "llama3", "mistral", "qwen2"])
def test_from_pretrained_matches_transformers(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path).eval()
    assert ours.config.model_type == ("llama" if name == "llama3" else name)
    assert_hf_parity(ours, hf, seq_len=100 if name == "llama3" else 24)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma2", "olmo2", "granite", "phi3"])
def test_every_family_loads_from_and_saves_to_a_folder_transformers_reads(family, tmp_path):
    """transformers' folder loads with its logits; ours saved loads in transformers with the
    same logits (Phi-3's q/k/v and gate/up fused again as its checkpoints store them)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = tiny_model(family, 0)
    hf.save_pretrained(tmp_path / "theirs")
    ours = Transformer.from_pretrained(tmp_path / "theirs").eval()
    tokens = assert_hf_parity(ours, hf, seq_len=16)
    ours.save_pretrained(tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as saved:
        fused = any("qkv_proj" in name for name in saved.keys())
    assert fused == (family == "phi3")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again) is type(hf)
    torch.testing.assert_close(hf_logits(again, tokens), hf_logits(hf, tokens), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_experts_load_from_and_save_to_each_familys_published_layout(family, tmp_path):
    """transformers writes Mixtral's experts one by one under block_sparse_moe (w1/w2/w3),
    Qwen3-MoE's one by one (gate/up/down_proj), gpt-oss's stacked, transposed, gate and up
    interleaved: ours are stacked from them and written back in the same layout, which
    transformers reads with the same logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = tiny_model(family, 0)
    hf.save_pretrained(tmp_path / "theirs")
    ours = Transformer.from_pretrained(tmp_path / "theirs").eval()
    tokens = assert_hf_parity(ours, hf, seq_len=16)
    ours.save_pretrained(tmp_path / "ours")
    names = {}
    for folder in ("theirs", "ours"):
        with safe_open(str(tmp_path / folder / "model.safetensors"), "pt") as saved:
            names[folder] = {name: tuple(saved.get_slice(name).get_shape())
                             for name in saved.keys()}
    assert names["ours"] == names["theirs"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(again, tokens), hf_logits(hf, tokens), atol=1e-5,
                               rtol=1e-5)


def test_mxfp4_weights_are_refused_naming_the_fix():
    from selfspec.model.checkpoint import our_tensors
    from selfspec.model.config import ModelConfig

    config = ModelConfig.from_hf(tiny_model("gpt_oss", 0).config.to_dict())
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks is quantized \(MXFP4\); "
                                         r"dequantize the model with transformers first"):
        list(our_tensors("model.layers.0.mlp.experts.gate_up_proj_blocks",
                         torch.zeros(1, dtype=torch.uint8), config))


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("mistral")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_hf_parity(Transformer.from_pretrained(tmp_path).eval(), hf, seq_len=16)


def test_from_pretrained_casts_dtype(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    model = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]]), torch.arange(3)).logits.dtype == torch.float32


def test_missing_folder_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Transformer.from_pretrained(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig(**HF_TINY).to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Transformer.from_pretrained(tmp_path)


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


@pytest.fixture(scope="module")
def target3() -> Transformer:
    """The 3-layer toy target draft models are cut from."""
    return Transformer.from_hf(tiny_llama(0, layers=3))


def test_a_saved_model_loads_back_in_selfspec_and_transformers(tmp_path, target3):
    from transformers import AutoModelForCausalLM

    draft = target3.first_layers(2)
    draft.save_pretrained(tmp_path)
    tokens = torch.tensor([[9, 8, 7, 6, 5]])
    positions = torch.arange(tokens.shape[1])
    expected = draft(tokens, positions).logits
    torch.testing.assert_close(Transformer.from_pretrained(tmp_path)(tokens, positions).logits,
                               expected, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected, rtol=1e-5, atol=1e-5)
