"""Early exit (`EarlyExitDrafter`): the target's own first E layers draft, through an exit at
layer E, and verification resumes from layer E. The norm exit (the target's final norm and LM
head on layer E's residual) needs no training; train/early_exit.py trains adapter exits.

Rows: early_exit/E{E}/{kind}/stop{t} (or nostop) for every early_exit.exit_layers x the norm
exit (and the trained adapter when early_exit.exits names a train/early_exit.py export) x every
early_exit.confidence_threshold; a single generation takes the adapter when one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from selfspec.drafters import EarlyExitDrafter
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import Loaded, MethodEntry, check_head_folder, when_set
from selfspec.from_config.models import model_config
from selfspec.heads.early_exit import ExitConfig, ExitHead, check_exit_layer
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.model import Transformer

NO_STOP = "nostop"
KINDS = ("norm", "adapter")


@dataclass(frozen=True)
class EarlyExitVariant(Variant):
    method: str = "early_exit"
    exit_layer: int = 1
    kind: str = "norm"  # norm: the target's final norm on layer E; adapter: a trained exit
    threshold: float | None = None  # end a draft below this top-1 probability (None: never)

    def label(self) -> str:
        stop = NO_STOP if self.threshold is None else f"stop{self.threshold:g}"
        return f"{self.method}/E{self.exit_layer}/{self.kind}/{stop}"


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[EarlyExitVariant, ...]:
    layers = early_exit_layers(cfg, model_config(cfg.model).num_layers)
    kinds = KINDS if cfg.early_exit.get("exits") else KINDS[:1]
    if not for_sweep and len(kinds) > 1:
        kinds = KINDS[1:]  # a trained exit was given: the norm exit is only its comparison
    return tuple(EarlyExitVariant(exit_layer=e, kind=kind, threshold=t) for e in layers
                 for kind in kinds for t in early_exit_thresholds(cfg))


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """One E{E} export folder per exit layer, when early_exit.exits is given."""
    exits = cfg.early_exit.get("exits")
    if exits:
        for e in early_exit_layers(cfg, model_config(cfg.model).num_layers):
            check_head_folder(Path(str(exits)).expanduser() / f"E{e}", "early_exit.exits",
                              "early_exit")


def exit_head(loaded: Loaded, variant: EarlyExitVariant) -> ExitHead:
    """The exit of a variant, built or loaded once: the norm exit, or the adapter of the
    early_exit.exits export at E (refused for another target or another E)."""
    e, target = variant.exit_layer, loaded.target
    if variant.kind == "norm":
        return loaded.once(f"exit/E{e}/norm", lambda: norm_exit(target, e))
    folder = Path(str(loaded.cfg.early_exit.exits)).expanduser() / f"E{e}"
    return loaded.once(f"exit/E{e}/adapter", lambda: load_early_exit(folder, target, e))


def load(loaded: Loaded, chosen: tuple[EarlyExitVariant, ...]) -> None:
    for variant in chosen:
        exit_head(loaded, variant)


def drafter(loaded: Loaded, variant: EarlyExitVariant, k: int) -> EarlyExitDrafter:
    return EarlyExitDrafter(exit_head(loaded, variant), k, variant.threshold)


ENTRIES = (MethodEntry(
    name="early_exit",
    summary="the target's first E layers through an exit, verification resuming at E",
    variants=variants, load=load, drafter=drafter, check=check,
    default_when=when_set("early_exit.exits"), head=ExitHead, color="tab:pink", order=50),)


# ---- settings and exits ----------------------------------------------------------------------


def early_exit_layers(cfg: DictConfig, num_layers: int) -> tuple[int, ...]:
    """cfg.early_exit.exit_layers (one E or a list), each in [1, num_layers), no repeats."""
    values = tuple(as_list(cfg.early_exit.exit_layers))
    if not values or len(set(values)) != len(values):
        raise ValueError(f"early_exit.exit_layers must list distinct layers E, got "
                         f"{list(values)}: e.g. early_exit.exit_layers=[2,4,6]")
    for value in values:
        try:
            check_exit_layer(value, num_layers)
        except ValueError as error:
            raise ValueError(f"early_exit.exit_layers: {error} for this {num_layers}-layer "
                             f"target") from None
    return values


def early_exit_thresholds(cfg: DictConfig) -> tuple[float | None, ...]:
    """cfg.early_exit.confidence_threshold: null (no stop), a number in (0, 1), or a list of
    them (a sweep axis)."""
    raw = cfg.early_exit.get("confidence_threshold")
    values = (None,) if raw is None else tuple(as_list(raw))
    return tuple(check_confidence_threshold("early_exit", v) for v in values)


def norm_exit(target: Transformer, exit_layer: int) -> ExitHead:
    """The untrained baseline exit at layer E: the target's final norm and LM head."""
    return ExitHead(ExitConfig.for_target(target.config, exit_layer, "norm"))


def load_early_exit(folder: str | Path, target: Transformer,
                    exit_layer: int | None = None) -> ExitHead:
    """An exit head of a train/early_exit.py export (refused when trained for another target,
    or, with exit_layer, for another E)."""
    loaded = load_head(folder, ExitHead, ExitConfig, target=target)
    if exit_layer is not None and loaded.exit_layer != exit_layer:
        raise ValueError(f"{folder}: the exit head exits at layer E={loaded.exit_layer}, not "
                         f"E={exit_layer}; load the export of E={exit_layer} "
                         f"(<run>/checkpoints/step_N/export/E{exit_layer})")
    return loaded
