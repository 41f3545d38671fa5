"""What registry entries share (from_config/methods/entry.py): keyword-only entries, shipped
head folders, methods run by default once their setting is given."""

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec import from_config
from selfspec.from_config import methods
from selfspec.from_config.methods import MethodEntry, registry
from selfspec.from_config.methods.entry import when_set


def test_heads_that_ship_are_found_by_the_models_name(tmp_path):
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "medusa_heads": "shipped",
                            "eagle_head": str(tmp_path)})
    assert from_config.head_folder(cfg, "eagle_head") == tmp_path  # a path is a path
    with pytest.raises(FileNotFoundError, match="medusa_heads=shipped: none ship for model=tiny"):
        from_config.head_folder(cfg, "medusa_heads")


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


def test_the_registry_modules_hold_entries_not_trainers():
    """Trainer composition (objectives, the fit loop) lives in from_config/trainers.py."""
    folder = Path(methods.__file__).parent
    for module in folder.glob("*.py"):
        imported = {node.module for node in ast.walk(ast.parse(module.read_text()))
                    if isinstance(node, ast.ImportFrom)}
        assert not imported & {"selfspec.training.objectives", "selfspec.training.loop"}, module
