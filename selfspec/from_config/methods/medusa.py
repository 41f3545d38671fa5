"""Medusa heads (`MedusaHeads`, drafted by `MedusaDrafter` / `MedusaProductDrafter`): K heads on
the target's last hidden state, trained by train/medusa.py on the frozen target (Medusa-1) or
with LoRA on it (Medusa-2, whose drafts verify on the adapted target).

Rows: medusa, at each draft length k a tree's nodes of depth <= k (conf/tree/: static `choices`,
or the heads' top-k products), lengths beyond the tree's depth folded into one row.

Trainer (train/medusa.py, conf/train_medusa.yaml): fresh heads on the target (output layers
copied from its LM head), trained on the frozen target (Medusa-1) or with LoRA adapters on it
(Medusa-2); the export holds the heads, the training rows' token counts and (Medusa-2) the
adapter; the judge and the report draft cfg.tree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from selfspec.divergences import kl_to_teacher
from selfspec.drafters import MedusaDrafter, MedusaProductDrafter
from selfspec.from_config import training
from selfspec.from_config.common import checked_settings
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    TrainerEntry,
    head_folder,
    one_variant,
    required_head_folder,
    when_set,
)
from selfspec.from_config.models import load_target, model_config, model_plan, target_quantization
from selfspec.heads.base import LossOutput
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.heads.io import load_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss
from selfspec.measure.grid import Variant
from selfspec.measure.lossless import greedy_agreement
from selfspec.measure.method_costs import EAGLE2_PAPER, CostRow, TreeChoices
from selfspec.model import ModelConfig, Transformer, dense_weight
from selfspec.model.lora import (
    ADAPTER_DIR,
    LoraSettings,
    add_lora,
    lora_parameter_count,
    merge_adapter,
    save_adapter,
)
from selfspec.model.plan import head_training_lines, trainable_line
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.loop import state_part
from selfspec.training.objectives import feature_source, freeze, frozen_states, law_objective
from selfspec.training.rows import TokenRows
from selfspec.tree import Tree

if TYPE_CHECKING:
    from peft import PeftModel


# ---- objective -------------------------------------------------------------------------------


class MedusaObjective(nn.Module):
    """Medusa-1: heads read the frozen target's last hidden state and learn the tokens after
    the next one (head k predicts t + k + 2), with per-head weights decay**k: the tokens'
    cross-entropy (objective kl, the published loss), or another objective against the
    target's own law of that token (its LM head over the same states, restricted to the
    heads' draft vocabulary).
    cache_features: keep each row's features (`FeatureCache`) for runs of many epochs;
    features: read them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, heads: MedusaHeads, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 objective: str = "kl"):
        super().__init__()
        self.target, self.heads, self.decay = freeze(target), heads, decay
        self.features = feature_source((), cache_features, features, "MedusaObjective")
        self.objective, self.divergence = objective, law_objective(objective, "MedusaObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
        labels, mask = self.heads.labels(tokens, loss_mask)
        logits = self.heads(hidden, self.target.lm_head)
        teacher = None
        if self.objective != "kl":
            with torch.no_grad():
                teacher = medusa_teacher(self.heads, self.target.logits_of(hidden))
        return medusa_loss(logits, labels, mask, decay=self.decay, teacher_logits=teacher,
                           divergence=self.divergence)


def medusa_teacher(heads: MedusaHeads, target_logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V'] the target's logits over the heads' draft vocabulary (all V without one)."""
    vocab = heads.draft_vocab
    return target_logits if vocab is None else target_logits[..., vocab.t2d]


class Medusa2Objective(nn.Module):
    """Medusa-2: heads and LoRA adapters on the target train together.

    The heads read the *adapted* target's hidden state. The adapted target's own LM head is
    what verification will use, so its law is pulled towards the unadapted target's by a KL
    term weighted lm_weight; the teacher is the same model with its adapters disabled, so no
    second copy of the target is held.
    target: the target wrapped by `selfspec.model.lora.add_lora` (only the adapters train).
    adapter_lr_scale: the adapters learn at this fraction of the heads' rate, so the target
    moves slowly while the heads catch up with it.
    """

    def __init__(
        self, target: PeftModel, heads: MedusaHeads, decay: float = 0.8, lm_weight: float = 1.0,
        adapter_lr_scale: float = 0.25, objective: str = "kl",
    ):
        super().__init__()
        if not lm_weight >= 0:
            raise ValueError(f"Medusa2Objective: lm_weight must be >= 0, got {lm_weight}")
        if not adapter_lr_scale > 0:
            raise ValueError(
                f"Medusa2Objective: adapter_lr_scale must be > 0, got {adapter_lr_scale}")
        self.target, self.heads, self.decay, self.lm_weight = target, heads, decay, lm_weight
        self.adapter_lr_scale = adapter_lr_scale
        self.objective = objective
        self.divergence = law_objective(objective, "Medusa2Objective")

    def param_groups(self, lr: float) -> list[dict]:
        """The heads at lr, the target's adapters at lr * adapter_lr_scale (for `fit`)."""
        adapters = [p for p in self.target.parameters() if p.requires_grad]
        return [{"params": list(self.heads.parameters()), "lr": lr},
                {"params": adapters, "lr": lr * self.adapter_lr_scale}]

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        with torch.no_grad(), self.target.disable_adapter():
            teacher = self.target(tokens, positions).logits  # [B, T, V] the unadapted target
        out = self.target(tokens, positions)
        logits = self.heads(out.last_hidden, self.target.get_base_model().lm_head)
        # objectives other than kl meet the adapted target's law, which verification uses
        adapted = None if self.objective == "kl" else medusa_teacher(self.heads,
                                                                     out.logits.detach())
        heads = medusa_loss(logits, *self.heads.labels(tokens, loss_mask), decay=self.decay,
                            teacher_logits=adapted, divergence=self.divergence)
        kl = kl_to_teacher(out.logits, teacher, loss_mask)
        metrics = heads.metrics | {"medusa/lm_kl": float(kl.detach())}
        return LossOutput(heads.loss + self.lm_weight * kl, metrics)


# ---- entry -----------------------------------------------------------------------------------

HEADS = "medusa_heads"  # the setting naming the heads' export folder


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEADS, "medusa", "medusa")


def fold_lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """At draft length k Medusa drafts the tree's nodes of depth <= k, so lengths beyond the
    tree's depth would repeat the whole tree: they fold into one at that depth."""
    depth = medusa_depth(cfg)
    return tuple(sorted({min(k, depth) for k in lengths}))


def medusa_depth(cfg: DictConfig) -> int:
    """The deepest Medusa draft: cfg.tree's depth (a top-k-products tree without one: every
    head), capped by the heads' count read from the export's head_config.json (no weights):
    node depth d needs head d-1."""
    num_heads = num_medusa_heads(cfg)
    depth = tree_depth(cfg.tree) or num_heads
    return min(depth, num_heads or depth)


def num_medusa_heads(cfg: DictConfig) -> int:
    """The heads' count of the medusa_heads export, from its head_config.json (0: unknown)."""
    meta = json.loads((head_folder(cfg, HEADS) / "head_config.json").read_text())
    return int(meta.get("config", {}).get("num_heads", 0))


def heads_and_target(loaded: Loaded) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of medusa_heads, loaded once, and for a Medusa-2 export its adapted target."""
    cfg = loaded.cfg
    return loaded.once(HEADS, lambda: load_medusa(cfg, head_folder(cfg, HEADS), loaded.target))


def verified_on(loaded: Loaded) -> tuple[Transformer, str]:
    """Medusa-2 heads draft for, and are compared with plain decoding of, their LoRA-adapted
    target ("plain_adapted"); Medusa-1 heads for the target itself."""
    _, adapted = heads_and_target(loaded)
    return (loaded.target, "plain") if adapted is None else (adapted, "plain_adapted")


def drafter(loaded: Loaded, variant: Variant, k: int) -> MedusaDrafter | MedusaProductDrafter:
    heads, _ = heads_and_target(loaded)
    return medusa_drafter(loaded.cfg.tree, heads, max_depth=k)


def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
    heads_and_target(loaded)


# ---- trees ---------------------------------------------------------------------------------


def tree_depth(cfg_tree: DictConfig) -> int | None:
    """How deep a tree config drafts: a static tree's depth, a top-k-products config's `depth`
    (None: as many heads as there are)."""
    if cfg_tree.get("choices") is not None:
        return Tree.from_paths(OmegaConf.to_container(cfg_tree.choices)).max_depth
    return None if cfg_tree.get("depth") is None else int(cfg_tree.depth)


def medusa_drafter(
    cfg_tree: DictConfig, heads: MedusaHeads, max_depth: int | None = None
) -> MedusaDrafter | MedusaProductDrafter:
    """The Medusa drafter of a tree config (conf/tree/), at most max_depth deep: a static tree
    (`choices`: its nodes of depth <= max_depth) or a dynamic one (`top_k`, `max_nodes`,
    optional `depth`: each step's best paths of the heads' top-k products)."""
    name = cfg_tree.get("name")
    if cfg_tree.get("choices") is not None:
        choices = OmegaConf.to_container(cfg_tree.choices)
        if max_depth is not None:
            choices = [c for c in choices if len(c) <= max_depth]
        return MedusaDrafter(heads, Tree.from_paths(choices))
    if cfg_tree.get("top_k") is None or cfg_tree.get("max_nodes") is None:
        raise ValueError(f"tree config {name!r} needs `choices` (a static tree) or `top_k` and "
                         f"`max_nodes` (a tree of the heads' top-k products); see conf/tree/")
    depth = tree_depth(cfg_tree) or heads.config.num_heads
    depth = depth if max_depth is None else min(depth, max_depth)
    return MedusaProductDrafter(heads, top_k=int(cfg_tree.top_k),
                                max_nodes=int(cfg_tree.max_nodes), depth=depth)


# ---- loading ---------------------------------------------------------------------------------


def load_medusa(
    cfg: DictConfig, folder: str | Path, target: Transformer
) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of a train/medusa.py export, and for a Medusa-2 export the target they draft
    for: a fresh copy of cfg's target with the export's LoRA adapter merged (None for
    Medusa-1, whose heads draft for `target` itself, which is never modified)."""
    heads = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    adapter = Path(folder) / ADAPTER_DIR
    return heads, merge_adapter(load_target(cfg), adapter) if adapter.is_dir() else None


# ---- the trainer (train/medusa.py) ---------------------------------------------------------


def medusa_version(cfg: DictConfig) -> int:
    """1: heads on the frozen target (Medusa-1); 2: heads and LoRA on the target (Medusa-2)."""
    version = cfg.medusa.get("version", 1)
    if version not in (1, 2):
        raise ValueError(f"medusa.version must be 1 (frozen target) or 2 (joint training with "
                         f"LoRA on the target), got {version!r}")
    return int(version)


def lora_settings(cfg: DictConfig) -> LoraSettings:
    lora = cfg.medusa.lora
    return LoraSettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=tuple(str(m) for m in lora.target_modules))


