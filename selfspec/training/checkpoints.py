"""Training checkpoints: what a run saves to resume, how a finished checkpoint is told from one
cut short, and the config a run folder was started with.

A checkpoint holds the trainable parameters, the optimizer and scheduler states and the RNG,
never the frozen target. Its COMPLETE marker is written last and lists every file with its
size, so an interrupted save, or a file damaged later, is never taken for a finished one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from selfspec.errors import SelfspecError
from selfspec.files import write_atomically

CHECKPOINT_PREFIX = "step_"
# Written last, listing every file of the checkpoint with its size: a checkpoint without it was
# interrupted while saving, one whose files differ from it was cut short or damaged later.
COMPLETE_MARKER = "COMPLETE"
RUN_CONFIG = "run_config.json"  # the resolved config a run folder was started with
log = logging.getLogger(__name__)


def record_run_config(
    run_dir: str | Path, config: dict, *, resume: bool, may_change: tuple[str, ...] = ()
) -> None:
    """Keep the resolved config a run folder was started with (main process); on resume,
    refuse a config that differs from it outside `may_change` (dotted keys or prefixes of
    settings that do not shape the weights or the optimizer), naming each key and both values.
    """
    check_fresh_start(run_dir, resume)
    path, text = Path(run_dir) / RUN_CONFIG, _config_text(config)
    if resume and path.is_file():
        changes = config_changes(run_dir, config, may_change)
        if changes:
            raise SelfspecError(
                f"trainer.resume=true: {run_dir} was trained with another config ({changes}); "
                f"resume with the run's values, or start a new run folder")
        return
    if int(os.environ.get("RANK", "0")) == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)


def check_fresh_start(run_dir: str | Path, resume: bool) -> None:
    """A run that does not resume may not start in a folder that holds another run's
    checkpoints: their steps would mix with its own, and a resume after an interruption would
    load the other run's newest step (checked before the folder's config is kept, which the
    other run's resume still needs)."""
    checkpoints = Path(run_dir) / "checkpoints"
    if not resume and latest_checkpoint(checkpoints) is not None:
        raise SelfspecError(
            f"{checkpoints} holds an earlier run's checkpoints: resume it with "
            f"trainer.resume=true, or train into an empty folder (hydra.run.dir=...)")


def config_changes(run_dir: str | Path, config: dict, may_change: tuple[str, ...] = ()) -> str:
    """How `config` differs from the one run_dir's run was started with, outside may_change:
    "key: <the run's value> in the run, <config's> now; ..." ("" when it does not). A setting
    only one of them has came or went with the code between the two (a run started before a
    setting existed ran as its default does): logged, not counted."""
    saved, now = (_flatten(json.loads(t)) for t in ((Path(run_dir) / RUN_CONFIG).read_text(),
                                                    _config_text(config)))
    differ = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k]
                    and not any(k == m or k.startswith(m + ".") for m in may_change))
    if one_side := sorted(saved.keys() ^ now.keys()):
        log.warning("%s: settings the run's config and this one do not share (added or "
                    "removed since it started), taken as they are now: %s", run_dir,
                    ", ".join(f"{k}={now.get(k, '<removed>')!r}" for k in one_side))
    return "; ".join(f"{k}: {saved[k]!r} in the run, {now[k]!r} now" for k in differ)


def _config_text(config: dict) -> str:
    return json.dumps(config, indent=1, sort_keys=True, default=str)


def _flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        flat |= _flatten(value, name + ".") if isinstance(value, dict) else {name: value}
    return flat



def save_checkpoint(model, accelerator, checkpoints: Path, step, trainable, settings,
                    export) -> Path:
    """Save the state needed to resume, then export the trainable weights, then mark complete."""
    folder = checkpoints / f"{CHECKPOINT_PREFIX}{step:07d}"
    kwargs = {"exclude_frozen_parameters": True} if is_deepspeed(accelerator) else {}
    if accelerator.is_main_process and folder.exists():  # a damaged one a resume skipped
        shutil.rmtree(folder)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(folder), **kwargs)
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 partitions; on every rank
    accelerator.wait_for_everyone()  # every rank's shard is written before the manifest
    if accelerator.is_main_process:
        if export is not None:
            export({k: v for k, v in state.items() if k in trainable}, folder / "export")
        _mark_complete(folder, step)
        _prune(checkpoints, settings.keep_checkpoints)
    accelerator.wait_for_everyone()
    return folder


def resume_checkpoint(accelerator: Accelerator, checkpoints: Path) -> int:
    """Load the last complete checkpoint; returns its step (0 when there is none)."""
    latest = latest_checkpoint(checkpoints, warn=accelerator.is_main_process)
    if latest is None:
        return 0
    if is_deepspeed(accelerator):
        accelerator.load_state(str(latest), load_module_strict=False)
    else:
        accelerator.load_state(str(latest), strict=False)
    return int(latest.name.removeprefix(CHECKPOINT_PREFIX))


def latest_checkpoint(checkpoints: Path, *, warn: bool = False) -> Path | None:
    """The newest complete checkpoint; with warn, say why each newer one is skipped."""
    for folder in sorted(checkpoints.glob(f"{CHECKPOINT_PREFIX}*"), reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        if warn:
            log.warning("skipping checkpoint %s: %s; resuming from an earlier one", folder,
                        problem)
    return None


def _mark_complete(folder: Path, step: int) -> None:
    files = {str(f.relative_to(folder)): f.stat().st_size
             for f in sorted(folder.rglob("*")) if f.is_file()}
    write_atomically(folder / COMPLETE_MARKER, json.dumps({"step": step, "files": files}))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (None: it is complete)."""
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return "it was interrupted while saving (no COMPLETE marker)"
    try:
        manifest = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return "its COMPLETE marker is unreadable"
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}  # older: a step
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is cut short or damaged ({path.stat().st_size} of {size} bytes)"
    return None


def _prune(checkpoints: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and any incomplete older ones)."""
    folders = sorted(checkpoints.glob(f"{CHECKPOINT_PREFIX}*"))
    complete = [f for f in folders if checkpoint_problem(f) is None]
    for folder in folders:
        if folder not in complete[-keep:] and folder < complete[-1]:
            shutil.rmtree(folder, ignore_errors=True)


def drop_frozen_weights_from_checkpoints(accelerator: Accelerator, trainable: set[str]) -> None:
    """Checkpoints hold the trainable weights only: the frozen target is reloaded from its
    own folder (for a 70B target, saving it at every checkpoint would dwarf the head)."""

    def keep_trainable(models, weights, output_dir) -> None:
        for state in weights:
            for name in [n for n in state if n not in trainable]:
                del state[name]

    accelerator.register_save_state_pre_hook(keep_trainable)


def is_deepspeed(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED
