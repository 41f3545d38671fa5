"""Layer skipping (`LayerSkipDrafter`): the target drafts with a set of its own layers skipped
(Draft & Verify, SWIFT), in its own KV cache; verification runs every layer. Nothing to train
or load.

Rows: layer_skip/skip{a-b,c} for every skip set of layer_skip.skip_layers (null: every other
middle layer of the target) when not adaptive, and layer_skip/adaptive{n} (n: the size of the
searched sets) when adaptive, with /from{a-b,c} naming the start set when the config gave one.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig

from selfspec.checks import is_count, is_int
from selfspec.drafters.layer_skip import (
    LayerSkipDrafter,
    check_skip_layers,
    every_other_middle_layer,
)
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.from_config.models import model_config
from selfspec.measure.grid import Variant

SETTING = "layer_skip.skip_layers"


@dataclass(frozen=True)
class LayerSkipVariant(Variant):
    method: str = "layer_skip"
    skip_layers: tuple[int, ...] = ()  # sorted; adaptive: the search's start set
    adaptive: bool = False
    given: bool = True  # the config named the set (False: the default, every other middle)

    def label(self) -> str:
        layers = f"{{{layer_ranges(self.skip_layers)}}}"
        if not self.adaptive:
            return f"{self.method}/skip{layers}"
        start = f"/from{layers}" if self.given else ""
        return f"{self.method}/adaptive{{{len(self.skip_layers)}}}{start}"


def layer_ranges(layers: tuple[int, ...]) -> str:
    """Sorted layer ids, runs of three or more as ranges: (1, 2, 3, 5, 6) -> '1-3,5,6'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[LayerSkipVariant, ...]:
    """A row per skip set x adaptive value, the sets checked against the target's depth (its
    config, no weights). for_sweep makes no difference: no comparison rows are added."""
    num_layers = model_config(cfg.model).num_layers
    group = cfg.get("layer_skip", {})
    raw = group.get("adaptive")
    modes = [False] if raw is None else as_list(raw)
    if not modes or not all(isinstance(m, bool) for m in modes):
        raise ValueError(f"layer_skip.adaptive: give true or false (a list: a row each), "
                         f"got {modes}")
    rows = []
    for given in skip_sets(group.get("skip_layers")):
        for adaptive in modes:
            layers = (every_other_middle_layer(num_layers) if given is None
                      else check_skip_layers(given, num_layers, adaptive, SETTING))
            rows.append(LayerSkipVariant(skip_layers=tuple(sorted(layers)), adaptive=adaptive,
                                         given=given is not None))
    return tuple(dict.fromkeys(rows))


def skip_sets(raw) -> list[list[int] | None]:
    """layer_skip.skip_layers as skip sets: null (one row, the default set), one set ([2, 4])
    or a list of sets ([[2, 4], [3, 5]], null among them for the default)."""
    if raw is None:
        return [None]
    values = as_list(raw)
    if values and all(map(is_int, values)):
        return [values]
    if not values or not all(v is None or isinstance(v, ListConfig | list) for v in values):
        raise ValueError(f"{SETTING}: give null (every other middle layer), a set of layer ids "
                         f"or a list of sets, e.g. {SETTING}=[[2,4],[3,5]], got {raw}")
    return [None if v is None else list(v) for v in values]


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """The skip sets (via the variants) and the search's settings, from the config alone."""
    variants(cfg)
    group = cfg.get("layer_skip", {})
    window, seed = group.get("window", 8), group.get("seed", 0)
    if not is_count(window):
        raise ValueError(f"layer_skip.window must be an integer >= 1 (steps per trial of the "
                         f"adaptive search), got {window!r}")
    if not is_int(seed):
        raise ValueError(f"layer_skip.seed must be an integer, got {seed!r}")


def drafter(loaded: Loaded, variant: LayerSkipVariant, k: int) -> LayerSkipDrafter:
    group = loaded.cfg.get("layer_skip", {})
    return LayerSkipDrafter(variant.skip_layers, k, adaptive=variant.adaptive,
                            window=int(group.get("window", 8)), seed=int(group.get("seed", 0)))


ENTRIES = (MethodEntry(
    name="layer_skip",
    summary="the target itself with a set of its layers skipped, in its own KV cache",
    variants=variants, drafter=drafter, check=check, color="tab:cyan", order=55),)
