"""scripts/export_heads.py: heads exported for every engine, with their target where needed."""

import json

import pytest
import torch
from helpers import PUBLISHED_H as H
from helpers import PUBLISHED_LAYERS as LAYERS
from helpers import PUBLISHED_V as V
from helpers import (
    eagle3_folder,
    medusa_reference_folder,
    same_state,
    tiny_llama,
    trained_like_medusa,
)
from safetensors.torch import load_file

from selfspec import Transformer
from selfspec.heads import MedusaConfig, MedusaHeads, load_head


@pytest.fixture(scope="module")
def target():
    return Transformer.from_hf(tiny_llama(0, vocab=V, layers=LAYERS, hidden=H)).eval()


def run_export(args: list[str], capsys) -> str:
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "export_heads.py"
    argv, sys.argv = sys.argv, [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return capsys.readouterr().out


def test_the_script_exports_a_medusa2_export_with_its_merged_target(tmp_path, quick_build,
                                                                    capsys):
    from selfspec.heads import describe_target, save_head
    from selfspec.model.lora import ADAPTER_DIR, LoraSettings, add_lora, merge_adapter, save_adapter

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


def test_the_script_narrows_medusa_heads_to_their_most_frequent_tokens_for_shipping(
        target, tmp_path, capsys):
    from selfspec.heads import describe_target, save_head
    from selfspec.heads.draft_vocab import COUNTS_FILE, save_token_counts

    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2))
    export = save_head(tmp_path / "export", heads, heads.config, describe_target(target))
    counts = torch.arange(V).flip(0)  # low ids most frequent
    save_token_counts(export, counts)
    run_export([str(export), "--to", "selfspec", "--dtype", "bfloat16", "--draft-vocab", "8",
                str(tmp_path / "small")], capsys)
    small = load_head(tmp_path / "small", target=target)
    assert small.draft_vocab.target_ids.tolist() == list(range(8))
    stored = load_file(tmp_path / "small" / "model.safetensors")
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    hidden = torch.randn(3, H)
    torch.testing.assert_close(small(hidden), heads(hidden)[..., :8], rtol=0.02, atol=0.02)
    assert torch.equal(load_file(tmp_path / "small" / COUNTS_FILE)["token_counts"], counts)


def test_narrowing_needs_the_counts_and_medusa_heads(target, tmp_path, capsys):
    from selfspec.heads import describe_target, save_head

    heads = trained_like_medusa(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2))
    export = save_head(tmp_path / "export", heads, heads.config, describe_target(target))
    for to, error in [("selfspec", "train/medusa.py write them"),
                      ("vllm", "--draft-vocab narrows heads written --to selfspec")]:
        with pytest.raises(SystemExit) as exit:
            run_export([str(export), "--to", to, "--draft-vocab", "8", str(tmp_path / to)],
                       capsys)
        assert exit.value.code == 2 and error in capsys.readouterr().err


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
        written = load_file(str(tmp_path / engine / "model.safetensors"))
        if engine == "eagle":  # its config names target_hidden_size: the reference code
            # embeds with the head's own embedding, which must be the target's
            assert "target_hidden_size" in json.loads((tmp_path / engine / "config.json")
                                                      .read_text())
            assert torch.equal(written.pop("embed_tokens.weight"),
                               Transformer.from_pretrained(target_folder).embed_tokens.weight)
        same_state(written, state)
        again = load_head(tmp_path / engine, target=target)
        assert again.config.target_layers == (2, 4, 5)


def test_the_script_finds_the_target_a_published_head_records(tmp_path, target_folder, capsys):
    state = eagle3_folder(tmp_path / "eagle3", {"base_model_name_or_path": str(target_folder)})
    out = run_export([str(tmp_path / "eagle3"), "--to", "sglang", str(tmp_path / "out")], capsys)
    assert f"--model-path {target_folder}" in out
    same_state(load_file(str(tmp_path / "out" / "model.safetensors")), state)


def test_the_script_exports_a_selfspec_dflash_export_to_every_engine(tmp_path, target,
                                                                     target_folder, capsys):
    from helpers import random_dflash_head

    from selfspec.heads import DFlashConfig, DFlashHead, describe_target, save_head

    config = DFlashConfig.for_target(target.config, mask_token_id=V - 1, num_layers=2)
    head = random_dflash_head(config, seed=1)
    save_head(tmp_path / "head", head, config, describe_target(target))
    commands = {"vllm": '"method": "dflash"', "sglang": "--speculative-algorithm DFLASH",
                "dflash": "DFlashDraftModel.from_pretrained"}
    for engine, command in commands.items():
        out = run_export([str(tmp_path / "head"), "--to", engine, str(tmp_path / engine),
                          "--target", str(target_folder)], capsys)
        assert command in out and str(target_folder) in out
        config_json = json.loads((tmp_path / engine / "config.json").read_text())
        assert config_json["num_target_layers"] == LAYERS
        again = load_head(tmp_path / engine, DFlashHead, target=target)
        same_state(again.state_dict(), head.state_dict())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_script_exports_to_speculators_with_the_targets_embedding(tmp_path, target,
                                                                      target_folder, kind,
                                                                      capsys):
    """--to speculators reads the target's embedding (and a full-vocabulary DFlash head's LM
    head) from --target and writes them into the folder, which load_head reads back."""
    from helpers import random_dflash_head, random_eagle_head

    from selfspec.heads import DFlashConfig, EagleConfig, describe_target, save_head

    if kind == "eagle3":
        config = EagleConfig.for_target(target.config, 3, draft_vocab_size=24)
        head = random_eagle_head(config, seed=1)
    else:
        config = DFlashConfig.for_target(target.config, mask_token_id=V - 1, num_layers=2)
        head = random_dflash_head(config, seed=1)
    save_head(tmp_path / "head", head, config, describe_target(target))
    out = run_export([str(tmp_path / "head"), "--to", "speculators", str(tmp_path / "out"),
                      "--target", str(target_folder)], capsys)
    assert "SpeculatorModel.from_pretrained" in out
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["speculators_model_type"] == kind
    assert saved["speculators_config"]["verifier"]["name_or_path"] == str(target_folder)
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(weights["embed_tokens.weight"], target.embed_tokens.weight)
    if kind == "dflash":
        assert torch.equal(weights["lm_head.weight"], target.lm_head.weight)
    same_state(load_head(tmp_path / "out", target=target).state_dict(), head.state_dict())
