"""The method registry: one module per method, each defining `ENTRIES` (its `MethodEntry`s),
found by looking through this package, so adding a method adds a module here and touches no
list. Every entry point (eval/generate.py, eval/sweep.py, eval/lossless.py, eval/replay.py)
takes every method through it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from selfspec.from_config.methods.entry import Loaded, MethodEntry

__all__ = ["Loaded", "MethodEntry", "entry", "method_names", "registry"]


@functools.cache
def registry() -> dict[str, MethodEntry]:
    """Every method by name, in the order of their `order`."""
    entries: list[MethodEntry] = []
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "entry"):
        entries += importlib.import_module(f"{__name__}.{module}").ENTRIES
    entries.sort(key=lambda e: (e.order, e.name))
    return {e.name: e for e in entries}


def method_names() -> tuple[str, ...]:
    return tuple(registry())


def entry(name: str) -> MethodEntry:
    """The entry of method `name`, or an error that lists the methods."""
    methods = registry()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}: choose from {', '.join(methods)}")
    return methods[name]
