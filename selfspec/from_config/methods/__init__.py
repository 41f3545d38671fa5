"""The method registry: one module per method, each defining `ENTRIES` (its `MethodEntry`s) and,
for a method that trains, `TRAINER` (its `TrainerEntry`), found by looking through this package,
so adding a method adds a module here and touches no list. Every entry point (eval/generate.py,
eval/sweep.py, eval/lossless.py, eval/replay.py, train/<method>.py) takes every method through it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable
from types import ModuleType

from omegaconf import DictConfig

from selfspec.from_config.methods.entry import CurveVariant, Loaded, MethodEntry, TrainerEntry
from selfspec.from_config.models import draft_model_config
from selfspec.from_config.training import RESUMABLE_CHANGES
from selfspec.measure.method_costs import CostRow

__all__ = ["CurveVariant", "Loaded", "MethodEntry", "TrainerEntry", "cost_rows",
           "curve_variants", "draft_model_methods", "draft_model_settings", "entry",
           "method_names", "registry", "resumable_changes", "store_layer_names", "trainer",
           "trainers"]


@functools.cache
def _modules() -> tuple[ModuleType, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "entry")
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in names)


@functools.cache
def registry() -> dict[str, MethodEntry]:
    """Every method by name, in the order of their `order`."""
    entries = [e for module in _modules() for e in module.ENTRIES]
    entries.sort(key=lambda e: (e.order, e.name))
    return {e.name: e for e in entries}


def cost_rows() -> dict[str, CostRow]:
    """eval/bench_decode.py's draft-cost rows of every method, by name."""
    return {name: row for e in registry().values() for name, row in e.cost_rows.items()}


def method_names() -> tuple[str, ...]:
    return tuple(registry())


def entry(name: str) -> MethodEntry:
    """The entry of method `name`, or an error that lists the methods."""
    methods = registry()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(methods)}")
    return methods[name]


def draft_model_methods() -> tuple[str, ...]:
    """The methods that run model.draft (each entry's `runs_draft_model`), in their order."""
    return tuple(name for name, e in registry().items() if e.runs_draft_model)


def draft_model_settings(cfg: DictConfig) -> DictConfig:
    """model.draft's settings, or an error naming the methods that run it, for a sweep to
    leave out. Read at call time: the modules of those methods call it, after the registry
    found them."""
    return draft_model_config(cfg, otherwise=f"choose another method (e.g. drafter=ngram; in "
                              f"a sweep, leave {' and '.join(draft_model_methods())} out of "
                              f"methods)")


@functools.cache
def trainers() -> dict[str, TrainerEntry]:
    """Every trainer by name (train/<name>.py), from the modules of the methods that train."""
    found = (getattr(module, "TRAINER", None) for module in _modules())
    return {t.name: t for t in sorted(filter(None, found), key=lambda t: t.name)}


def trainer(name: str) -> TrainerEntry:
    """The trainer `name`, or an error that lists the trainers."""
    found = trainers()
    if name not in found:
        raise ValueError(f"unknown trainer {name!r}: choose from {', '.join(found)}")
    return found[name]


def resumable_changes() -> tuple[str, ...]:
    """The settings a resumed run may change: those every trainer shares
    (`training.RESUMABLE_CHANGES`) and every trainer's `report_settings`."""
    return RESUMABLE_CHANGES + tuple(s for t in trainers().values() for s in t.report_settings)


def store_layer_names() -> dict[str, Callable[[int], Iterable[int]]]:
    """Every name `store.layers` may give for a trainer's default residual streams (its
    `store_layers`), each the layers for a target of that many layers, sorted by name."""
    found = {name: layers for t in trainers().values() for name, layers in t.store_layers.items()}
    return dict(sorted(found.items()))


def curve_variants() -> dict[str, CurveVariant]:
    """Every variant the learning and data curves may train (each trainer's `curve_variants`),
    by name, the trainers in their `order`; a name two trainers give is refused."""
    found: dict[str, CurveVariant] = {}
    for t in sorted(trainers().values(), key=lambda t: (t.order, t.name)):
        for name, overrides in t.curve_variants.items():
            if name in found:
                raise ValueError(f"curve variant {name!r} is given by trainers "
                                 f"{found[name].trainer} and {t.name}: rename one")
            found[name] = CurveVariant(t.name, tuple(overrides))
    return found
