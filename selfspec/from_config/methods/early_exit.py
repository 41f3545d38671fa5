"""Early exit (`EarlyExitDrafter`): the target's own first E layers draft, through an exit at
layer E, and verification resumes from layer E. The norm exit (the target's final norm and LM
head on layer E's residual) needs no training; train/early_exit.py trains adapter exits.

Rows: early_exit/E{E}/{kind}/stop{t} (or nostop) for every early_exit.exit_layers x the norm
exit (and the trained adapter when early_exit.exits names a train/early_exit.py export) x every
early_exit.confidence_threshold; a single generation takes the adapter when one is given.

Trainer (train/early_exit.py, conf/train_early_exit.yaml): fresh adapter exits at every
early_exit.exit_layers, trained together on the frozen target; the export holds one head
folder per exit (E{E}/); the judge and the report draft early_exit.num_draft_tokens tokens with
the first early_exit.confidence_threshold, the report beside the norm exit at each E.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from selfspec.checks import is_count
from selfspec.drafters import EarlyExitDrafter
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config import training
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    TrainerEntry,
    check_head_folder,
    never,
    when_set,
)
from selfspec.from_config.models import load_target, model_config, model_plan
from selfspec.heads.base import LossOutput
from selfspec.heads.early_exit import ExitConfig, ExitHead, check_exit_layer, exit_loss
from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow, TreeChoices
from selfspec.model import Transformer
from selfspec.model.plan import trainable_line
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.loop import state_part
from selfspec.training.objectives import feature_source, freeze, frozen_outputs, law_objective

# ---- objective -------------------------------------------------------------------------------


class EarlyExitObjective(nn.Module):
    """Early exits at several layers E of the frozen target, trained together from one target
    forward (so that a sweep can pick E): each exit reads the residual stream after its layer
    and learns the target's final law (`exit_loss`: by `objective`, plus hard_weight x
    cross-entropy to the tokens). The loss is the mean over exits; metrics are per exit,
    `exit/E{E}_*`. features: the target's states read from elsewhere (a feature store holding
    the exit layers) instead of its forward."""

    def __init__(self, target: Transformer, heads: Sequence[ExitHead], hard_weight: float = 0.0,
                 features: FeatureSource | None = None, objective: str = "kl"):
        super().__init__()
        layers = [head.exit_layer for head in heads]
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"EarlyExitObjective: give one exit per layer E (at least one), "
                             f"got exit layers {layers}")
        if not hard_weight >= 0:
            raise ValueError(f"EarlyExitObjective: hard_weight must be >= 0, got {hard_weight}")
        self.target, self.heads = freeze(target), nn.ModuleList(heads)
        self.hard_weight = hard_weight
        self.features = feature_source(tuple(layers), False, features, "EarlyExitObjective")
        self.objective = objective
        self.divergence = law_objective(objective, "EarlyExitObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        layers = tuple(head.exit_layer for head in self.heads)
        _, streams, target_logits, _ = frozen_outputs(self.target, tokens, layers, self.features)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        total, metrics = target_logits.new_zeros(()), {}
        for head, hidden in zip(self.heads, streams, strict=True):
            logits = head.logits(hidden, positions, self.target)  # [B, T, V]
            part = exit_loss(logits, target_logits, tokens, loss_mask, self.hard_weight,
                             self.divergence)
            total = total + part.loss / len(self.heads)
            metrics |= {f"exit/E{head.exit_layer}_{k}": v for k, v in part.metrics.items()}
        return LossOutput(total, metrics)


# ---- entry -----------------------------------------------------------------------------------

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
    return early_exit_drafter(exit_head(loaded, variant), k, variant.threshold)


def early_exit_drafter(head: ExitHead, k: int, threshold: float | None) -> EarlyExitDrafter:
    """The early-exit drafter, of generation's rows and of the trainer's judge and report
    alike: up to k tokens through the exit `head`, ending a draft below the top-1 probability
    `threshold` (None: never)."""
    return EarlyExitDrafter(head, k, threshold)


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


# ---- the trainer (train/early_exit.py) -----------------------------------------------------


def check_early_exit_settings(cfg: DictConfig) -> tuple[int, ...]:
    """Every cfg.early_exit setting of train/early_exit.py checked from the config alone
    (no weights); returns the exit layers."""
    layers = early_exit_layers(cfg, model_config(cfg.model).num_layers)
    early_exit_thresholds(cfg)
    k = cfg.early_exit.num_draft_tokens
    if not is_count(k):
        raise ValueError(f"early_exit.num_draft_tokens must be an integer >= 1, got {k!r}")
    if not float(cfg.early_exit.hard_weight) >= 0:
        raise ValueError(f"early_exit.hard_weight must be >= 0, got {cfg.early_exit.hard_weight}")
    training.training_objective(cfg)
    return layers


def early_exit_heads(cfg: DictConfig, target: Transformer) -> list[ExitHead]:
    """Fresh adapter exits, one per early_exit.exit_layers, each starting as the norm exit."""
    torch.manual_seed(int(cfg.seed))
    dtype = target.embed_tokens.weight.dtype
    return [ExitHead(ExitConfig.for_target(target.config, e)).to(dtype).init_from_target(target)
            for e in early_exit_layers(cfg, target.config.num_layers)]


def early_exit_objective(cfg: DictConfig, target: Transformer, heads: list[ExitHead],
                         features: FeatureSource | None = None) -> EarlyExitObjective:
    """The exits trained together from one target forward (or the states of a feature
    store), each on the target's final law by trainer.objective (plus early_exit.hard_weight
    x cross-entropy to the tokens)."""
    return EarlyExitObjective(target, heads, hard_weight=float(cfg.early_exit.hard_weight),
                              features=features, objective=training.training_objective(cfg))


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    return early_exit_objective(run.cfg, run.target, run.module, features)


def exporter(run: training.TrainingRun, trained: torch.nn.Module) -> training.Export:
    """One head folder per exit layer: export/E{E} (safetensors + config)."""
    configs, info = [head.config for head in run.module], describe_target(run.target)

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        for i, config in enumerate(configs):
            head = ExitHead(config)
            head.load_state_dict(state_part(state, f"heads.{i}."))
            save_head(folder / f"E{config.exit_layer}", head, config, info)

    return export


def early_exit_trainer_drafter(cfg: DictConfig, head: ExitHead) -> EarlyExitDrafter:
    """train/early_exit.py's drafter (`early_exit_drafter` on its settings): up to
    early_exit.num_draft_tokens tokens, stopping below the first
    early_exit.confidence_threshold."""
    return early_exit_drafter(head, int(cfg.early_exit.num_draft_tokens),
                              early_exit_thresholds(cfg)[0])


def early_exit_drafters(cfg: DictConfig, target: Transformer, export: Path
                        ) -> training.ExportDrafters:
    """The exported adapter of each exit layer E, drafting for `target` (named E{E})."""
    exits = {e: load_early_exit(export / f"E{e}", target, exit_layer=e)
             for e in early_exit_layers(cfg, target.config.num_layers)}
    return {f"E{e}": (early_exit_trainer_drafter(cfg, head), target)
            for e, head in exits.items()}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the adapters, on meta tensors."""
    print(model_plan(cfg).format())
    config = model_config(cfg.model)
    layers = early_exit_layers(cfg, config.num_layers)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        heads = [ExitHead(ExitConfig.for_target(config, e)) for e in layers]
    count = sum(p.numel() for head in heads for p in head.parameters())
    print(trainable_line(f"trainable exits (ExitHead adapters at E={list(layers)})", count,
                         int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """For each trained E: tau, speedup and draft time share of the adapter and of the norm
    exit over plain decoding of the target, on fresh weights, whatever DeepSpeed did to the
    trained ones."""
    target = load_target(cfg)
    summary, lines = {"exits": str(export)}, []
    adapters = early_exit_drafters(cfg, target, export)
    for e in early_exit_layers(cfg, target.config.num_layers):
        norm = early_exit_trainer_drafter(cfg, norm_exit(target, e))
        for kind, drafter in (("norm", norm), ("adapter", adapters[f"E{e}"][0])):
            comparison = training.compare_on_final_eval(cfg, target, drafter)
            summary |= {f"E{e}/{kind}/{k}": v for k, v in comparison.as_dict().items()}
            lines.append(f"E={e} {kind:<7}: {comparison.describe(cfg.data.name)}")
        top1 = metrics.get(f"eval/exit/E{e}_top1")
        if top1 is not None:
            summary[f"E{e}/adapter/heldout_top1"] = round(top1, 3)
    tracker.log_summary(summary)
    threshold = early_exit_thresholds(cfg)[0]
    print(f"early exits: {export}/E*; up to {cfg.early_exit.num_draft_tokens} draft tokens, "
          f"confidence stop {threshold}")
    print("\n".join(lines))


def random_exit(target: Transformer, tree: TreeChoices, seed: int) -> EarlyExitDrafter:
    """bench_decode's drafter: a random adapter exit at E = L/4, 4 tokens a step."""
    torch.manual_seed(seed)
    config = ExitConfig.for_target(target.config, max(1, target.config.num_layers // 4))
    return EarlyExitDrafter(ExitHead(config).to(target.embed_tokens.weight).eval(), 4)


ENTRIES = (MethodEntry(
    name="early_exit",
    summary="the target's first E layers through an exit, verification resuming at E",
    variants=variants, load=load, drafter=drafter, check=check,
    default_when=when_set("early_exit.exits"), head=ExitHead, color="tab:pink", order=50,
    cost_rows={"early_exit": CostRow("adapter exit at E = L/4, 4 tokens a step", random_exit,
                                     lambda drafter: drafter.num_draft_tokens)}),)

TRAINER = TrainerEntry(
    name="early_exit", config="train_early_exit", check=check_early_exit_settings,
    dry_run=dry_run, module=lambda cfg, target, train: early_exit_heads(cfg, target),
    objective=objective, exporter=exporter, drafters=early_exit_drafters, report=report,
    streams=lambda heads: [head.exit_layer for head in heads], replayable=never,
    report_settings=("early_exit.num_draft_tokens", "early_exit.confidence_threshold"),
    curve_variants={"early_exit": ()}, store_bench=("early_exit",), order=50)
