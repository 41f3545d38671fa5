"""Exporting heads (heads/export.py): vLLM's Medusa layout, bias-free EAGLE-1, engine refusals."""

import json

import pytest
import torch
from helpers import PUBLISHED_CHAIN as CHAIN
from helpers import PUBLISHED_H as H
from helpers import PUBLISHED_LAYERS as LAYERS
from helpers import (
    PUBLISHED_PROMPTS,
    assert_lossless,
    eagle1_folder,
    same_state,
    tiny_llama,
    trained_like_medusa,
)
from helpers import PUBLISHED_V as V
from safetensors.torch import load_file, save_file

from selfspec import Transformer, generate
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.heads import MedusaConfig, load_head
from selfspec.heads.export import export_head
from selfspec.heads.io import read_head
from selfspec.heads.layouts import ExportRefused

SHARED = torch.nn.functional.normalize(torch.ones(H), dim=0)  # [H]


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0, vocab=V, layers=LAYERS, hidden=H)).eval()


@pytest.fixture(scope="module")
def plain(target):
    return {tuple(p): generate(target, p, max_new_tokens=20).tokens for p in PUBLISHED_PROMPTS}


# ---- Medusa, vLLM layout ---------------------------------------------------------------------


def test_medusa_to_vllm_writes_its_layout_and_reimports_bit_exactly(tmp_path, target, plain):
    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3,
                                             num_layers=2, draft_vocab_size=40))
    with torch.no_grad():  # a direction every row shares: features against it score < 0
        for head in heads.heads:
            head.lm_head.weight += 3 * SHARED
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40].sort().values
    heads.set_draft_vocab(type(heads.draft_vocab)(ids - torch.arange(40), torch.isin(
        torch.arange(V), ids)))
    exported = export_head(heads, "vllm", tmp_path / "vllm", base_model="org/toy-target")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3
    assert [k for k in config if "num" in k and "heads" in k] == ["num_heads"]  # vLLM's rule
    # vLLM 0.32 builds each head's LM head over vocab_size rows: no token map, all V rows
    assert config["medusa_fc_bias"] is True and config["truncated_vocab_size"] == V
    weights = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert {"blocks.2.layers.1.weight", "blocks.2.layers.1.bias"} <= weights.keys()
    assert "token_map" not in weights and weights["lm_heads.2.weight"].shape == (V, H)
    assert torch.equal(weights["lm_heads.2.weight"][ids], heads.heads[2].lm_head.weight)
    assert '"method": "medusa"' in exported.command and '"num_speculative_tokens": 3' in \
        exported.command
    assert any("top-1 chains" in note for note in exported.notes)
    loaded = load_head(tmp_path / "vllm", target=target)
    assert loaded.draft_vocab is None
    assert_same_top1(heads, loaded)
    assert_lossless(target, plain, lambda: MedusaDrafter(loaded, CHAIN))


def assert_same_top1(heads, full) -> None:
    """The full-vocabulary heads propose each head's top-1 token of the draft-vocabulary ones
    (in target ids), on features of every scale, some of them with every draft logit below 0
    (where zero rows for the other tokens would win)."""
    torch.manual_seed(0)
    scale = torch.linspace(0.1, 30, 400)[:, None]  # [N, 1]
    hidden = torch.cat([torch.randn(400, H) * scale, torch.randn(400, H) - scale * SHARED])
    with torch.no_grad():
        narrow, wide = heads(hidden), full(hidden)  # [N, K, 40], [N, K, V]
    assert (narrow.amax(-1) < 0).sum() > 100
    assert torch.equal(heads.draft_vocab.target_ids[narrow.argmax(-1)], wide.argmax(-1))


def test_shared_lm_head_medusa_to_vllm_carries_the_targets_lm_head(tmp_path, target):
    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2,
                                             shared_lm_head=True))
    with pytest.raises(ValueError, match="share the target's LM head.*pass the target"):
        export_head(heads, "vllm", tmp_path / "no")
    export_head(heads, "vllm", tmp_path / "vllm", target_lm_head=target.lm_head.weight)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["original_lm_head"] is True
    loaded = load_head(tmp_path / "vllm", target=target)
    assert loaded.config.shared_lm_head
    same_state(loaded.state_dict(), heads.state_dict())


