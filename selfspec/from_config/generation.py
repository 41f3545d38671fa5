"""eval/generate.py's drafter: any method of the registry by name (`drafter=`), at one draft
length (`num_draft_tokens=`), with the one variant its settings describe."""

from __future__ import annotations

from typing import NamedTuple

from omegaconf import DictConfig

from selfspec.checks import check_count
from selfspec.decode import GenerationSettings
from selfspec.drafters import Drafter
from selfspec.from_config.common import device, sampling_params
from selfspec.from_config.methods import Loaded, MethodEntry, entry, registry
from selfspec.from_config.models import compile_steps, resolve_model_path
from selfspec.measure.grid import Variant
from selfspec.model import Transformer

PLAIN = "none"  # drafter=none: plain decoding only


class DrafterChoice(NamedTuple):
    """cfg.drafter's method (None: plain decoding), its one variant and its draft length."""

    method: MethodEntry | None
    variant: Variant | None
    k: int


def generation_settings(cfg: DictConfig) -> tuple[GenerationSettings, DrafterChoice]:
    """eval/generate.py's settings and its drafter choice, checked with its device and target
    folder before any model loads."""
    device(cfg)
    resolve_model_path(cfg.model)
    compile_steps(cfg)
    choice = drafter_choice(cfg)
    return GenerationSettings(max_new_tokens=cfg.max_new_tokens,
                              sampling=sampling_params(cfg.sampling), seed=int(cfg.seed)), choice


def drafter_choice(cfg: DictConfig) -> DrafterChoice:
    """cfg.drafter's method, the one variant its settings describe, and the draft length it
    runs at (cfg.num_draft_tokens; Medusa: at most its tree's depth), checked; the method's
    weights must be on disk. drafter=none: (None, None, k)."""
    renamed_settings(cfg)
    name, k = str(cfg.drafter), cfg.num_draft_tokens
    ours = [n for n, e in registry().items() if e.ours]
    if name != PLAIN and name not in ours:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(ours)}, {PLAIN}")
    check_count("num_draft_tokens", k)
    if name == PLAIN:
        return DrafterChoice(None, None, k)
    method = entry(name)
    method.check(cfg, (k,))
    variants = method.variants(cfg, False)
    if len(variants) != 1:
        raise ValueError(f"drafter={name}: its settings describe {len(variants)} rows "
                         f"({', '.join(v.label() for v in variants)}); give one value per "
                         f"setting here (lists are for eval/sweep.py)")
    return DrafterChoice(method, variants[0], method.lengths(cfg, variants[0], (k,))[0])


def renamed_settings(cfg: DictConfig) -> None:
    """Read the settings given under their old keys into the new ones, with a warning that
    names the new key: each method's `read_old_keys`."""
    for method in registry().values():
        method.read_old_keys(cfg)


def build_drafter(cfg: DictConfig, target: Transformer) -> Drafter | None:
    """The drafter named by cfg.drafter; None = plain decoding."""
    return drafter_and_target(cfg, target)[0]


def drafter_and_target(cfg: DictConfig, target: Transformer, choice: DrafterChoice | None = None
                       ) -> tuple[Drafter | None, Transformer]:
    """The drafter named by cfg.drafter (None = plain decoding) and the target it verifies on
    (a Medusa-2 export: its LoRA-adapted copy of `target`); choice: cfg's `drafter_choice`,
    when already made (`generation_settings`)."""
    method, variant, k = drafter_choice(cfg) if choice is None else choice
    if method is None:
        return None, target
    loaded = Loaded(cfg, target)
    method.load(loaded, (variant,))
    return method.drafter(loaded, variant, k), method.verified_on(loaded)[0]
