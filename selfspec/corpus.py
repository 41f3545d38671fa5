"""The offline corpus: the running interpreter's own standard-library source, split by file.

The split is the single source of truth for everything that trains or measures on the stdlib
(training rows, self-distillation prompts, held-out evaluation prompts, `scripts/build_tiny.py`,
`scripts/heldout_loss.py`): a file is held out when the sha256 of its relative path falls in a
fixed bucket, so the split never depends on the order files are found in and a file stays on
its side when others are added or removed.

Test folders (``test/``, ``tests/``, ``idle_test/``) and ``site-packages`` are left out.
The stdlib differs between Python versions: ``stdlib_manifest_sha256`` pins what was used.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout", "all"]

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
HELDOUT_BUCKETS = 20  # 1 bucket in 20: ~5% of the files are held out


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter (not of a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _relative_py_files(root: Path) -> list[str]:
    """Every ``.py`` under root outside the excluded folders, as sorted posix paths."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def is_heldout(relative_path: str) -> bool:
    """Deterministic by-file split: hash of the relative posix path, never of the content."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_BUCKETS == 0


def stdlib_files(split: Split = "train", root: Path | None = None) -> list[Path]:
    """Sorted absolute paths of the stdlib ``.py`` files on one side of the split."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = root or stdlib_root()
    rels = _relative_py_files(root)
    if not rels:
        raise FileNotFoundError(f"no .py files under {root}: is the stdlib source installed?")
    if split != "all":
        rels = [r for r in rels if is_heldout(r) == (split == "heldout")]
    return [root / r for r in rels]


def stdlib_manifest_sha256(split: Split = "all", root: Path | None = None) -> str:
    """sha256 over 'relative path, tab, sha256 of content' lines: pins paths AND contents."""
    root = root or stdlib_root()
    outer = hashlib.sha256()
    for path in stdlib_files(split, root):
        inner = hashlib.sha256(path.read_bytes()).hexdigest()
        outer.update(f"{path.relative_to(root).as_posix()}\t{inner}\n".encode())
    return outer.hexdigest()


def read_source(path: Path) -> str:
    """A source file as text; the stdlib is utf-8 (PEP 3120), newlines kept as they are."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()
