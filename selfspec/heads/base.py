"""What every trainable draft head is: a module built from its config dataclass, `cls(config)`.

`selfspec.heads.io` saves a head under its class name and finds the class again among the
subclasses of `Head`, so a new head needs no entry in any table: defining it is enough.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn


class Head(nn.Module):
    """A trainable draft head. Subclasses name their config dataclass in `config_class` and
    take an instance of it as their only constructor argument."""

    config_class: ClassVar[type]


def head_types() -> dict[str, type[Head]]:
    """Every head class defined so far, by class name (subclasses of subclasses too)."""
    found, todo = {}, list(Head.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found
