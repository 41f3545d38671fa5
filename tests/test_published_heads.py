"""Published head layouts: Medusa (reference .pt / legacy .safetensors, vLLM), EAGLE-1, EAGLE-3.

Each checkpoint is built here from the published facts (key names, shapes, dtypes, config keys,
random weights), loaded by `load_head`, drafted with losslessly, and exported back: the export
re-imports bit-exactly. What an engine cannot serve is refused with the reason.
"""

import json
import warnings

import pytest
import torch
from helpers import tiny_llama
from safetensors.torch import load_file, save_file

from selfspec import Transformer, generate
from selfspec.drafters import EagleDrafter
from selfspec.drafters.medusa import MedusaDrafter
from selfspec.heads import EagleHead, MedusaConfig, MedusaHeads, load_head
from selfspec.heads.eagle import EagleConfig
from selfspec.heads.export import ExportRefused, export_head
from selfspec.heads.io import read_head
from selfspec.heads.published import TargetNeeded

H, V, LAYERS = 32, 64, 8  # the toy target: 8 layers, so EAGLE-3's defaults are (2, 4, 5)
FP16 = torch.float16
PROMPTS = [[3, 9, 4, 17, 5], [8, 8, 8, 2, 40, 41, 42, 8, 8]]
CHAIN = [[0], [0, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0, vocab=V, layers=LAYERS, hidden=H)).eval()


@pytest.fixture(scope="module")
def plain(target):
    return {tuple(p): generate(target, p, max_new_tokens=20).tokens for p in PROMPTS}


def assert_lossless(target, plain, make_drafter):
    for prompt, expected in plain.items():
        result = generate(target, list(prompt), drafter=make_drafter(), max_new_tokens=20)
        assert result.tokens == expected
        assert result.stats.drafted > 0


def rand(*shape, seed, dtype=FP16, std=0.2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# ---- Medusa, reference layout ------------------------------------------------------------------


def medusa_reference_folder(folder, *, heads=3, layers=1, lm_head=True, stated_heads=None,
                            base="org/toy-target", suffix=".pt"):
    """A reference Medusa folder: one ResBlock per head under every {i}.{j} (one module applied
    num_layers times), then the LM head {i}.{num_layers}.weight."""
    state = {}
    for i in range(heads):
        w, b = rand(H, H, seed=10 + i), rand(H, seed=20 + i)
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w, b
        if lm_head:
            state[f"{i}.{layers}.weight"] = rand(V, H, seed=30 + i, std=1.0)
    folder.mkdir()
    if suffix == ".pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file({k: v.clone() for k, v in state.items()},
                  str(folder / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": stated_heads or heads, "medusa_num_layers": layers,
              "base_model_name_or_path": base}
    if not lm_head:
        config["version"] = "2"
    (folder / "config.json").write_text(json.dumps(config))
    return state


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


# ---- Medusa, vLLM layout ---------------------------------------------------------------------


def trained_like_medusa(config: MedusaConfig, seed: int = 1) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads.eval()


def test_medusa_to_vllm_writes_its_layout_and_reimports_bit_exactly(tmp_path, target, plain):
    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3,
                                             num_layers=2, draft_vocab_size=40))
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40].sort().values
    heads.set_draft_vocab(type(heads.draft_vocab)(ids - torch.arange(40), torch.isin(
        torch.arange(V), ids)))
    exported = export_head(heads, "vllm", tmp_path / "vllm", base_model="org/toy-target")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3
    assert [k for k in config if "num" in k and "heads" in k] == ["num_heads"]  # vLLM's rule
    assert config["medusa_fc_bias"] is True and config["truncated_vocab_size"] == 40
    weights = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert {"blocks.2.layers.1.weight", "blocks.2.layers.1.bias", "lm_heads.2.weight",
            "token_map"} <= weights.keys()
    assert torch.equal(weights["token_map"], ids)
    assert '"method": "medusa"' in exported.command and '"num_speculative_tokens": 3' in \
        exported.command
    assert any("top-1 chains" in note for note in exported.notes)
    loaded = load_head(tmp_path / "vllm", target=target)
    same_state(loaded.state_dict(), heads.state_dict())
    assert_lossless(target, plain, lambda: MedusaDrafter(loaded, CHAIN))


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


