"""The one error boundary of every entry point (train/, eval/, scripts/).

    @hydra_entry_point("train_medusa")      # a Hydra entry point over conf/train_medusa.yaml
    def main(cfg: DictConfig) -> None: ...

    if __name__ == "__main__":
        main()                               # argparse scripts: exit_on_user_error(main, argv)

An error the user caused (a bad setting, a missing or broken file, a config Hydra cannot
compose) prints `error: ...` as one line and exits with status 2; anything else is a bug and
keeps its traceback. Entry points never wrap their own try/except.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from selfspec.errors import SelfspecError
from selfspec.from_config.common import CONF_DIR

USER_ERRORS = (SelfspecError, ValueError, FileNotFoundError, HydraException,
               OmegaConfBaseException)
USAGE_ERROR = 2  # the exit status of refused input, as argparse uses

T = TypeVar("T")


def exit_on_user_error(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args); a user error prints one line and exits with status 2."""
    try:
        return fn(*args)
    except USER_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None


def hydra_entry_point(config_name: str) -> Callable[[Callable[[DictConfig], Any]],
                                                       Callable[[], Any]]:
    """hydra.main over conf/<config_name>.yaml, with user errors turned into one line: those
    of composing the config (an unknown key or option) and those the task raises."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @functools.wraps(task)  # Hydra unwraps it: the job keeps the entry point's name
        def guarded_task(cfg: DictConfig) -> Any:
            return exit_on_user_error(task, cfg)

        hydra_main = hydra.main(config_path=str(CONF_DIR), config_name=config_name,
                                version_base="1.3")(guarded_task)

        @functools.wraps(task)
        def main() -> Any:
            os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # composition errors reach us raw
            return exit_on_user_error(hydra_main)

        return main

    return decorate


def one_line(exc: BaseException) -> str:
    """The message of exc (and of the config error it wraps, as Hydra shows it) on one line."""
    parts = [str(exc)]
    if isinstance(exc, HydraException) and isinstance(exc.__cause__, OmegaConfBaseException):
        parts.append(str(exc.__cause__))
    return " ".join(" ".join(parts).split()) or type(exc).__name__
