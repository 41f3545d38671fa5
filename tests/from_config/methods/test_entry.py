"""What registry entries share (from_config/methods/entry.py): keyword-only entries, shipped
head folders, methods run by default once their setting is given, trainers in their methods'
modules."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec.from_config import methods
from selfspec.from_config.methods import MethodEntry, registry, trainers
from selfspec.from_config.methods.entry import head_folder, when_set


def test_heads_that_ship_are_found_by_the_models_name(tmp_path):
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "medusa_heads": "shipped",
                            "eagle_head": str(tmp_path)})
    assert head_folder(cfg, "eagle_head") == tmp_path  # a path is a path
    with pytest.raises(FileNotFoundError, match="medusa_heads=shipped: none ship for model=tiny"):
        head_folder(cfg, "medusa_heads")


def test_an_entry_takes_keyword_arguments_only():
    def variants(cfg, for_sweep=True):
        return ()

    def drafter(loaded, variant, k):
        return None

    entry = MethodEntry(name="m", summary="s", variants=variants, drafter=drafter)
    assert entry.load(None, ()) is None and not entry.default_when(OmegaConf.create({}))
    with pytest.raises(TypeError):
        MethodEntry("m", "s", variants, drafter=drafter)


def test_a_method_can_run_by_default_once_its_setting_is_given():
    given = when_set("early_exit.exits")
    assert not given(OmegaConf.create({}))
    assert not given(OmegaConf.create({"early_exit": {"exits": None}}))
    assert given(OmegaConf.create({"early_exit": {"exits": "/runs/x/export"}}))
    assert [name for name, e in registry().items() if e.default_when(
        OmegaConf.create({"medusa_heads": "/h"}))] == ["small_model", "ngram", "medusa"]


def test_each_trainer_is_its_methods_module_and_a_shim_over_the_one_main():
    """A method that trains holds its `TrainerEntry` beside its registry entry; train/<name>.py
    only names it and its Hydra config."""
    root = Path(methods.__file__).parents[3]
    assert sorted(trainers()) == ["dflash", "draft", "eagle", "early_exit", "medusa", "mtp"]
    for name, trainer in trainers().items():
        shim = (root / "train" / f"{name}.py").read_text()
        assert f'@hydra_entry_point("{trainer.config}")' in shim, name
        assert f'train_method(cfg, "{name}")' in shim and shim.count("\ndef ") == 1, name


def test_a_resume_may_change_each_trainers_report_settings_which_its_config_holds(cfg_of):
    """A trainer's `report_settings` (how its report drafts) join the settings every trainer
    may change on resume; each names a setting of its own config, under its method's section,
    so a renamed setting is not silently left changeable or unchangeable."""
    changeable = methods.resumable_changes()
    assert {"trainer.resume", "eagle.depth", "dflash.tree_nodes",
            "early_exit.confidence_threshold"} <= set(changeable)
    assert not {"eagle.version", "dflash.block_size", "optim"} & set(changeable)
    for name, trainer in trainers().items():
        cfg = cfg_of(trainer.config) if trainer.report_settings else None
        for key in trainer.report_settings:
            section, setting = key.split(".")
            assert section == name and setting in cfg[section], key


def test_the_curve_variants_are_each_trainers_in_order_and_select_a_setting_of_its_config(cfg_of):
    """`methods.curve_variants()` gathers each trainer's `curve_variants` in the trainers'
    `order`; each override sets a setting its trainer's config holds, so a renamed setting
    does not leave a learning curve training the wrong variant."""
    variants = methods.curve_variants()
    assert list(variants) == ["medusa", "eagle1", "eagle2", "eagle3", "peagle", "dflash",
                              "early_exit", "draft", "pard"]
    assert variants["peagle"] == methods.CurveVariant("eagle", ("eagle.version=3",
                                                                 "eagle.parallel=4"))
    for name, variant in filter(lambda item: item[1].overrides, variants.items()):
        cfg = cfg_of(trainers()[variant.trainer].config, *variant.overrides)
        for override in variant.overrides:
            key, value = override.split("=")
            assert OmegaConf.select(cfg, key, default=None) is not None, (name, key)
            assert str(OmegaConf.select(cfg, key)) == value, (name, key)


def test_a_curve_variant_two_trainers_give_is_refused(monkeypatch):
    twin = dataclasses.replace(trainers()["dflash"], curve_variants={"medusa": ()})
    monkeypatch.setattr(methods, "trainers", lambda: {**trainers(), "dflash": twin})
    with pytest.raises(ValueError, match="'medusa' is given by trainers medusa and dflash"):
        methods.curve_variants()


def test_a_trainer_may_measure_by_default_only_its_own_curve_variants():
    """`store_bench` (scripts/bench_store.py's default) names curve variants of its trainer."""
    eagle = trainers()["eagle"]
    assert set(eagle.store_bench) <= set(eagle.curve_variants)
    with pytest.raises(ValueError, match=r"store_bench names \['medusa'\]"):
        dataclasses.replace(eagle, store_bench=("eagle3", "medusa"))


def test_no_draft_model_names_the_methods_that_run_one(monkeypatch):
    """The methods to leave out are those whose entry says `runs_draft_model`, read from the
    registry: a method that starts running one is named without another edit."""
    cfg = OmegaConf.create({"model": {"name": "m", "draft": None}})
    with pytest.raises(ValueError, match="leave small_model and hf_assisted out of methods"):
        methods.draft_model_settings(cfg)
    ngram = dataclasses.replace(registry()["ngram"], runs_draft_model=True)
    monkeypatch.setattr(methods, "registry", lambda: {**registry(), "ngram": ngram})
    with pytest.raises(ValueError, match="leave small_model and ngram and hf_assisted out"):
        methods.draft_model_settings(cfg)