def medusa_config(cfg: DictConfig, target_config: ModelConfig) -> MedusaConfig:
    return checked_settings(MedusaConfig, "medusa", hidden_size=target_config.hidden_size,
                            vocab_size=target_config.vocab_size,
                            num_heads=int(cfg.medusa.num_heads),
                            num_layers=int(cfg.medusa.num_layers),
                            draft_vocab_size=cfg.medusa.get("draft_vocab_size"),
                            shared_lm_head=cfg.medusa.get("shared_lm_head", False))


def check_medusa_settings(cfg: DictConfig) -> int:
    """Every cfg.medusa setting checked from the config alone (no weights), with the cfg.tree
    the judge and the report draft (`check_medusa_tree`); returns the version. A model without
    an `arch` block has its config.json read, nothing more."""
    version = medusa_version(cfg)
    check_medusa_tree(cfg, model_config(cfg.model))
    if not float(cfg.medusa.decay) > 0:
        raise ValueError(f"medusa.decay must be > 0 (head k weighs decay**k), "
                         f"got {cfg.medusa.decay}")
    if version == 2:
        if target_quantization(cfg.model) is not None:
            raise ValueError("medusa.version=2 trains LoRA adapters on the target's linear "
                             "layers, which a model.quantize target holds quantized: train "
                             "Medusa-1 heads on it (medusa.version=1), or set model.quantize=null")
        lora_settings(cfg)
        if not float(cfg.medusa.lm_weight) >= 0:
            raise ValueError(f"medusa.lm_weight must be >= 0, got {cfg.medusa.lm_weight}")
    training.training_objective(cfg)
    return version


def check_medusa_tree(cfg: DictConfig, target_config: ModelConfig) -> None:
    """Refuse a cfg.tree the configured heads cannot fill, before any weights are built."""
    with torch.device("meta"):
        medusa_drafter(cfg.tree, MedusaHeads(medusa_config(cfg, target_config)))


def medusa_heads(cfg: DictConfig, target: Transformer, train: TokenRows | None = None
                 ) -> MedusaHeads:
    """Fresh Medusa heads sized for the target (output layers copied from its LM head); with
    medusa.draft_vocab_size, over the most frequent tokens of the training rows `train`."""
    config = medusa_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    heads = MedusaHeads(config).to(target.embed_tokens.weight.dtype)
    if config.draft_vocab_size is not None:
        if train is None:
            raise ValueError("medusa.draft_vocab_size: the draft vocabulary is read from the "
                             "training rows: pass them to medusa_heads")
        heads.set_draft_vocab(draft_vocabulary(train.tokens, config.vocab_size,
                                               config.draft_vocab_size, train.loss_mask))
    if cfg.medusa.init_from_lm_head:
        heads.init_from_lm_head(dense_weight(target.lm_head).detach())
    return heads


def medusa_objective(
    cfg: DictConfig, target: Transformer, heads: MedusaHeads,
    features: FeatureSource | None = None,
) -> MedusaObjective | Medusa2Objective:
    """The training objective of cfg.medusa.version; Medusa-2 wraps the target with LoRA.
    trainer.objective: kl trains on the tokens (the published loss), any other against the
    target's law (Medusa-2: the adapted target's). features: the target's states read from a
    feature store (Medusa-1)."""
    decay, name = float(cfg.medusa.decay), training.training_objective(cfg)
    cache = bool(cfg.medusa.get("cache_features", False))
    if medusa_version(cfg) == 1:
        return MedusaObjective(target, heads, decay=decay, cache_features=cache,
                               features=features, objective=name)
    if cache or features is not None:
        raise ValueError("medusa.cache_features=true and trainer.features need a frozen target "
                         "(Medusa-1): Medusa-2 trains the target, whose features change every "
                         "step")
    adapted = add_lora(target, lora_settings(cfg))
    return Medusa2Objective(adapted, heads, decay=decay, lm_weight=float(cfg.medusa.lm_weight),
                            adapter_lr_scale=float(cfg.medusa.lora.lr_scale), objective=name)


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    return medusa_objective(run.cfg, run.target, run.module, features)


