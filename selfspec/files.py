"""Files that other processes may read while they are written."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> None:
    """Write to a file of this process's own, then rename it: a reader (another run, another
    rank) sees the whole file or none, and two writers never write into one file."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)