@pytest.mark.parametrize("engine", ["sglang", "eagle"])
def test_medusa_heads_are_refused_where_no_medusa_is_served(tmp_path, engine):
    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2))
    with pytest.raises(ExportRefused, match="not Medusa heads: export with --to vllm"):
        export_head(heads, engine, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- EAGLE-1 ---------------------------------------------------------------------------------


def llama_head_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "vocab_size": V, "torch_dtype": "float16", **extra}


def layer_state(prefix: str, attn_in: int, seed: int) -> dict:
    kv = 2 * (H // 4)
    shapes = {"self_attn.q_proj.weight": (H, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
              "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (H, H),
              "mlp.gate_proj.weight": (48, H), "mlp.up_proj.weight": (48, H),
              "mlp.down_proj.weight": (H, 48)}
    state = {f"{prefix}.{k}": rand(*s, seed=seed + n) for n, (k, s) in enumerate(shapes.items())}
    state[f"{prefix}.post_attention_layernorm.weight"] = (1 + rand(H, seed=seed + 50)).to(FP16)
    return state


def eagle1_folder(folder, *, bias=True, target=None):
    state = {"fc.weight": rand(H, 2 * H, seed=1), **layer_state("layers.0", H, 100)}
    if bias:
        state["fc.bias"] = rand(H, seed=2)
    if target is not None:  # released heads may carry a copy of the target's embedding
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(FP16)
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(llama_head_config(bias=bias)))
    return {k: v for k, v in state.items() if k != "embed_tokens.weight"}


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
    with pytest.raises(ExportRefused, match="fc without a bias.*eagle.fc_bias=false"):
        export_head(stored, "vllm", tmp_path / "vllm")


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


# ---- EAGLE-3 ---------------------------------------------------------------------------------

DRAFT_V = 24


def eagle3_folder(folder, config_extra=None):
    ids = torch.arange(0, 2 * DRAFT_V, 2)  # every other target token
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    state = {"fc.weight": rand(H, 3 * H, seed=3), **layer_state("midlayer", 2 * H, 200),
             "midlayer.hidden_norm.weight": (1 + rand(H, seed=4)).to(FP16),
             "midlayer.input_layernorm.weight": (1 + rand(H, seed=5)).to(FP16),
             "norm.weight": (1 + rand(H, seed=6)).to(FP16),
             "lm_head.weight": rand(DRAFT_V, H, seed=7, std=1.0),
             "d2t": ids - torch.arange(DRAFT_V), "t2d": t2d}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    config = llama_head_config(architectures=["LlamaForCausalLMEagle3"],
                               draft_vocab_size=DRAFT_V, target_hidden_size=H,
                               **(config_extra or {}))
    (folder / "config.json").write_text(json.dumps(config))
    return state


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


# ---- refusals ------------------------------------------------------------------------------


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


# ---- the engines' own loaders, where they are installed ------------------------------------


def test_vllm_reads_the_exported_medusa_config(tmp_path):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.medusa import MedusaConfig as VllmMedusaConfig

    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3))
    export_head(heads, "vllm", tmp_path / "vllm")
    config = VllmMedusaConfig.from_pretrained(str(tmp_path / "vllm"))
    assert (config.num_heads, config.vocab_size, config.hidden_size) == (3, V, H)


# ---- scripts/export_heads.py ---------------------------------------------------------------


def run_export(args: list[str], capsys) -> str:
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "export_heads.py"
    argv, sys.argv = sys.argv, [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return capsys.readouterr().out


def test_the_script_exports_a_medusa2_export_with_its_merged_target(tmp_path, quick_build,
                                                                    capsys):
    from selfspec.heads import describe_target, save_head
    from selfspec.lora import ADAPTER_DIR, LoraSettings, add_lora, merge_adapter, save_adapter

    folder = quick_build / "target"
    toy = Transformer.from_pretrained(folder)
    heads = trained_like_medusa(MedusaConfig(hidden_size=toy.config.hidden_size,
                                             vocab_size=toy.config.vocab_size, num_heads=2))
    export = save_head(tmp_path / "export", heads, heads.config, describe_target(toy))
    adapted = add_lora(Transformer.from_pretrained(folder), LoraSettings(rank=2, alpha=4))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter: the merged target differs
    save_adapter(adapted, export / ADAPTER_DIR)
    out = run_export([str(export), "--to", "vllm", str(tmp_path / "out")], capsys)
    assert f"vllm serve {tmp_path / 'out' / 'target'}" in out and '"method": "medusa"' in out
    assert (tmp_path / "out" / "SERVING.md").read_text().count("vllm serve") == 1
    served = Transformer.from_pretrained(tmp_path / "out" / "target")
    merged = merge_adapter(Transformer.from_pretrained(folder), export / ADAPTER_DIR)
    assert not torch.equal(served.layers[0].self_attn.q_proj.weight,
                           toy.layers[0].self_attn.q_proj.weight)
    same_state(served.state_dict(), merged.state_dict())
    loaded = load_head(tmp_path / "out", target=served)
    same_state(loaded.state_dict(), heads.state_dict())


def test_the_script_rewrites_a_head_in_half_precision_that_loads_as_before(target, tmp_path,
                                                                           capsys):
    from selfspec.heads import describe_target, save_head

    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2))
    export = save_head(tmp_path / "export", heads, heads.config, describe_target(target))
    out = run_export([str(export), "--to", "selfspec", "--dtype", "float16",
                      str(tmp_path / "half")], capsys)
    assert str(tmp_path / "half") in out
    sizes = [(f / "model.safetensors").stat().st_size for f in (export, tmp_path / "half")]
    assert sizes[1] < 0.6 * sizes[0]
    loaded = load_head(tmp_path / "half", MedusaHeads, target=target)
    assert next(loaded.parameters()).dtype == torch.float32  # the target's dtype, as before
    rounded = {k: v.half().float() if v.is_floating_point() else v
               for k, v in heads.state_dict().items()}
    same_state(loaded.state_dict(), rounded)


@pytest.fixture(scope="module")
def target_folder(target, tmp_path_factory):
    return target.save_pretrained(tmp_path_factory.mktemp("toy") / "target")


def run_export_refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_export(args, capsys)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_script_exports_legacy_medusa_heads_with_the_target_given(
        tmp_path, target, target_folder, capsys):
    state = medusa_reference_folder(tmp_path / "legacy", lm_head=False, suffix=".safetensors")
    for engine in ("vllm", "medusa"):
        err = run_export_refused([str(tmp_path / "legacy"), "--to", engine,
                                  str(tmp_path / "x")], capsys)
        assert err.count("\n") == 1 and "no LM head" in err
        assert err.rstrip().endswith("pass --target MODEL_FOLDER")
    out = run_export([str(tmp_path / "legacy"), "--to", "medusa", str(tmp_path / "medusa"),
                      "--target", str(target_folder)], capsys)
    assert f"--model {tmp_path / 'medusa'}" in out
    same_state(load_file(str(tmp_path / "medusa" / "medusa_lm_head.safetensors")), state)
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["version"] == "2"
    out = run_export([str(tmp_path / "legacy"), "--to", "vllm", str(tmp_path / "vllm"),
                      "--target", str(target_folder)], capsys)
    assert f"vllm serve {target_folder} --speculative-config" in out
    weights = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(weights["lm_heads.0.weight"], target.lm_head.weight)
    again = load_head(tmp_path / "vllm", target=target)
    original = load_head(tmp_path / "legacy", target=target)
    assert again.config.shared_lm_head
    same_state(again.state_dict(), original.state_dict())


def test_the_script_exports_an_eagle3_head_without_layer_ids_to_every_engine(
        tmp_path, target, target_folder, capsys):
    state = eagle3_folder(tmp_path / "eagle3")
    err = run_export_refused([str(tmp_path / "eagle3"), "--to", "sglang", str(tmp_path / "x")],
                             capsys)
    assert "does not name its fused layers" in err and "pass --target MODEL_FOLDER" in err
    commands = {"vllm": "vllm serve", "sglang": "--speculative-algorithm EAGLE3",
                "eagle": "EaModel.from_pretrained"}
    for engine, command in commands.items():
        out = run_export([str(tmp_path / "eagle3"), "--to", engine, str(tmp_path / engine),
                          "--target", str(target_folder)], capsys)
        assert command in out and str(target_folder) in out
        same_state(load_file(str(tmp_path / engine / "model.safetensors")), state)
        again = load_head(tmp_path / engine, target=target)
        assert again.config.target_layers == (2, 4, 5)


def test_the_script_finds_the_target_a_published_head_records(tmp_path, target_folder, capsys):
    state = eagle3_folder(tmp_path / "eagle3", {"base_model_name_or_path": str(target_folder)})
    out = run_export([str(tmp_path / "eagle3"), "--to", "sglang", str(tmp_path / "out")], capsys)
    assert f"--model-path {target_folder}" in out
    same_state(load_file(str(tmp_path / "out" / "model.safetensors")), state)