def exporter(run: training.TrainingRun, trained: torch.nn.Module) -> training.Export:
    """The heads (safetensors + config) and the training rows' token counts (from which
    scripts/export_heads.py --draft-vocab narrows them); Medusa-2 adds its adapter in peft's
    format."""
    heads = training.head_exporter(run.module, "heads.", run.target,
                          training.rows_token_counts(run.target, run.train))
    if medusa_version(run.cfg) == 1:
        return heads

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        heads(state, folder)
        save_adapter(trained.target, folder / ADAPTER_DIR, state_part(state, "target."))

    return export


def medusa_drafters(cfg: DictConfig, target: Transformer, export: Path) -> training.ExportDrafters:
    """The exported heads on cfg.tree, and the target they verify on: `target`, or for a
    Medusa-2 export a fresh copy of it with the export's adapter merged."""
    heads, adapted = load_medusa(cfg, export, target)
    return {"": (medusa_drafter(cfg.tree, heads), adapted or target)}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target, the heads and (Medusa-2) the adapters, on meta tensors."""
    version = medusa_version(cfg)
    print(model_plan(cfg).format())
    config, gpus = model_config(cfg.model), int(cfg.num_gpus)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        heads = MedusaHeads(medusa_config(cfg, config))
        target = Transformer(config) if version == 2 else None
    print(head_training_lines(heads, gpus))
    if target is not None:
        settings = lora_settings(cfg)
        print(trainable_line(f"LoRA adapters on the target (rank {settings.rank})",
                             lora_parameter_count(target, settings), gpus))
        print("  Medusa-2 also back-propagates through the target: plan activation memory "
              "(micro_batch_size x seq_len) on top")


def report(cfg: DictConfig, heads_folder: Path, metrics: dict, tracker: Tracker) -> None:
    """tau and speedup of the trained heads over plain decoding of the target they draft for
    (Medusa-2: the adapted target), on fresh weights, whatever DeepSpeed did to the trained
    ones; for Medusa-2 also how much of the original's greedy output the adapted target keeps."""
    target = load_target(cfg)
    drafter, verified = medusa_drafters(cfg, target, heads_folder)[""]
    comparison = training.compare_on_final_eval(cfg, verified, drafter)
    top1 = training.heldout_top1(metrics)
    summary = {**comparison.as_dict(), **top1, "heads": str(heads_folder)}
    if verified is not target:
        summary["greedy_agreement_with_original"] = greedy_agreement(
            target, verified, training.final_eval_prompts(cfg, target),
            int(cfg.final_eval.max_new_tokens))
        summary["eval_kl_to_original"] = metrics.get("eval/medusa/lm_kl")
    tracker.log_summary(summary)
    print(f"Medusa heads: {heads_folder}")
    print(f"per-head top-1 (held-out): {top1}")
    print(comparison.describe(cfg.data.name))
    if verified is not target:
        print(f"Medusa-2: verified against the LoRA-adapted target (held-out KL to the original "
              f"{summary['eval_kl_to_original']}); its greedy output keeps "
              f"{summary['greedy_agreement_with_original']:.0%} of the original's tokens before "
              f"the first difference")


def random_medusa(target: Transformer, tree: TreeChoices, seed: int) -> MedusaDrafter:
    """bench_decode's drafter: 4 random Medusa heads over the static tree given."""
    config = target.config
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=4))
    return MedusaDrafter(heads.to(target.embed_tokens.weight).eval(), tree)


ENTRIES = (MethodEntry(
    name="medusa", summary="Medusa heads on the target's last hidden state, drafting a tree",
    variants=one_variant("medusa"), load=load, drafter=drafter, check=check,
    verified_on=verified_on, lengths=fold_lengths, default_when=when_set(HEADS),
    head=MedusaHeads, color="tab:green", order=20, cost_rows={"medusa": CostRow(
        "4 Medusa heads, the static tree", random_medusa, published_tau=2.52,
        published=EAGLE2_PAPER)}),)

TRAINER = TrainerEntry(
    name="medusa", config="train_medusa", check=check_medusa_settings, dry_run=dry_run,
    module=medusa_heads, objective=objective, exporter=exporter, drafters=medusa_drafters,
    report=report, replayable=lambda cfg: medusa_version(cfg) == 1,
    curve_variants={"medusa": ("medusa.version=1",)},
    store_bench=("medusa",), order=20)
