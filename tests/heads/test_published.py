"""Published head layouts: Medusa (reference .pt / legacy .safetensors, vLLM), EAGLE-1, EAGLE-3.

Each checkpoint is built here from the published facts (key names, shapes, dtypes, config keys,
random weights), loaded by `load_head`, drafted with losslessly, and exported back: the export
re-imports bit-exactly. What an engine cannot serve is refused with the reason.
"""

import json
import warnings

import pytest
import torch
from helpers import (
    FP16,
    PUBLISHED_PROMPTS,
    assert_lossless,
    eagle1_folder,
    eagle3_folder,
    medusa_reference_folder,
    same_state,
    tiny_llama,
    tiny_model,
)
from helpers import PUBLISHED_CHAIN as CHAIN
from helpers import PUBLISHED_DRAFT_V as DRAFT_V
from helpers import PUBLISHED_H as H
from helpers import PUBLISHED_LAYERS as LAYERS
from helpers import PUBLISHED_V as V
from safetensors.torch import load_file, save_file

from selfspec import Transformer, generate
from selfspec.drafters import EagleDrafter
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.heads import EagleConfig, EagleHead, MedusaHeads, load_head
from selfspec.heads.export import export_head
from selfspec.heads.io import read_head
from selfspec.heads.layouts import ExportRefused, TargetNeeded


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0, vocab=V, layers=LAYERS, hidden=H)).eval()


@pytest.fixture(scope="module")
def plain(target):
    return {tuple(p): generate(target, p, max_new_tokens=20).tokens for p in PUBLISHED_PROMPTS}


# ---- Medusa, reference layout ----------------------------------------------------------------


def test_a_reference_medusa_pt_loads_drafts_losslessly_and_exports_bit_exactly(
        tmp_path, target, plain):
    state = medusa_reference_folder(tmp_path / "ref", stated_heads=2)
    with pytest.warns(UserWarning, match="medusa_num_heads=2, the weights hold 3 heads: using 3"):
        heads = load_head(tmp_path / "ref", MedusaHeads, target=target)
    assert heads.config.num_heads == 3 and not heads.config.shared_lm_head
    assert "Medusa (reference layout)" in heads.loaded_from
    assert_lossless(target, plain, lambda: MedusaDrafter(heads, CHAIN))
    stored, _ = read_head(tmp_path / "ref")
    export_head(stored, "medusa", tmp_path / "out", base_model="org/toy-target")
    same_state(torch.load(tmp_path / "out" / "medusa_lm_head.pt"), state)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1


def test_a_stacked_reference_resblock_is_one_block_applied_twice(tmp_path, target, plain):
    state = medusa_reference_folder(tmp_path / "ref", heads=2, layers=2, suffix=".safetensors")
    heads = load_head(tmp_path / "ref", target=target)
    assert heads.config.num_layers == 2
    hidden = torch.randn(4, H)
    block = heads.heads[0].blocks[0]
    torch.testing.assert_close(heads(hidden)[:, 0], heads.heads[0].lm_head(block(block(hidden))))
    assert_lossless(target, plain, lambda: MedusaDrafter(heads, CHAIN[:2]))
    stored, _ = read_head(tmp_path / "ref")
    export_head(stored, "medusa", tmp_path / "out")
    same_state(torch.load(tmp_path / "out" / "medusa_lm_head.pt"), state)
    with torch.no_grad():  # distinct blocks: the reference layout cannot hold them
        stored.heads[0].blocks[1].linear.weight.add_(1.0)
    with pytest.raises(ExportRefused, match="applies one ResBlock 2 times.*--to vllm"):
        export_head(stored, "medusa", tmp_path / "out2")