@pytest.mark.parametrize("engine", ["sglang", "eagle", "dflash"])
def test_medusa_heads_are_refused_where_no_medusa_is_served(tmp_path, engine):
    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2))
    with pytest.raises(ExportRefused, match="not Medusa heads: export with --to vllm"):
        export_head(heads, engine, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- EAGLE-1 ---------------------------------------------------------------------------------


def test_a_bias_free_eagle1_head_serves_on_vllm_and_sglang(tmp_path, target):
    state = eagle1_folder(tmp_path / "eagle", bias=False)
    stored, _ = read_head(tmp_path / "eagle")
    assert not stored.config.has_fc_bias
    exported = export_head(stored, "vllm", tmp_path / "vllm", base_model="org/toy")
    assert '"method": "eagle"' in exported.command
    same_state(load_file(str(tmp_path / "vllm" / "model.safetensors")), state)
    export_head(stored, "sglang", tmp_path / "sglang")
    weights = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert not weights["fc.bias"].any()  # SGLang's fc always has one: zero is exact
    again, _ = read_head(tmp_path / "sglang")
    same_state(again.state_dict(), stored.state_dict())


# ---- DFlash ----------------------------------------------------------------------------------


def dflash_head(target, **overrides):
    from helpers import random_dflash_head

    from selfspec.heads import DFlashConfig

    options = {"mask_token_id": V - 1, "num_layers": 2, "block_size": 5} | overrides
    return random_dflash_head(DFlashConfig.for_target(target.config, **options), seed=3)


@pytest.mark.parametrize("engine, vocab", [("sglang", None), ("dflash", None), ("vllm", None),
                                           ("vllm", 40)])
def test_a_dflash_head_exports_to_each_engine_and_reimports_bit_exactly(tmp_path, target,
                                                                         plain, engine, vocab):
    from selfspec.drafters import DFlashDrafter

    head = dflash_head(target, draft_vocab_size=vocab)
    assert head.config.target_layers == (2, 4, 6)  # the outputs of layers 1, 3, 5 of 8
    exported = export_head(head, engine, tmp_path / engine, base_model="org/toy",
                           target_layers_count=LAYERS)
    config = json.loads((tmp_path / engine / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 5, "mask_token_id": V - 1,
                                       "target_layer_ids": [1, 3, 5]}
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == LAYERS
    weights = load_file(str(tmp_path / engine / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= weights.keys()
    assert not any(k.startswith("embed_tokens") for k in weights)  # the target's, never ours
    if engine == "vllm":
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
        assert '"method": "dflash"' in exported.command and '"num_speculative_tokens": 4' in \
            exported.command
    elif engine == "sglang":
        assert "--speculative-algorithm DFLASH" in exported.command
    loaded = load_head(tmp_path / engine, target=target)
    assert loaded.config == head.config
    same_state(loaded.state_dict(), head.state_dict())
    assert_lossless(target, plain, lambda: DFlashDrafter(loaded, tree_nodes=6))
    if vocab is not None:  # vLLM's loader reads d2t alone: t2d follows from it
        (tmp_path / "bare").mkdir()
        save_file({k: v for k, v in weights.items() if k != "t2d"},
                  str(tmp_path / "bare" / "model.safetensors"))
        (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
        same_state(load_head(tmp_path / "bare", target=target).state_dict(), head.state_dict())


@pytest.mark.parametrize("change, engine, message", [
    ({"qk_norm": False}, "sglang", "per-head q/k RMSNorm, which this head's layers lack"),
    ({"target_layers": (0, 3)}, "vllm", "cannot name the embeddings"),
    ({"draft_vocab_size": 40}, "sglang", "export with --to vllm"),
    ({"draft_vocab_size": 40}, "dflash", "export with --to vllm"),
    ({}, "eagle", "a DFlash head is not an EAGLE head"),
    ({}, "medusa", "a DFlash head is not a Medusa head"),
])
def test_what_an_engine_cannot_serve_of_a_dflash_head_is_refused(tmp_path, target, change,
                                                                  engine, message):
    with pytest.raises(ExportRefused, match=message):
        export_head(dflash_head(target, **change), engine, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- the engines' own loaders, where they are installed --------------------------------------


def test_vllm_reads_the_exported_medusa_config(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.medusa import MedusaConfig as VllmMedusaConfig

    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3))
    export_head(heads, "vllm", tmp_path / "vllm")
    config = VllmMedusaConfig.from_pretrained(str(tmp_path / "vllm"))
    assert (config.num_heads, config.vocab_size, config.hidden_size) == (3, V, H)


# ---- EAGLE-3 to the reference code: its embedding -------------------------------------------


def reference_eagle3_embedding(folder, base_embedding: torch.Tensor) -> torch.Tensor | None:
    """What the reference EAGLE-3 code (SafeAILab/EAGLE cb7e084, eagle/model/cnets.py
    `Model.__init__` and ea_model.py's `load_state_dict(..., strict=False)`) embeds tokens
    with: the base model's embedding when config.json has no `target_hidden_size`, else the
    head's own `embed_tokens.weight`, and None where that is absent (it stays random)."""
    config = json.loads((folder / "config.json").read_text())
    if "target_hidden_size" not in config:
        return base_embedding
    return load_file(str(folder / "model.safetensors")).get("embed_tokens.weight")


def test_an_eagle3_head_for_the_reference_code_embeds_with_the_targets_embedding(
        tmp_path, target):
    from selfspec.heads import EagleConfig, EagleHead

    head = EagleHead(EagleConfig.for_target(target.config, 3, draft_vocab_size=24))
    embedding = target.embed_tokens.weight.detach()
    export_head(head, "eagle", tmp_path / "with", target_layers_count=LAYERS,
                target_embedding=embedding)
    assert torch.equal(reference_eagle3_embedding(tmp_path / "with", None), embedding)
    exported = export_head(head, "eagle", tmp_path / "without", target_layers_count=LAYERS)
    assert "target_hidden_size" not in json.loads((tmp_path / "without" / "config.json")
                                                  .read_text())
    assert reference_eagle3_embedding(tmp_path / "without", embedding) is embedding
    assert any("from the base model" in note for note in exported.notes)
    vllm = export_head(head, "vllm", tmp_path / "vllm", target_embedding=embedding).folder
    assert "embed_tokens.weight" not in load_file(str(vllm / "model.safetensors"))
    for folder in ("with", "without"):  # both read back as the same head
        again, _ = read_head(tmp_path / folder, target.config)
        same_state(again.state_dict(), head.state_dict())


def test_a_head_whose_head_dim_is_its_targets_serves_on_the_engines_only(tmp_path):
    """A Qwen3 target's head_dim is not hidden / heads: vLLM and SGLang read the config's
    head_dim, the reference code computes hidden / heads and is refused."""
    from selfspec.heads import EagleConfig, EagleHead
    from selfspec.model import ModelConfig

    qwen3 = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=LAYERS,
                        num_heads=4, num_kv_heads=2, head_dim=16, model_type="qwen3",
                        qk_norm="head")
    head = EagleHead(EagleConfig.for_target(qwen3, 3, draft_vocab_size=24))
    for engine in ("vllm", "sglang"):
        folder = export_head(head, engine, tmp_path / engine, target_layers_count=LAYERS).folder
        config = json.loads((folder / "config.json").read_text())
        assert config["head_dim"] == 16 and config["model_type"] == "llama"
        again, _ = read_head(folder, qwen3)
        assert again.config.head_dim == 16
        same_state(again.state_dict(), head.state_dict())
    with pytest.raises(ExportRefused, match="computes head_dim as hidden / heads"):
        export_head(head, "eagle", tmp_path / "eagle", target_layers_count=LAYERS)


# ---- RoPE in both conventions ----------------------------------------------------------------


def _rope_head(target, kind: str):
    """A fused-state head whose RoPE is not the v4 default (theta 10000) and is scaled."""
    from dataclasses import replace

    from helpers import random_eagle_head

    from selfspec.heads import EagleConfig

    rope = {"rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    if kind == "dflash":
        head = dflash_head(target)
        return type(head)(replace(head.config, **rope))
    config = EagleConfig.for_target(target.config, 3, draft_vocab_size=24)
    return random_eagle_head(replace(config, **rope), seed=2)


@pytest.mark.parametrize("kind, engine", [("eagle3", "vllm"), ("eagle3", "sglang"),
                                          ("dflash", "vllm"), ("dflash", "sglang"),
                                          ("dflash", "dflash"), ("eagle3", "speculators"),
                                          ("dflash", "speculators")])
def test_exported_configs_carry_rope_in_the_v4_and_the_v5_keys(tmp_path, target, kind, engine):
    """A transformers 4 reader takes rope_theta / rope_scaling at the top level (and theta
    10000 when they are absent); v5 reads rope_parameters: both are written, and agree."""
    head = _rope_head(target, kind)
    export_head(head, engine, tmp_path, base_model="org/toy", target_layers_count=LAYERS,
                target_embedding=target.embed_tokens.weight,
                target_lm_head=target.lm_head.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)  # speculators nests the layer's
    assert layer["rope_theta"] == 500000.0
    assert layer["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert layer["rope_parameters"] == {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 500000.0}


# ---- speculators' layout (its own classes load it: tests/peers/test_speculators.py) --------


def test_the_speculators_layout_nests_the_layer_and_carries_the_targets_embedding(tmp_path,
                                                                                  target):
    from helpers import random_eagle_head

    from selfspec.heads import EagleConfig

    head = random_eagle_head(EagleConfig.for_target(target.config, 3, draft_vocab_size=24,
                                                    target_layers=(2, 4, 5)), seed=2)
    with pytest.raises(ExportRefused, match="pass the target"):
        export_head(head, "speculators", tmp_path / "bare")
    export_head(head, "speculators", tmp_path / "out", target_embedding=target.embed_tokens.weight)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF hidden_states[l]: ours
    assert config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["num_attention_heads"] == head.config.num_heads
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)
    assert "layers.0.self_attn.q_proj.weight" in weights and not any("midlayer" in k
                                                                     for k in weights)
    loaded = load_head(tmp_path / "out", target=target)
    assert loaded.loaded_from.endswith("found a EAGLE-3 (speculators layout) head "
                                       "(fused target layers [2, 4, 5], a draft vocabulary of "
                                       "24 tokens)")
    same_state(loaded.state_dict(), head.state_dict())
    with pytest.raises(ExportRefused, match="speculators loads EAGLE-3 and DFlash"):
        export_head(small_medusa_heads(), "speculators", tmp_path / "medusa")


def small_medusa_heads():
    from helpers import random_medusa_heads

    return random_medusa_heads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2), seed=1)
