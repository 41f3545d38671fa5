"""MTP: the target's own multi-token-prediction modules (DeepSeek-V3's NextN layers,
Qwen3-Next's and Qwen3.5's `mtp.*`), drafted by `MtpDrafter`; nothing to train or load beside
the target (a checkpoint that ships them, or a model config whose arch names them:
model=random-mtp).

Rows: mtp (a chain of k tokens, each step reading the last one's output and token) and
mtp/tree{N} for each N in mtp.total_tokens beside null (an EAGLE-2 dynamic tree k deep of N
nodes, mtp.top_k children per frontier node), at each draft length k.

Trainer (train/mtp.py, conf/train_mtp.yaml): FastMTP's recipe, the target's first MTP module
fine-tuned on the target's own answers with the rest of the target frozen
(`MtpObjective` below); a target that ships none gets a fresh one of
mtp.add_module's layout. The export is the target's whole folder (config.json, weights in the
checkpoint's layout, tokenizer) with the fine-tuned MTP keys: model=local model.path=<export>
drafts with it; the judge and the report load the export's MTP keys into the target they run.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from torch import nn

from selfspec.checks import check_count, is_count
from selfspec.drafters.mtp import MtpDrafter, MtpHead
from selfspec.from_config import training
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.eagle import EagleObjective
from selfspec.from_config.methods.entry import Loaded, MethodEntry, TrainerEntry
from selfspec.from_config.models import model_config, model_plan
from selfspec.heads.base import LossOutput
from selfspec.heads.early_exit import exit_loss
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow
from selfspec.model import ModelConfig, Transformer
from selfspec.model.checkpoint import our_state, write_folder
from selfspec.model.config import MTP_LAYOUTS
from selfspec.model.loading import with_random_mtp
from selfspec.model.plan import trainable_line
from selfspec.model.transformer import MtpModule
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.objectives import frozen_outputs
from selfspec.training.rows import TokenRows
from selfspec.tree import Tree

# ---- objective -------------------------------------------------------------------------------


class MtpObjective(EagleObjective):
    """FastMTP: a target's own MTP module (`head`, the drafter's `MtpHead` over it) fine-tuned
    on the frozen rest of the target. Row t reads (token t+1, the target's normed last hidden
    state h_t), as an EAGLE-1 head's row does, and the module's law of token t+2 meets the
    target's law there by `objective` (`EagleObjective`'s token term alone: the module's
    outputs are no features of the target's to regress on). Only the module's own layers
    train: the target, and a NextN module's LM head (a copy of the target's, which DeepSeek
    shares), stay frozen. feature_noise, cache_features and features as `EagleObjective`.

    steps > 1: FastMTP's recursion, the module applied again to its own outputs as a chain
    drafts: step s's row t reads token t+s and step s - 1's output at row t, and meets the
    target's law of token t+s+1 (`exit_loss`, position by position); step s weighs
    decay**(s - 1), the weights summing to 1, and the gradient flows through the chain."""

    def __init__(self, target: Transformer, head: nn.Module, feature_noise: float = 0.0,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 objective: str = "kl", steps: int = 1, decay: float = 0.8):
        super().__init__(target, head, feature_weight=0.0, token_weight=1.0,
                         feature_noise=feature_noise, cache_features=cache_features,
                         features=features, objective=objective)
        check_count("steps", steps, owner="MtpObjective")
        if not decay > 0:
            raise ValueError(f"MtpObjective: decay must be > 0, got {decay}")
        self.steps, self.decay = steps, float(decay)
        for name, param in head.module.named_parameters():  # freeze() froze the module too
            param.requires_grad_(not name.startswith("head."))

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        if self.steps > 1:
            return self._recursive(tokens, loss_mask)
        out = super().forward(tokens, loss_mask)  # its feature term weighs 0: not reported
        return LossOutput(out.loss, {k.replace("eagle/", "mtp/"): v for k, v in
                                     out.metrics.items() if k != "eagle/feature_loss"})

    def _recursive(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        last, _, target_logits, embeds = frozen_outputs(self.target, tokens, (), self.features)
        weights = [self.decay ** s for s in range(self.steps)]
        feature, total, metrics = self._noisy(last), target_logits.new_zeros(()), {}
        for step, weight in enumerate(weights, 1):
            rows = tokens.shape[1] - step
            positions = torch.arange(rows, device=tokens.device)
            feature = self.head(embeds[:, step:], feature[:, :rows], positions)  # [B, rows, H]
            part = exit_loss(self.head.logits(feature), target_logits[:, step:],
                             loss_mask=loss_mask[:, step:], divergence=self.divergence)
            total = total + weight / sum(weights) * part.loss
            metrics |= {f"mtp/step{step}_loss": part.metrics["soft_loss"],
                        f"mtp/step{step}_top1": part.metrics["top1"]}
        return LossOutput(total, metrics | {"mtp/top1": metrics["mtp/step1_top1"]})


# ---- entry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MtpVariant(Variant):
    method: str = "mtp"
    total_tokens: int | None = None  # None: a chain

    def label(self) -> str:
        return self.method + ("" if self.total_tokens is None else f"/tree{self.total_tokens}")


def settings(cfg: DictConfig) -> DictConfig:
    return cfg.get("mtp") or OmegaConf.create({})


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[MtpVariant, ...]:
    nodes = as_list(settings(cfg).get("total_tokens")) or [None]
    if not all(n is None or is_count(n) for n in nodes):
        raise ValueError(f"mtp.total_tokens: give null (a chain) or node counts >= 1, got "
                         f"{nodes}")
    return tuple(MtpVariant(total_tokens=n) for n in nodes)


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """Every tree holds its deepest draft (total_tokens >= k), top_k a count."""
    top_k = settings(cfg).get("top_k", 3)
    if not is_count(top_k):
        raise ValueError(f"mtp.top_k must be an integer >= 1, got {top_k!r}")
    short = [v.total_tokens for v in variants(cfg) if v.total_tokens is not None
             and v.total_tokens < max(lengths)]
    if short:
        raise ValueError(f"mtp.total_tokens {short} < the longest draft length ({max(lengths)}): "
                         f"a tree that deep needs that many nodes; raise mtp.total_tokens or "
                         f"lower num_draft_tokens")


def drafter(loaded: Loaded, variant: MtpVariant, k: int) -> MtpDrafter:
    s = settings(loaded.cfg)
    sampled = bool(s.get("sampled_children", True))
    if variant.total_tokens is None:
        return MtpDrafter(loaded.target, Tree.chain(k), sampled_children=sampled)
    return MtpDrafter(loaded.target, total_tokens=variant.total_tokens, depth=k,
                      top_k=s.get("top_k", 3), sampled_children=sampled)


def has_modules(cfg: DictConfig) -> bool:
    """A sweep with methods=null runs mtp when the model config's arch names MTP modules."""
    return bool(OmegaConf.select(cfg, "model.arch.mtp_modules", default=0))


