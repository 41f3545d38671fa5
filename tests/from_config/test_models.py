"""Model configs (from_config/models.py): published sizes, architectures, finding weights."""

import json

import pytest
from helpers import SMALL_ARCH, SMALL_OVERRIDES, group_options

from selfspec.from_config.common import REPO_ROOT
from selfspec.from_config.models import (
    ModelNotAvailable,
    load_target,
    model_config,
    resolve_model_path,
)
from selfspec.from_config.prompts import prompt_set
from selfspec.model import ModelConfig
from selfspec.model.loading import check_architecture
from selfspec.model.plan import count_parameters

# Published parameter counts (model cards / papers); configs must land within 1%.
PUBLISHED_PARAMS = {
    "llama2-7b": 6.74e9,
    "vicuna-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b-instruct": 8.03e9,
    "llama3.1-70b-instruct": 70.6e9,
    "mistral-7b": 7.24e9,
    "qwen2.5-7b-instruct": 7.62e9,
    "qwen2.5-72b-instruct": 72.7e9,
    "smollm2-135m": 135e6,  # SmolLM2-135M-Instruct: 134.5M, the LM head tied to the embedding
    "gemma3-270m": 268.1e6,  # Gemma 3 270M: 268,098,176, 168M of them the tied embedding
}


# ---- model configs ---------------------------------------------------------------------------


def test_every_real_model_config_has_a_published_size():
    assert set(group_options("model")) == {"tiny", "local", "random-7b", "random-moe",
                                           "random-mtp", "random-hybrid", "random-gemma4",
                                           "random-deepseek-v3", "random-llama4",
                                           *PUBLISHED_PARAMS}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_model_config_matches_published_parameter_count(cfg_of, name):
    cfg = cfg_of("generate", f"model={name}")
    assert cfg.model.name == name and (cfg.model.hf_id or cfg.model.get("gguf"))
    assert cfg.model.dtype == ("fp32" if cfg.model.get("gguf") else "bf16")  # CPU-run: fp32
    count = count_parameters(model_config(cfg.model))
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, f"{name}: {count:,}"


def test_default_is_the_tiny_target(cfg_of):
    cfg = cfg_of("generate")
    assert cfg.model.name == "tiny" and cfg.model.asset == "tiny/target"
    assert cfg.model.draft.asset == "tiny/draft"
    assert (cfg.sampling.name, prompt_set(cfg).name, cfg.drafter, cfg.dry_run) == (
        "greedy", "humaneval", "small_model", False)
    assert count_parameters(model_config(cfg.model)) > 0


def test_tiny_config_agrees_with_the_shipped_target(cfg_of):
    config_json = REPO_ROOT / "selfspec/assets/tiny/target/config.json"
    if not config_json.is_file():
        pytest.skip("the tiny target is not built yet")
    expected = model_config(cfg_of("generate").model)
    shipped = ModelConfig.from_hf(json.loads(config_json.read_text()))
    check_architecture(expected, shipped, "tiny", str(config_json.parent))


def test_qwen2_configs_have_qkv_bias_and_llama31_its_rope_scaling(cfg_of):
    qwen = model_config(cfg_of("generate", "model=qwen2.5-7b-instruct").model)
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.model_type == "qwen2"
    llama31 = model_config(cfg_of("generate", "model=llama3.1-70b-instruct").model)
    assert llama31.rope_scaling["rope_type"] == "llama3" and llama31.rope_scaling["factor"] == 8.0


def test_a_local_model_reads_its_architecture_from_the_folder(cfg_of, small_folder):
    cfg = cfg_of("generate", "model=local", f"model.path={small_folder}")
    assert model_config(cfg.model).num_layers == SMALL_ARCH["num_layers"]
    assert load_target(cfg).config.hidden_size == SMALL_ARCH["hidden_size"]


# ---- finding weights -------------------------------------------------------------------------


def test_missing_real_model_names_its_id_and_the_fix(cfg_of, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(ModelNotAvailable) as info:
        resolve_model_path(cfg_of("generate", "model=llama2-70b").model)
    message = str(info.value)
    assert "meta-llama/Llama-2-70b-hf" in message and "model.path=" in message
    assert str(tmp_path) in message and "Hub access" in message


def test_model_path_that_does_not_exist_is_named(cfg_of, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelNotAvailable, match="nowhere"):
        resolve_model_path(cfg_of("generate", "model=mistral-7b",
                                  f"model.path={missing}").model)


def test_hub_cache_snapshot_is_found_offline(cfg_of, monkeypatch, tmp_path):
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "models--JackFram--llama-68m"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    draft_cfg = cfg_of("generate", "model=llama2-7b").model.draft
    assert resolve_model_path(draft_cfg, "model.draft") == snapshot


def test_weights_that_contradict_the_config_are_refused(cfg_of, small_folder):
    overrides = [o for o in SMALL_OVERRIDES if "num_layers" not in o]
    cfg = cfg_of("generate", f"model.path={small_folder}", *overrides)  # tiny's 8 layers vs 2 saved
    with pytest.raises(ValueError, match="num_layers: config 8 vs checkpoint 2"):
        load_target(cfg)
