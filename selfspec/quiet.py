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
    """Records below ERROR of these loggers (default: torchao's import) dropped for the block.
    A filter, not a level: torch's logging setup, which the import may run, resets levels."""
    names = loggers or TORCHAO_IMPORT
    for name in names:
        logging.getLogger(name).addFilter(_errors_only)
    try:
        yield
    finally:
        for name in names:
            logging.getLogger(name).removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def import_transformers_models() -> None:
    """Import transformers' modelling code, which imports torchao when it is installed,
    quietly, before a transformers model is built (a peer, a conversion, an export)."""
    with quiet_imports():
        import transformers.modeling_utils  # noqa: F401
