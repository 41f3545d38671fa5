"""Argument checks every layer shares.

Python counts `True` as the integer 1 and `False` as 0, so `isinstance(x, int)` alone lets a
flag pass for a count; these checks refuse bools wherever a number is asked for. The callers
keep their own messages where a message says more than "an integer >= N" (a range's meaning,
the fix); `check_count` raises the common one.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any


def is_int(value: Any) -> bool:
    """An integer and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float, and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: Any, minimum: int = 1) -> bool:
    """An integer (not a bool) >= minimum: 1 for a count of something, 0 for an id or a size
    that may be empty."""
    return is_int(value) and value >= minimum


def is_int_in(value: Any, allowed: Container[int]) -> bool:
    """An integer (not a bool) in `allowed`: a `range` (token ids: range(vocab_size)) or a
    collection of the values allowed."""
    return is_int(value) and value in allowed


def check_count(name: str, value: Any, minimum: int = 1, owner: str | None = None) -> int:
    """`value` when it is an integer >= minimum, else ValueError
    "<owner>: <name> must be an integer >= <minimum>, got <value!r>" (no owner: no prefix)."""
    if not is_count(value, minimum):
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}{name} must be an integer >= {minimum}, got {value!r}")
    return value