def test_legacy_medusa_heads_without_lm_head_share_the_targets(tmp_path, target, plain):
    state = medusa_reference_folder(tmp_path / "legacy", lm_head=False, suffix=".safetensors")
    heads = load_head(tmp_path / "legacy", target=target)
    assert heads.config.shared_lm_head and heads.config.vocab_size == V
    assert_lossless(target, plain, lambda: MedusaDrafter(heads, CHAIN))
    with pytest.raises(TargetNeeded, match="no LM head of their own.*load_head.folder, target="):
        read_head(tmp_path / "legacy")
    export_head(heads.to(FP16), "medusa", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["version"] == "2"
    same_state(load_file(str(tmp_path / "out" / "medusa_lm_head.safetensors")), state)


# ---- EAGLE-1 ---------------------------------------------------------------------------------


def test_an_eagle1_folder_loads_drafts_losslessly_and_exports_bit_exactly(
        tmp_path, target, plain):
    state = eagle1_folder(tmp_path / "eagle", target=target)
    head = load_head(tmp_path / "eagle", EagleHead, target=target)
    assert head.config.version == 1 and head.config.has_fc_bias and "EAGLE-1" in head.loaded_from
    assert_lossless(target, plain, lambda: EagleDrafter(head, total_tokens=6, depth=3, top_k=2))
    stored, _ = read_head(tmp_path / "eagle")
    for engine in ("eagle", "sglang"):
        export_head(stored, engine, tmp_path / engine)
        same_state(load_file(str(tmp_path / engine / "model.safetensors")), state)
    sglang = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle"] and sglang["bias"] is False
    assert_vllm_carries_the_fc_bias(stored.float(), target, tmp_path / "vllm")


def assert_vllm_carries_the_fc_bias(head: EagleHead, target, out) -> None:
    """vLLM's EAGLE-1 fc has no bias: the export moves it into the attention biases, and the
    folder read back (no fc bias, q/k/v/o biases) is the same function as the head."""
    exported = export_head(head, "vllm", out)
    assert any("fc.bias" in note for note in exported.notes)
    weights = load_file(str(out / "model.safetensors"))
    assert "fc.bias" not in weights and "layers.0.self_attn.o_proj.bias" in weights
    config = json.loads((out / "config.json").read_text())
    assert config["attention_bias"] is True and config["bias"] is True
    served = load_head(out, EagleHead, target=target).float()
    assert not served.config.has_fc_bias and served.config.attention_bias
    torch.manual_seed(0)
    embeds, feature = torch.randn(2, 1, 7, H).unbind(0)  # [1, T, h] each
    with torch.no_grad():
        ours, theirs = (h.logits(h(embeds, feature, torch.arange(7)), lm_head=target.lm_head)
                        for h in (head, served))
    assert (ours - theirs).abs().max() < 1e-4 and ours.abs().max() > 1e-2
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# ---- EAGLE-3 ---------------------------------------------------------------------------------


def test_an_eagle3_folder_loads_drafts_losslessly_and_exports_for_each_engine(
        tmp_path, target, plain):
    state = eagle3_folder(tmp_path / "eagle3")
    head = load_head(tmp_path / "eagle3", target=target)
    assert head.config.version == 3 and head.config.target_layers == (2, 4, 5)
    assert_lossless(target, plain, lambda: EagleDrafter(head, total_tokens=6, depth=3, top_k=2))
    with pytest.raises(TargetNeeded, match="does not name its fused layers"):
        read_head(tmp_path / "eagle3")
    stored = head.to(FP16).cpu()
    ids = {"vllm": [2, 4, 5], "sglang": [1, 3, 4]}
    for engine in ("vllm", "sglang", "eagle"):
        exported = export_head(stored, engine, tmp_path / engine, target_layers_count=LAYERS)
        assert "eagle3" in exported.command.lower()
        same_state(load_file(str(tmp_path / engine / "model.safetensors")), state)
        config = json.loads((tmp_path / engine / "config.json").read_text())
        written = config.get("eagle_aux_hidden_state_layer_ids") or \
            config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        assert written == ids.get(engine)
        again = load_head(tmp_path / engine, target=target)
        assert again.config.target_layers == (2, 4, 5)
        same_state(again.to(FP16).state_dict(), stored.state_dict())


def test_eagle3_layer_ids_that_disagree_or_collide_are_refused(tmp_path, target):
    eagle3_folder(tmp_path / "both", {"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                                      "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                       [2, 4, 5]}})
    with pytest.raises(ValueError, match="two different fused layer lists"):
        load_head(tmp_path / "both", target=target)
    eagle3_folder(tmp_path / "plain")
    shallow = Transformer.from_hf(tiny_llama(0, vocab=V, layers=6, hidden=H))
    with pytest.raises(ValueError, match=r"6-layer target are \[2, 3, 3\]"):
        load_head(tmp_path / "plain", target=shallow)
    head = EagleHead(EagleConfig.for_target(target.config, 3, draft_vocab_size=DRAFT_V,
                                            target_layers=(1, 3, 6)))
    with pytest.raises(ExportRefused, match="reference EAGLE-3 code fuses the default layers"):
        export_head(head, "eagle", tmp_path / "ref", target_layers_count=LAYERS)


