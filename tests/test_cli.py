"""The entry points' boundary (cli.py): bugs keep tracebacks, config errors read as one line."""

import pytest

from selfspec.cli import one_line


def test_a_bug_keeps_its_traceback(monkeypatch):
    from selfspec.cli import exit_on_user_error

    def buggy():
        return [][1]

    with pytest.raises(IndexError):
        exit_on_user_error(buggy)


def test_one_line_joins_a_message_and_the_config_error_hydra_wraps():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigKeyError

    try:
        try:
            raise ConfigKeyError("Key 'x' is not in struct")
        except ConfigKeyError as cause:
            raise ConfigCompositionException("Could not override 'x'.\nUse +x=1") from cause
    except ConfigCompositionException as exc:
        assert one_line(exc) == "Could not override 'x'. Use +x=1 Key 'x' is not in struct"
