"""The config tree composes, every model config is the published size, and `build` turns
configs into models, drafters, sampling settings and prompts (or clear errors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import save_file

from selfspec import from_config, generate
from selfspec.drafters import MedusaDrafter, MedusaProductDrafter, NgramDrafter, SmallModelDrafter
from selfspec.heads import MedusaConfig, MedusaHeads
from selfspec.model import ModelConfig, Transformer
from selfspec.plan import count_parameters
from selfspec.training import TokenRows

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
}
# A 2-layer model small enough to save and load in milliseconds.
SMALL_ARCH = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2}
SMALL_OVERRIDES = [f"model.arch.{k}={v}" for k, v in SMALL_ARCH.items()]


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (from_config.CONF_DIR / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def cfg_of():
    """cfg_of(*overrides): conf/generate.yaml composed with Hydra's compose API."""
    with initialize_config_dir(config_dir=str(from_config.CONF_DIR), version_base="1.3"):
        yield lambda *overrides, config="generate": compose(config, overrides=list(overrides))


# ---- composing every config ----------------------------------------------------------------


def test_every_real_model_config_has_a_published_size():
    assert set(group_options("model")) == {"tiny", "local", "random-7b", *PUBLISHED_PARAMS}


def test_a_local_model_reads_its_architecture_from_the_folder(cfg_of, small_folder):
    cfg = cfg_of("model=local", f"model.path={small_folder}")
    assert from_config.model_config(cfg.model).num_layers == SMALL_ARCH["num_layers"]
    assert from_config.load_target(cfg).config.hidden_size == SMALL_ARCH["hidden_size"]


@pytest.mark.parametrize(
    "override",
    [f"{group}={name}" for group in ("optim", "trainer", "deepspeed", "tree", "model", "data",
                                     "sampling") for name in group_options(group)],
)
def test_every_training_config_composes(cfg_of, override):
    cfg = cfg_of(override, "run_dir=/tmp/unused", config="train_medusa")
    settings = from_config.train_settings(cfg)
    assert settings.max_steps >= 1 and settings.lr > 0
    heads = MedusaHeads(MedusaConfig(8, 64, num_heads=int(cfg.medusa.num_heads)))
    drafter = from_config.medusa_drafter(cfg.tree, heads)
    depth = from_config.tree_depth(cfg.tree) or 1
    assert 1 <= drafter.max_nodes and depth <= cfg.medusa.num_heads
    config = from_config.deepspeed_config(cfg)
    assert config is None or config["zero_optimization"]["stage"] in (2, 3)


def test_tree_configs_build_static_and_top_k_product_drafters(cfg_of):
    heads = MedusaHeads(MedusaConfig(8, 64, num_heads=4))
    static = from_config.medusa_drafter(cfg_of("tree=medusa_small", config="sweep").tree, heads,
                                    max_depth=2)
    assert isinstance(static, MedusaDrafter) and static.tree.max_depth == 2
    assert static.max_nodes == 10  # medusa_small's nodes of depth <= 2
    cfg = cfg_of("tree=top_k_products", "tree.top_k=3", "tree.max_nodes=100", config="sweep")
    product = from_config.medusa_drafter(cfg.tree, heads, max_depth=2)
    assert isinstance(product, MedusaProductDrafter)
    assert (product.depth, product.max_nodes) == (2, 3 + 9)  # the full product tree, 2 deep
    assert from_config.medusa_drafter(cfg.tree, heads).depth == 4  # depth null: every head
    with pytest.raises(ValueError, match="needs `choices` .* or `top_k` and `max_nodes`"):
        tree = cfg_of("tree=top_k_products", "~tree.top_k", config="sweep").tree
        from_config.medusa_drafter(tree, heads)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_eagle_training_configs_build_their_heads_drafters_and_objectives(cfg_of, version):
    cfg = cfg_of(f"eagle.version={version}", "eagle.draft_vocab_size=32",
                 "eagle.target_layers=[0,1,2]", "eagle.ttt_steps=2", "run_dir=/tmp/unused",
                 config="train_eagle")
    assert from_config.check_eagle_settings(cfg) == version
    target = Transformer.from_hf(tiny_llama(0))
    head, config = from_config.eagle_head(cfg, target)
    assert config.version == (3 if version == 3 else 1) and head.config == config
    tokens = torch.randint(2, 64, (6, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    from_config.eagle_draft_vocab(head, target, rows)
    drafter = from_config.eagle_drafter(cfg, head)
    if version == 1:  # the static chain4 tree
        assert drafter.tree.is_chain and drafter.max_nodes == 4
    else:  # the EAGLE-2 defaults for a CPU
        assert (drafter.total_tokens, drafter.depth, drafter.top_k) == (8, 3, 2)
    objective = from_config.eagle_objective(cfg, target, head)
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()
    if version == 3:
        seen = tokens.unique()
        assert len(seen) > 32  # so the draft vocabulary holds training tokens only
        assert set(head.draft_vocab.target_ids.tolist()) < set(seen.tolist())


@pytest.mark.parametrize("value, source, expected", [
    ("auto", "stdlib", True), ("auto", "sharegpt", False), ("false", "stdlib", False),
    ("true", "sharegpt", True)])
def test_self_distillation_is_automatic_for_the_corpus_only(cfg_of, value, source, expected):
    cfg = cfg_of(f"train_data.self_distill={value}", f"train_data.source={source}",
                 "run_dir=/tmp/unused", config="train_medusa")
    assert from_config.self_distill_enabled(cfg) is expected


def test_corpus_self_distillation_rewrites_the_rows_the_run_draws(cfg_of, tmp_path):
    cfg = cfg_of("trainer.max_steps=2", "trainer.micro_batch_size=3", "trainer.grad_accum=2",
                 "trainer.eval_rows=2", "train_data.self_distill_prompt_tokens=4",
                 f"train_data.cache_dir={tmp_path}", "run_dir=/tmp/unused", config="train_medusa")
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 64, (40, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    train, heldout = from_config.distilled_corpus(cfg, target, rows, rows)
    assert len(train) == 2 * 3 * 2 and len(heldout) == 2  # steps x global batch; eval rows
    assert train.loss_mask[:, :4].sum() == 0 and train.loss_mask[:, 4:].all()
    with pytest.raises(ValueError, match="self_distill needs the target"):
        from_config.distilled_corpus(cfg, None, rows, rows)


def test_eagle_runs_go_over_fewer_self_distilled_rows_for_several_epochs(cfg_of, tmp_path):
    cfg = cfg_of("trainer.max_steps=5", "trainer.micro_batch_size=2", "trainer.eval_rows=2",
                 "train_data.self_distill_prompt_tokens=4", "train_data.self_distill_rows=3",
                 f"train_data.cache_dir={tmp_path}", "run_dir=/tmp/unused", config="train_eagle")
    assert cfg.trainer.max_steps == 5  # the eagle_quick preset's 600 steps overridden
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 64, (40, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    train, _ = from_config.distilled_corpus(cfg, target, rows, rows)
    assert len(train) == 3  # not the 10 rows the run draws
    cfg.train_data.self_distill_rows = 0
    with pytest.raises(ValueError, match="self_distill_rows"):
        from_config.training_rows(cfg, None, target)


def test_general_chat_prompts_come_first_and_a_bad_count_is_refused(cfg_of, monkeypatch):
    from selfspec.from_config import training as build_training
    from selfspec.instructions import general_instructions, stdlib_instructions

    asked = []
    monkeypatch.setattr(build_training, "self_distilled_conversations",
                        lambda prompts, *args, **kwargs: asked.append(prompts) or [])
    target = Transformer.from_hf(tiny_llama(0))
    cfg = cfg_of("train_data.source=instructions", "train_data.num_prompts=3",
                 "train_data.general_prompts=5", "train_data.cache_dir=null",
                 "run_dir=/tmp/unused", config="train_eagle")
    build_training.instruction_conversations(cfg, target, None)
    # general first: the held-out twentieth comes from the kind of prompt evaluation asks
    assert asked == [general_instructions(5) + stdlib_instructions(3)]
    for bad in (-1, "2", True):
        cfg.train_data.general_prompts = bad
        with pytest.raises(ValueError, match="general_prompts must be an integer >= 0"):
            build_training.instruction_conversations(cfg, target, None)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_model_config_matches_published_parameter_count(cfg_of, name):
    cfg = cfg_of(f"model={name}")
    assert cfg.model.name == name and (cfg.model.hf_id or cfg.model.get("gguf"))
    assert cfg.model.dtype == ("fp32" if cfg.model.get("gguf") else "bf16")  # CPU-run: fp32
    count = count_parameters(from_config.model_config(cfg.model))
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, f"{name}: {count:,}"


def test_default_is_the_tiny_target(cfg_of):
    cfg = cfg_of()
    assert cfg.model.name == "tiny" and cfg.model.asset == "tiny/target"
    assert cfg.model.draft.asset == "tiny/draft"
    assert (cfg.sampling.name, cfg.data.name, cfg.drafter, cfg.dry_run) == (
        "greedy", "humaneval", "small_model", False)
    assert count_parameters(from_config.model_config(cfg.model)) > 0


def test_tiny_config_agrees_with_the_shipped_target(cfg_of):
    config_json = from_config.REPO_ROOT / "selfspec/assets/tiny/target/config.json"
    if not config_json.is_file():
        pytest.skip("the tiny target is not built yet")
    expected = from_config.model_config(cfg_of().model)
    shipped = ModelConfig.from_hf(json.loads(config_json.read_text()))
    from_config.check_architecture(expected, shipped, "tiny", str(config_json.parent))


def test_qwen2_configs_have_qkv_bias_and_llama31_its_rope_scaling(cfg_of):
    qwen = from_config.model_config(cfg_of("model=qwen2.5-7b-instruct").model)
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.model_type == "qwen2"
    llama31 = from_config.model_config(cfg_of("model=llama3.1-70b-instruct").model)
    assert llama31.rope_scaling["rope_type"] == "llama3" and llama31.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("name", group_options("sampling"))
def test_every_sampling_config_builds(cfg_of, name):
    params = from_config.sampling_params(cfg_of(f"sampling={name}").sampling)
    assert params.greedy == (name == "greedy")
    assert (params.top_p < 1) == (name == "top_p") and (params.top_k == 50) == (name == "top_k")


@pytest.mark.parametrize("name", group_options("data"))
def test_every_data_config_composes(cfg_of, name):
    data = cfg_of(f"data={name}").data
    assert data.name == name and data.num_prompts >= 1 and data.max_prompt_tokens >= 1


@pytest.mark.parametrize("name", group_options("bench"))
def test_every_bench_config_composes(cfg_of, name):
    bench = cfg_of(f"+bench={name}").bench
    assert {"max_new_tokens", "num_prompts", "repeats", "warmup"} <= bench.keys()


def test_question_files_ship_with_the_package_and_data_path_overrides(cfg_of, tmp_path):
    shipped = from_config.data_path(cfg_of("data=mt_bench").data)
    assert shipped.parent.parts[-3:] == ("selfspec", "assets", "prompts")
    assert shipped.name == "mt_bench_question.jsonl" and shipped.is_file()
    assert from_config.data_path(cfg_of("data=spec_bench").data).is_file()
    assert len(from_config.prompts(cfg_of("data=mt_bench", "data.num_prompts=80").data)) == 80
    data = cfg_of("data=spec_bench", f"data.path={tmp_path}/mine.jsonl").data
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/mine.jsonl; set data.path="):
        from_config.load_prompts(data, tokenizer=None)
    (tmp_path / "mine.jsonl").write_text('{"question_id": 7, "turns": ["hi"]}\n')
    assert from_config.data_path(data) == tmp_path / "mine.jsonl"
    (loaded,) = from_config.load_prompts(data, tokenizer=lambda text: {"input_ids": [len(text)]})
    assert loaded.prompt.id == "7" and loaded.ids == [2]
    with pytest.raises(ValueError, match="names no question file"):
        from_config.data_path(cfg_of("data=mt_bench", "data.asset=null").data)


# ---- finding weights -----------------------------------------------------------------------


def test_missing_real_model_names_its_id_and_the_fix(cfg_of, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(from_config.ModelNotAvailable) as info:
        from_config.resolve_model_path(cfg_of("model=llama2-70b").model)
    message = str(info.value)
    assert "meta-llama/Llama-2-70b-hf" in message and "model.path=" in message
    assert str(tmp_path) in message and "Hub access" in message


def test_model_path_that_does_not_exist_is_named(cfg_of, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(from_config.ModelNotAvailable, match="nowhere"):
        from_config.resolve_model_path(cfg_of("model=mistral-7b", f"model.path={missing}").model)


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
    draft_cfg = cfg_of("model=llama2-7b").model.draft
    assert from_config.resolve_model_path(draft_cfg, "model.draft") == snapshot


def test_generate_without_weights_fails_cleanly(tmp_path):
    script = from_config.REPO_ROOT / "eval/generate.py"
    run = subprocess.run(
        [sys.executable, str(script), "model=llama2-7b", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert "meta-llama/Llama-2-7b-hf" in run.stderr and "model.path=" in run.stderr
    assert "Traceback" not in run.stderr


# ---- loading a model folder and building drafters ------------------------------------------


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama saved the Hugging Face way (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("small")
    config = ModelConfig(**SMALL_ARCH, head_dim=8, max_position_embeddings=128, bos_token_id=0,
                         eos_token_ids=(1,))
    torch.manual_seed(0)
    model = Transformer(config)
    state = {k if k.startswith("lm_head") else f"model.{k}": v.contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    hf_config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 0,
                 "eos_token_id": 1, **{k: SMALL_ARCH[k] for k in
                                       ("vocab_size", "hidden_size", "intermediate_size")}}
    (folder / "config.json").write_text(json.dumps(hf_config))
    return folder


def test_load_target_and_drafters_from_a_local_folder(cfg_of, small_folder):
    cfg = cfg_of(f"model.path={small_folder}", f"model.draft.path={small_folder}",
                 *SMALL_OVERRIDES)
    target = from_config.load_target(cfg)
    assert target.source == str(small_folder) and target.embed_tokens.weight.dtype == torch.float32
    assert from_config.build_drafter(cfg_of("drafter=none"), target) is None
    assert isinstance(from_config.build_drafter(cfg_of("drafter=ngram"), target), NgramDrafter)
    drafter = from_config.build_drafter(cfg, target)
    assert isinstance(drafter, SmallModelDrafter) and drafter.num_draft_tokens == 4
    plain = generate(target, [0, 5, 7], max_new_tokens=6)
    spec = generate(target, [0, 5, 7], drafter=drafter, max_new_tokens=6)
    assert spec.tokens == plain.tokens and spec.stats.tau > 1  # the draft is the target itself


def test_the_ngram_drafter_reads_a_corpus_of_answers(cfg_of, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "p", "answer": "return self.name"}) + "\n")
    cfg = cfg_of("drafter=ngram", f"ngram.corpus={answers}", "ngram.max_ngram=2")
    target = from_config.load_target(cfg)  # the shipped tiny target, with its tokenizer
    drafter = from_config.build_drafter(cfg, target)
    end = target.config.eos_token_ids[:1]  # each answer ends as the target ends a turn
    ids = from_config.load_tokenizer(target.source).encode("return self.name") + list(end)
    assert drafter.max_ngram == 2 and drafter.corpus.sequences == [ids]
    assert drafter.corpus.get(ids[:1]) == tuple(ids[1:])
    tree = from_config.build_drafter(cfg_of("drafter=ngram", f"ngram.corpus={answers}",
                                      "ngram.tree_nodes=6", "num_draft_tokens=3"), target)
    assert tree.max_nodes == 6 and tree.num_draft_tokens == 3
    with pytest.raises(ValueError, match="ngram.tree_nodes: give one node count"):
        from_config.generation_settings(cfg_of("drafter=ngram", "ngram.tree_nodes=[2,4]"))
    with pytest.raises(FileNotFoundError, match="ngram.corpus: no file at"):
        from_config.generation_settings(cfg_of("drafter=ngram", "ngram.corpus=/no/file.jsonl"))


def test_heads_that_ship_are_found_by_the_models_name(tmp_path):
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "medusa_heads": "shipped",
                            "eagle_head": str(tmp_path)})
    assert from_config.head_folder(cfg, "eagle_head") == tmp_path  # a path is a path
    with pytest.raises(FileNotFoundError, match="medusa_heads=shipped: none ship for model=tiny"):
        from_config.head_folder(cfg, "medusa_heads")


def test_the_shipped_corpus_is_the_models_own_answers_file(cfg_of):
    cfg = cfg_of("drafter=ngram", "ngram.corpus=shipped", "model=smollm2-135m")
    path = from_config.corpus_path(cfg.ngram, cfg.model)
    assert path.name == f"{cfg.model.answers}.gz" and path.stat().st_size > 100_000
    with pytest.raises(FileNotFoundError, match="no answers ship for model=tiny"):
        from_config.generation_settings(cfg_of("drafter=ngram", "ngram.corpus=shipped"))


def test_weights_that_contradict_the_config_are_refused(cfg_of, small_folder):
    overrides = [o for o in SMALL_OVERRIDES if "num_layers" not in o]
    cfg = cfg_of(f"model.path={small_folder}", *overrides)  # tiny's 8 layers vs 2 saved
    with pytest.raises(ValueError, match="num_layers: config 8 vs checkpoint 2"):
        from_config.load_target(cfg)


def test_drafter_errors_say_what_to_do(cfg_of, small_folder):
    target = from_config.load_target(cfg_of(f"model.path={small_folder}", *SMALL_OVERRIDES))
    with pytest.raises(ValueError, match="model.draft.path=.*drafter=ngram"):
        from_config.build_drafter(cfg_of("model=mistral-7b"), target)
    with pytest.raises(ValueError, match="unknown drafter 'eagle9'"):
        from_config.build_drafter(cfg_of("drafter=eagle9"), target)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        from_config.load_target(cfg_of(f"model.path={small_folder}", "model.dtype=fp8",
                                 *SMALL_OVERRIDES))


def test_early_exit_configs_build_exits_drafters_and_sweep_rows(cfg_of):
    cfg = cfg_of("early_exit.exit_layers=[1]", "run_dir=/tmp/unused", config="train_early_exit")
    assert from_config.check_early_exit_settings(cfg) == (1,)
    target = Transformer.from_hf(tiny_llama(0))
    (head,) = from_config.early_exit_heads(cfg, target)
    assert head.config.kind == "adapter" and head.exit_layer == 1
    drafter = from_config.early_exit_drafter(cfg, head)
    assert (drafter.max_nodes, drafter.confidence_threshold) == (6, 0.6)
    def early_exit_variants(cfg):
        return tuple(v.label() for v in from_config.entry("early_exit").variants(cfg, True))

    sweep = cfg_of("methods=[early_exit]", config="sweep")
    assert early_exit_variants(sweep) == tuple(
        f"early_exit/E{e}/norm/{stop}" for e in (2, 4, 6) for stop in ("nostop", "stop0.6"))
    adapters = cfg_of("early_exit.exits=/some/export", "early_exit.exit_layers=3",
                      "early_exit.confidence_threshold=0.5", config="lossless")
    assert early_exit_variants(adapters) == ("early_exit/E3/norm/stop0.5",
                                             "early_exit/E3/adapter/stop0.5")