def test_a_published_eagle3_head_for_a_qwen3_target_loads_and_drafts_losslessly(tmp_path):
    """The standard EAGLE-3 layout as heads for Qwen3 targets are published: a Llama layer
    whose head_dim is the target's (Qwen3-0.6B's heads: 128 of a 1024 hidden, 16 heads),
    the Qwen3 config keys it was copied from (model_type qwen3 in some, sliding_window null,
    tie_word_embeddings false), bf16 weights and the fused layers under vLLM's key."""
    qwen3 = Transformer.from_hf(tiny_model("qwen3", 0, vocab=V, layers=LAYERS, hidden=H)).eval()
    assert qwen3.config.head_dim * qwen3.config.num_heads != qwen3.config.hidden_size
    config = EagleConfig.for_target(qwen3.config, 3, draft_vocab_size=DRAFT_V)
    torch.manual_seed(7)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    folder = tmp_path / "qwen3_eagle3"
    folder.mkdir()
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
             for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    published = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "qwen3",
                 "hidden_size": H, "intermediate_size": config.intermediate_size,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "max_position_embeddings": 40960, "vocab_size": V, "draft_vocab_size": DRAFT_V,
                 "target_hidden_size": H, "sliding_window": None, "use_sliding_window": False,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "eagle_aux_hidden_state_layer_ids": list(config.target_layers)}
    (folder / "config.json").write_text(json.dumps(published))
    loaded = load_head(folder, target=qwen3)
    assert loaded.config.head_dim == 16 and loaded.config.version == 3
    assert loaded.config.target_layers == config.target_layers
    same_state(loaded.to(torch.bfloat16).state_dict(), state)
    plain = {tuple(p): generate(qwen3, p, max_new_tokens=20).tokens for p in PUBLISHED_PROMPTS}
    assert_lossless(qwen3, plain, lambda: EagleDrafter(loaded.float(), total_tokens=6, depth=3,
                                                       top_k=2))


# ---- refusals --------------------------------------------------------------------------------


def test_a_published_head_for_another_target_is_refused(tmp_path, target):
    eagle1_folder(tmp_path / "eagle")
    wide = Transformer.from_hf(tiny_llama(0, vocab=V, layers=2, hidden=2 * H))
    with pytest.raises(ValueError, match=r"hidden_size 32 \(checkpoint target\) vs 64"):
        load_head(tmp_path / "eagle", target=wide)
    medusa_reference_folder(tmp_path / "ref", base="lmsys/vicuna-7b-v1.3")
    target.source = "/models/llama-2-7b"
    try:
        with warnings.catch_warnings(), pytest.raises(ValueError, match="trained for "
                                                      "'lmsys/vicuna-7b-v1.3'.*allow_other_base"):
            load_head(tmp_path / "ref", target=target)
        target.source = "/models/vicuna-7b-v1.3"
        assert load_head(tmp_path / "ref", target=target).config.num_heads == 3
    finally:
        target.source = None
    with pytest.raises(ValueError, match="holds a Medusa .* head, not EagleHead"):
        load_head(tmp_path / "ref", EagleHead, target=target)


def test_an_unrecognised_folder_names_the_layouts(tmp_path, target):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(1)}, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(ValueError, match="no head checkpoint recognised.*medusa_lm_head.pt"):
        load_head(tmp_path / "x", target=target)