ENTRIES = (MethodEntry(
    name="mtp", summary="the target's own MTP modules (DeepSeek-V3 NextN, Qwen3-Next mtp): a "
                        "chain of k tokens or a dynamic tree from their top tokens",
    variants=variants, drafter=drafter, check=check, default_when=has_modules,
    color="tab:brown", order=42, cost_rows={"mtp": CostRow(
        "the target's own MTP module, EAGLE-2 tree: 60 nodes, depth 6, top-10",
        lambda target, tree, seed: MtpDrafter(target, total_tokens=60, depth=6, top_k=10),
        lambda drafter: drafter.shape.depth)}),)


# ---- the trainer (train/mtp.py): FastMTP's fine-tuning of the target's own module -----------


def added_layout(cfg: DictConfig) -> str | None:
    """mtp.add_module: the layout of the fresh module a target without MTP modules gets (null:
    such a target is refused)."""
    layout = settings(cfg).get("add_module")
    if layout is not None and layout not in MTP_LAYOUTS:
        raise ValueError(f"mtp.add_module must be null (train the module the target ships) or "
                         f"one of {', '.join(MTP_LAYOUTS)} (a fresh module of that layout for a "
                         f"target without one), got {layout!r}")
    return layout


def with_module_config(cfg: DictConfig, config: ModelConfig) -> ModelConfig:
    """config with the MTP module the trainer fine-tunes: its own, or mtp.add_module's."""
    if config.mtp_modules:
        return config
    layout = added_layout(cfg)
    if layout is None:
        raise ValueError("train/mtp.py fine-tunes the target's MTP module and this target has "
                         "none: load a checkpoint that ships one (DeepSeek-V3 NextN, Qwen3-Next "
                         "mtp.*), or set mtp.add_module=mtp|nextn|mimo to train a fresh one")
    return replace(config, mtp_modules=1, mtp_layout=layout)


@torch.no_grad()
def with_module(cfg: DictConfig, target: Transformer) -> Transformer:
    """target with the module the trainer fine-tunes: its own, or a fresh one (seeded by
    cfg.seed) of mtp.add_module's layout, a NextN module's LM head a copy of the target's (as
    DeepSeek's shares it)."""
    config = with_module_config(cfg, target.config)
    if config is target.config:
        return target
    target = with_random_mtp(target, config, int(cfg.seed))
    if target.mtp[0].head is not None:
        target.mtp[0].head.weight.copy_(target.lm_head.weight)
    return target


