"""What the registry knows of a method (`MethodEntry`), what a run's methods load, once
(`Loaded`), and what its trainer composes (`TrainerEntry`). One module per
method in this package defines its entries (`ENTRIES`) and, for a method that trains, its
trainer (`TRAINER`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.drafters.base import Drafter
from selfspec.from_config.training import Export, ExportDrafters, TrainingRun
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow
from selfspec.measure.passes import Method
from selfspec.model import Transformer
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.rows import TokenRows

T = TypeVar("T")
SHIPPED = "shipped"  # medusa_heads=shipped, ngram.corpus=shipped: what ships with the model


@dataclass
class Loaded:
    """The run's config, its target, and what its methods loaded (heads, a draft model, a
    corpus), each once, by key: methods that share weights (Medusa's heads for medusa and
    ngram+medusa) load them once."""

    cfg: DictConfig
    target: Transformer
    _loaded: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, load: Callable[[], T]) -> T:
        if key not in self._loaded:
            self._loaded[key] = load()
        return self._loaded[key]


def _nothing_to_load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
    return None


def _same_lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]
                  ) -> tuple[int, ...]:
    return lengths


def _on_the_target(loaded: Loaded) -> tuple[Transformer, str]:
    return loaded.target, "plain"


def _nothing_to_check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    return None


def _no_old_keys(cfg: DictConfig) -> None:
    return None


def read_moved_setting(cfg: DictConfig, old: str, new: str) -> None:
    """A setting given under its old key `old`, read into `new` with a warning that names the
    new key (a method's `read_old_keys`)."""
    value = cfg.get(old)
    warnings.warn(f"{old}= is deprecated: use {new}= (read as {new}={value})", FutureWarning,
                  stacklevel=3)
    OmegaConf.update(cfg, new, value, force_add=True)


def never(cfg: DictConfig) -> bool:
    return False


def always(cfg: DictConfig) -> bool:
    return True


def when_set(key: str) -> Callable[[DictConfig], bool]:
    """`default_when` for a method that runs by default once its setting `key` (a dotted
    path: medusa_heads, early_exit.exits) is given."""

    def given(cfg: DictConfig) -> bool:
        return bool(OmegaConf.select(cfg, key))

    return given


@dataclass(frozen=True, kw_only=True)
class MethodEntry:
    """One method, as every entry point sees it (keyword arguments only).

    variants(cfg, for_sweep): the method's rows besides the draft length, read from its
        settings and checked (no weights). for_sweep: with the untrained baselines a sweep shows
        beside them (the n-gram lookup in the context alone, the norm exit); False: for a single
        generation (eval/generate.py), which takes one variant.
    check(cfg, lengths): what else must hold before anything loads (folders exist, a tree fits
        the lengths).
    load(loaded, variants): what its variants need, loaded into `loaded` before the first row
        (default: nothing).
    drafter(loaded, variant, k): our drafter at draft length k; None for a peer that runs
        another library (then `method` builds its decoders).
    verified_on(loaded): the target its drafts are verified on, and its baseline's name (a
        Medusa-2 export verifies on its LoRA-adapted target).
    lengths(cfg, variant, lengths): the draft lengths a variant runs at (Medusa folds those
        beyond its tree, Lookahead those beyond its n-grams).
    default_when(cfg): whether a sweep with methods=null runs it.
    head: its trainable head class, if any; color: its colour in the figures; order: where it
    stands in lists (menus, a sweep's default methods).
    cost_rows: its rows of eval/bench_decode.py's draft costs with random heads, by name.
    runs_draft_model: whether it runs model.draft, a second model (a sweep's dry run plans it).
    read_old_keys(cfg): its settings given under the keys they had before they moved, checked
        and read into their new keys with a warning (eval/generate.py reads them).
    """

    name: str
    summary: str
    variants: Callable[[DictConfig, bool], tuple[Variant, ...]]
    load: Callable[[Loaded, tuple[Variant, ...]], Any] = _nothing_to_load
    drafter: Callable[[Loaded, Variant, int], Drafter] | None = None
    method: Callable[[Loaded, Variant, int], Method] | None = None
    check: Callable[[DictConfig, tuple[int, ...]], None] = _nothing_to_check
    verified_on: Callable[[Loaded], tuple[Transformer, str]] = _on_the_target
    lengths: Callable[[DictConfig, Variant, tuple[int, ...]], tuple[int, ...]] = _same_lengths
    default_when: Callable[[DictConfig], bool] = never
    head: type | None = None
    color: str | None = None
    order: int = 100
    cost_rows: dict[str, CostRow] = field(default_factory=dict)
    runs_draft_model: bool = False
    read_old_keys: Callable[[DictConfig], None] = _no_old_keys

    def __post_init__(self) -> None:
        if (self.drafter is None) == (self.method is None):
            raise ValueError(f"method entry {self.name!r}: give a drafter (ours) or a method "
                             f"(a peer's decoders), exactly one")

    @property
    def ours(self) -> bool:
        """Whether it drafts with one of selfspec's drafters (not another library's loop)."""
        return self.drafter is not None


def one_variant(name: str) -> Callable[[DictConfig, bool], tuple[Variant, ...]]:
    """The variants of a method without settings that make rows: one, named for it."""

    def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[Variant, ...]:
        return (Variant(name),)

    return variants


def head_folder(cfg: DictConfig, key: str) -> Path:
    """The folder of cfg[key] (medusa_heads, eagle_head): a path, or `shipped` for the heads
    that ship with the model, in selfspec/assets/heads/<model.name>/<key>/."""
    if str(cfg[key]) != SHIPPED:
        return Path(str(cfg[key])).expanduser()
    name = str(cfg.model.get("name"))
    folder = Path(str(resources.files("selfspec") / "assets" / "heads" / name / key))
    if not folder.is_dir():
        raise FileNotFoundError(f"{key}={SHIPPED}: none ship for model={name}; give the export "
                                f"folder of a training run (<run>/checkpoints/step_N/export)")
    return folder


def check_head_folder(folder: Path, key: str, trainer: str) -> Path:
    """`folder` when it holds a head export (head_config.json), else an error naming the
    setting `key` and the trainer that writes one."""
    if not (folder / "head_config.json").is_file():
        raise FileNotFoundError(
            f"{key}={folder}: no head_config.json there; point it at an export folder "
            f"of train/{trainer}.py, e.g. outputs/{trainer}/<run>/checkpoints/step_0000200/"
            f"export")
    return folder


def required_head_folder(cfg: DictConfig, key: str, method: str, trainer: str,
                         what: str = "trained heads") -> Path:
    """The head export a method needs (cfg[key]), checked to exist; refused when unset."""
    if not cfg.get(key):
        raise ValueError(f"method {method} needs {what}: set {key}=/path/to/run/"
                         f"checkpoints/step_N/export (an export folder written by "
                         f"train/{trainer}.py)")
    return check_head_folder(head_folder(cfg, key), key, trainer)


# ---- trainers ------------------------------------------------------------------------------

def _no_streams(module: Any) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True, kw_only=True)
class TrainerEntry:
    """One method's trainer, train/<name>.py over conf/<config>.yaml, as the one training `main`
    (`from_config.train_method`) composes it (keyword arguments only).

    check(cfg): every setting checked from the config alone, before any weights load.
    dry_run(cfg): the memory plan of the target and the trainable module, on meta tensors.
    module(cfg, target, train): the fresh trainable module, sized for the target (a draft
        vocabulary or a mask token read from the training rows `train`).
    streams(module): the target's residual streams it reads (a feature store must hold them;
        default none: the last hidden state only).
    objective(run, features): what `training.loop.fit` trains; features: the target's states
        read from a feature store (None: the target runs at every step).
    exporter(run, objective): the function that writes an export folder from a training state.
    drafters(cfg, target, export): the drafters an export makes, each with the target it
        verifies on (the judge's, `from_config.training.tau_judge`, and the report's).
    report(cfg, export, metrics, tracker): tau and speedup of the export on held-out prompts.
    replayable(cfg): whether the judge may replay its drafts over recorded answers (a drafter
        that drafts in the target's own cache, or a target the training changes, may not).
    report_settings: its settings (dotted keys) that change only how the judge and the report
        draft, not what the module learns: a resumed run may change them.
    store_layers: names `store.layers` may give (the feature store command's) for the residual
        streams its module reads by default, each the layers for a target of that many layers.
    curve_variants: the variants train/learning_curves.py and train/data_curves.py may train,
        by name (medusa, eagle3, pard), each the overrides of its config that select it.
    store_bench: its curve variants scripts/bench_store.py measures when not told which.
    order: where its curve variants stand among every trainer's.
    """

    name: str
    config: str
    check: Callable[[DictConfig], Any]
    dry_run: Callable[[DictConfig], None]
    module: Callable[[DictConfig, Transformer, TokenRows], Any]
    objective: Callable[[TrainingRun, FeatureSource | None], torch.nn.Module]
    exporter: Callable[[TrainingRun, torch.nn.Module], Export]
    drafters: Callable[[DictConfig, Transformer, Path], ExportDrafters]
    report: Callable[[DictConfig, Path, dict, Tracker], None]
    streams: Callable[[Any], Iterable[int]] = _no_streams
    replayable: Callable[[DictConfig], bool] = always
    report_settings: tuple[str, ...] = ()
    store_layers: dict[str, Callable[[int], Iterable[int]]] = field(default_factory=dict)
    curve_variants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    store_bench: tuple[str, ...] = ()
    order: int = 100

    def __post_init__(self) -> None:
        unknown = set(self.store_bench) - set(self.curve_variants)
        if unknown:
            raise ValueError(f"trainer {self.name!r}: store_bench names {sorted(unknown)}, "
                             f"not among its curve_variants {list(self.curve_variants)}")


@dataclass(frozen=True)
class CurveVariant:
    """One line of the learning and data curves: its trainer (train/<trainer>.py) and the
    overrides that select it."""

    trainer: str
    overrides: tuple[str, ...]
