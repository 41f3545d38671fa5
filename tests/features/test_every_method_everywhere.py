"""Every method of the registry reaches every entry point: eval/generate.py builds each of our
drafters by name and decodes losslessly with it, the sweeps list every method, and a method's
settings moved to conf/drafters.yaml still read under their old keys, with a warning."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from conftest import lm_head_copies
from helpers import family_target, load_entry, toy
from hydra import compose, initialize_config_dir

from selfspec import Transformer, generate
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import drafter_and_target, drafter_choice
from selfspec.from_config.methods import registry
from selfspec.from_config.models import load_target
from selfspec.from_config.sweeps import plan_sweep
from selfspec.heads import (
    DFlashConfig,
    DFlashHead,
    EagleConfig,
    EagleHead,
    describe_target,
    save_head,
)
from selfspec.model.loading import with_random_mtp

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42]]  # repeats: lookup drafts


@pytest.fixture(scope="module")
def compose_cfg():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda config, *overrides: compose(config, overrides=list(overrides))


def method_settings(quick_build, heads_dir, eagle_dir, dflash_dir) -> dict[str, list[str]]:
    """What each of our methods needs, by name: the toy target (one layer) with its heads, or
    for early exit and layer skipping the shipped tiny target (8 layers)."""
    on_toy = toy(quick_build)[:3]
    return {"small_model": on_toy, "ngram": on_toy,
            "medusa": [*on_toy, f"medusa_heads={heads_dir}"],
            "ngram+medusa": [*on_toy, f"medusa_heads={heads_dir}"],
            "eagle": [*on_toy, f"eagle_head={eagle_dir}", "eagle.total_tokens=6",
                      "eagle.top_k=2"],
            "dflash": [*on_toy, f"dflash_head={dflash_dir}", "dflash.tree_nodes=4"],
            "early_exit": ["model=tiny"], "layer_skip": ["model=tiny"],
            "lookahead": ["model=tiny"], "quantized": on_toy, "mtp": ["model=random-mtp"],
            "suffix": on_toy, "gemma4_assistant": ["model=random-gemma4"]}


@pytest.mark.parametrize("quantize", ["null", pytest.param("int8", marks=pytest.mark.slow)])
def test_generate_drafts_losslessly_with_every_method_of_the_registry(
        quick_build, compose_cfg, heads_dir, eagle_dir, dflash_dir, quantize):
    """Every method, on the target and on its int8 copy (model.quantize: the target that every
    output is then exact against)."""
    ours = [name for name, e in registry().items() if e.ours]
    settings = method_settings(quick_build, heads_dir, eagle_dir, dflash_dir)
    assert sorted(ours) == sorted(settings)  # a new method needs a line here, and a test
    for name in ours:
        cfg = compose_cfg("generate", f"drafter={name}", "num_draft_tokens=2", *settings[name],
                          f"model.quantize={quantize}")
        target = load_target(cfg)
        drafter, verified_on = drafter_and_target(cfg, target)
        assert verified_on is target
        drafted = 0
        for prompt in PROMPTS:
            result = generate(target, prompt, drafter=drafter, max_new_tokens=12)
            assert result.tokens == generate(target, prompt, max_new_tokens=12).tokens, name
            drafted += result.stats.drafted
        assert drafted > 0, name


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family_settings(request, tmp_path_factory, quick_build) -> dict[str, list[str] | None]:
    """method_settings for a random 4-layer target of the family with the toy tokenizer:
    its first layer as the draft model, and heads made for it."""
    root = tmp_path_factory.mktemp(request.param)
    folder = family_target(quick_build, root / "target", request.param)
    target = Transformer.from_pretrained(folder)
    target.first_layers(1).save_pretrained(root / "draft")
    shutil.copy(folder / "tokenizer.json", root / "draft" / "tokenizer.json")
    info = describe_target(target)
    heads = lm_head_copies(target)
    save_head(root / "medusa", heads, heads.config, info)
    torch.manual_seed(0)
    eagle = EagleHead(EagleConfig.for_target(target.config, 3, draft_vocab_size=64,
                                             target_layers=(1, 2, 4)))
    save_head(root / "eagle", eagle, eagle.config, info)
    block = DFlashHead(DFlashConfig.for_target(target.config, mask_token_id=63, block_size=4,
                                               target_layers=(1, 2)))
    save_head(root / "dflash", block, block.config, info)
    on = ["model=local", f"model.path={folder}", f"model.draft.path={root / 'draft'}"]
    mtp = replace(target.config, mtp_modules=1, mtp_layout="nextn")  # a NextN layer of its own
    with_random_mtp(target, mtp, seed=0).save_pretrained(root / "mtp")
    shutil.copy(folder / "tokenizer.json", root / "mtp" / "tokenizer.json")
    return {"small_model": on, "ngram": on, "medusa": [*on, f"medusa_heads={root / 'medusa'}"],
            "ngram+medusa": [*on, f"medusa_heads={root / 'medusa'}"],
            "eagle": [*on, f"eagle_head={root / 'eagle'}", "eagle.total_tokens=6",
                      "eagle.top_k=2"],
            "dflash": [*on, f"dflash_head={root / 'dflash'}"],
            "early_exit": [*on, "early_exit.exit_layers=2"], "layer_skip": on,
            "lookahead": on, "quantized": on, "suffix": on,
            "mtp": ["model=local", f"model.path={root / 'mtp'}"],
            # a Gemma 4 target's own assistant: drafts for no other family (tested on
            # random-gemma4 above and in tests/drafters/test_gemma4_assistant.py)
            "gemma4_assistant": None}


@pytest.mark.slow
def test_every_method_of_the_registry_drafts_losslessly_for_every_family(compose_cfg,
                                                                         family_settings):
    """eval/generate.py's path (the config, the method's loader, its drafter) on a Qwen3 and
    a Gemma 3 target, whose window is shorter than the prompts and answers."""
    ours = [name for name, e in registry().items() if e.ours]
    assert sorted(ours) == sorted(family_settings)
    for name in (name for name in ours if family_settings[name] is not None):
        cfg = compose_cfg("generate", f"drafter={name}", "num_draft_tokens=2",
                          *family_settings[name])
        target = load_target(cfg)
        drafter, _ = drafter_and_target(cfg, target)
        for prompt in PROMPTS:
            result = generate(target, prompt, drafter=drafter, max_new_tokens=12)
            assert result.tokens == generate(target, prompt, max_new_tokens=12).tokens, name


def test_eval_generate_runs_medusa_heads_by_name(quick_build, compose_cfg, heads_dir, capsys):
    cfg = compose_cfg("generate", *toy(quick_build)[:3], "drafter=medusa",
                      f"medusa_heads={heads_dir}", "max_new_tokens=8", "data.num_prompts=1")
    load_entry("generate").main.__wrapped__(cfg)
    out = capsys.readouterr().out
    assert "tau" in out and "over plain decoding" in out


def test_generate_refuses_settings_that_describe_several_rows(quick_build, compose_cfg):
    cfg = compose_cfg("generate", "drafter=early_exit", "early_exit.exit_layers=[1,2]")
    with pytest.raises(ValueError, match=r"drafter=early_exit: its settings describe 2 rows "
                                         r"\(early_exit/E1/norm/nostop, early_exit/E2/norm"):
        drafter_choice(cfg)
    with pytest.raises(ValueError, match="unknown drafter 'hf_assisted'"):
        drafter_choice(compose_cfg("generate", "drafter=hf_assisted"))


def test_an_old_key_is_read_with_a_warning_naming_the_new_one(quick_build, compose_cfg):
    cfg = compose_cfg("generate", *toy(quick_build)[:3], "first_candidates=3")
    with pytest.warns(FutureWarning, match=r"first_candidates= is deprecated: use "
                                           r"small_model.first_candidates="):
        method, variant, k = drafter_choice(cfg)
    assert (method.name, variant.first_candidates, k) == ("small_model", 3, 4)
    # the method's own read_old_keys checks an old key as it was given
    with pytest.raises(ValueError, match=r"drafter=small_model: confidence_threshold must lie"):
        drafter_choice(compose_cfg("generate", *toy(quick_build)[:3], "confidence_threshold=2"))


def test_every_method_is_a_sweep_and_lossless_method(quick_build, compose_cfg):
    names = list(registry())
    cfg = compose_cfg("sweep", *toy(quick_build), "methods=[nonesuch]")
    with pytest.raises(ValueError) as info:
        plan_sweep(cfg, 1)
    assert f"choose from {', '.join(names)}" in str(info.value)
