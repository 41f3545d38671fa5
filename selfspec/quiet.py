"""Third-party noise, silenced where selfspec imports the package that makes it.

With torchao installed (the quantized copy's dependency), importing peft or transformers'
training utilities imports torchao too, which on a CPU machine logs a warning for each CUDA
library of its wheel it cannot load, and torch one for each deprecated pytree registration.
None of it concerns the run, so those imports go through `quiet_imports`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

TORCHAO_IMPORT = ("torchao", "torch.utils._pytree")  # the loggers torchao's import warns on


@contextmanager
def quiet_imports(*loggers: str) -> Iterator[None]:
    """Records below ERROR of these loggers and their children (default: torchao's import)
    dropped for the block: by level, which children inherit, and by a filter, which holds
    when torch's logging setup, run by the import, resets the level."""
    names = loggers or TORCHAO_IMPORT
    saved = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger(name).addFilter(_errors_only)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def import_transformers_models() -> None:
    """Import transformers' modelling code, which imports torchao when it is installed,
    quietly, before a transformers model is built (a peer, a conversion, an export)."""
    with quiet_imports():
        import transformers.modeling_utils  # noqa: F401
