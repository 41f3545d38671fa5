"""Files that other processes may read while they are written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PARTIAL = ".partial"  # the suffix of what a process is still writing: <name>.<pid>.partial


def partial_path(path: str | Path) -> Path:
    """This process's own file (or folder) to write before renaming it to `path`."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}{PARTIAL}")


def write_atomically(path: str | Path, text: str) -> None:
    """Write to a file of this process's own, then rename it: a reader (another run, another
    rank) sees the whole file or none, and two writers never write into one file."""
    partial = partial_path(path)
    partial.write_text(text)
    os.replace(partial, path)


def writer_pid(partial: Path) -> int | None:
    """The process id in a partial's name (<name>.<pid>.partial), None if it has none."""
    pid = partial.name.removesuffix(PARTIAL).rpartition(".")[2]
    return int(pid) if partial.name.endswith(PARTIAL) and pid.isdigit() else None


def remove_abandoned_partials(folder: Path, prefix: str = "") -> None:
    """Delete the partial files and folders in `folder` whose name starts with `prefix` and
    whose writer is gone (killed midway); those of a process still running are kept."""
    for partial in folder.glob(f"{prefix}*{PARTIAL}"):
        pid = writer_pid(partial)
        if pid is not None and not process_exists(pid):
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)


def process_exists(pid: int) -> bool:
    """Whether a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