def check_trainer(cfg: DictConfig) -> None:
    """Every setting checked from the config alone (the model's config.json at most, no
    weights): the module to train, the report's drafter, the objective's settings and
    trainer.objective."""
    added_layout(cfg)
    with_module_config(cfg, model_config(cfg.model))
    check(cfg, (positive_depth(cfg),))
    variants(cfg)
    if not float(settings(cfg).get("feature_noise", 0.0)) >= 0:
        raise ValueError(f"mtp.feature_noise must be >= 0, got {settings(cfg).feature_noise}")
    if not is_count(settings(cfg).get("steps", 1)):
        raise ValueError(f"mtp.steps must be an integer >= 1 (1: the module's own step; K: it "
                         f"also trains on its own outputs K - 1 steps deep), got "
                         f"{settings(cfg).steps!r}")
    if not float(settings(cfg).get("step_decay", 0.8)) > 0:
        raise ValueError(f"mtp.step_decay must be > 0 (step s weighs step_decay**(s - 1)), got "
                         f"{settings(cfg).step_decay}")
    training.training_objective(cfg)


def positive_depth(cfg: DictConfig) -> int:
    depth = settings(cfg).get("depth", 3)
    if not is_count(depth):
        raise ValueError(f"mtp.depth must be an integer >= 1 (the report's draft length), "
                         f"got {depth!r}")
    return int(depth)


def trainable_module(cfg: DictConfig, target: Transformer, train: TokenRows) -> MtpHead:
    """The target's first MTP module (added where mtp.add_module says), as the head the EAGLE-1
    objective trains."""
    return MtpHead(with_module(cfg, target))


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    s = settings(run.cfg)
    return MtpObjective(run.target, run.module, feature_noise=float(s.get("feature_noise", 0.0)),
                        cache_features=bool(s.get("cache_features", False)), features=features,
                        objective=training.training_objective(run.cfg),
                        steps=int(s.get("steps", 1)), decay=float(s.get("step_decay", 0.8)))


def exporter(run: training.TrainingRun, trained: torch.nn.Module) -> training.Export:
    """The target's folder with the module's trained tensors: config.json and model.safetensors
    in the checkpoint's layout (`checkpoint.write_folder`), and the target's tokenizer files."""
    target = run.target
    names = {id(p): name for name, p in target.named_parameters()}
    ours = {name: names[id(p)] for name, p in trained.named_parameters() if p.requires_grad}

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        weights = {k: v.detach() for k, v in target.state_dict().items()}
        weights |= {ours[name]: tensor for name, tensor in state.items()}
        write_folder(folder, weights, target.config, target.embed_tokens.weight.dtype)
        copy_tokenizer(target.source, folder)

    return export


TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer(source: str | None, folder: Path) -> None:
    """The tokenizer files of the target's folder (where it has one) copied beside the export's
    weights, so that the export loads as a model (model=local model.path=<export>)."""
    if source is None or not Path(source).is_dir():
        return
    for name in TOKENIZER_NAMES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, folder / name)


@torch.no_grad()
def load_module(target: Transformer, export: Path) -> Transformer:
    """target with its MTP modules' tensors read from an export folder (the rest of the
    export, the target's own weights, is passed over)."""
    with safe_open(str(export / "model.safetensors"), framework="pt") as handle:
        tensors = ((name, handle.get_tensor(name)) for name in handle.keys())
        state = {k: v for k, v in our_state(tensors, target.config) if k.startswith("mtp.")}
    mine = dict(target.mtp.named_parameters(prefix="mtp"))
    if set(state) != set(mine):
        raise ValueError(f"{export}: its MTP tensors {sorted(set(state) ^ set(mine))[:4]} do "
                         f"not match the target's modules; give an export of train/mtp.py for "
                         f"this target")
    for name, param in mine.items():
        param.copy_(state[name])
    return target


def trainer_drafter(cfg: DictConfig, target: Transformer) -> MtpDrafter:
    """The report's drafter: mtp.total_tokens' first variant (null: a chain) mtp.depth deep."""
    return drafter(Loaded(cfg, target), variants(cfg)[0], positive_depth(cfg))


def mtp_drafters(cfg: DictConfig, target: Transformer, export: Path) -> training.ExportDrafters:
    """The export's module drafting over `target` itself (its other weights are the export's),
    so that the judge replays the target's recorded answers."""
    target = load_module(with_module(cfg, target), export)
    return {"": (trainer_drafter(cfg, target), target)}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the trainable module, on meta tensors."""
    print(model_plan(cfg).format())
    config = with_module_config(cfg, model_config(cfg.model))
    with torch.device("meta"):
        module = MtpModule(config, config.mtp_layout)
    count = sum(p.numel() for n, p in module.named_parameters() if not n.startswith("head."))
    print(trainable_line("trainable MTP module (MtpModule)", count, int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the fine-tuned module over plain decoding."""
    _, comparison = training.final_comparison(cfg, mtp_drafters, export)
    top1 = training.heldout_top1(metrics)
    training.log_report(cfg, tracker, comparison, {**top1, "export": str(export)},
                        f"fine-tuned MTP module (target folder): {export}",
                        f"top-1 agreement with the target (held-out): {top1}")


TRAINER = TrainerEntry(
    name="mtp", config="train_mtp", check=check_trainer, dry_run=dry_run,
    module=trainable_module, objective=objective, exporter=exporter, drafters=mtp_drafters,
    report=report)
