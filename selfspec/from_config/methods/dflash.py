"""DFlash (`DFlashHead`, drafted by `DFlashDrafter`): a block drafter of a few decoder layers
over the target's fused features, drafting k tokens in one forward.

Rows: dflash (a chain of the k per-position tokens) and dflash/tree{N} for each N in
dflash.tree_nodes (DDTree's best-first tree of N nodes, at most k deep), at each draft length
k up to the head's block size - 1 (longer lengths fold into that one); beside each, a row per
dflash.confidence_threshold t besides null, dflash[/tree{N}]/conf{t}: the chain (the tree's
depth) cut where the head's confidence says its cumulative acceptance falls below t (a head
trained with dflash.confidence_head=true).

Trainer (train/dflash.py, conf/train_dflash.yaml): a fresh head (its mask token and draft
vocabulary from the training rows) trained on the frozen target, against the data or the
target's law; the export holds the head; the judge and the report draft dflash.num_draft_tokens
(null: the block's B - 1) as a chain or DDTree's tree of dflash.tree_nodes nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from selfspec.checks import check_count, is_count, is_number
from selfspec.drafters import DFlashDrafter
from selfspec.from_config import training
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    TrainerEntry,
    head_folder,
    required_head_folder,
    when_set,
)
from selfspec.from_config.models import model_config, model_plan
from selfspec.heads.base import LossOutput
from selfspec.heads.dflash import (
    DFlashConfig,
    DFlashHead,
    PrefixKeys,
    default_target_layers,
    dflash_loss,
)
from selfspec.heads.draft_vocab import draft_vocabulary
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import CostRow, TreeChoices
from selfspec.model import ModelConfig, Transformer
from selfspec.model.plan import head_training_lines
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.objectives import (
    detached_confidence,
    feature_source,
    freeze,
    frozen_states,
    law_objective,
)
from selfspec.training.rows import TokenRows

# ---- objective -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockFeatures:
    """What a block drafter learns from, of training rows [B, T]: the frozen target's residual
    streams at the head's `target_layers` (each [B, T, H]) and, for the loss against its law,
    its normed last hidden state [B, T, H] (None: cross-entropy against the data), whose
    logits come back through the target's LM head. A forward computes them
    (`DFlashObjective.features`); a feature store may supply them instead."""

    streams: tuple[torch.Tensor, ...]
    last_hidden: torch.Tensor | None = None


ANCHOR_RULES = ("next", "specforge")  # which positions may root a DFlash training block


class DFlashObjective(nn.Module):
    """DFlash: per row, `anchors` block starts are drawn among the positions `anchor_rule`
    allows (`anchor_blocks`; from `generator`, or torch's default generator, which `fit` seeds and
    checkpoints; held-out evaluation draws from a fixed seed). A block at anchor a is
    [token a, mask x (B - 1)] at positions a..a + B - 1; it attends to the context strictly
    before a (every draft layer's keys of the target's fused streams there) and to itself,
    bidirectionally, never to another block. Slot k predicts token a + k, scored against the
    data or (teacher=True) against the target's law at a + k - 1 by `objective`, slot k weighing
    exp(-(k - 1) / gamma) (`heads.dflash.dflash_loss`). With a draft vocabulary, slots whose token
    lies outside it do not count and the law is restricted to it.
    cache_features: keep each row's streams (`FeatureCache`) for runs of many epochs;
    features: read them from elsewhere (a feature store)."""

    def __init__(self, target: Transformer, head: DFlashHead, anchors: int = 16,
                 gamma: float = 4.0, teacher: bool = False,
                 generator: torch.Generator | None = None, cache_features: bool = False,
                 features: FeatureSource | None = None, objective: str = "kl",
                 anchor_rule: str = "next"):
        super().__init__()
        check_count("anchors", anchors, owner="DFlashObjective")
        if anchor_rule not in ANCHOR_RULES:
            raise ValueError(f"DFlashObjective: anchor_rule must be one of "
                             f"{', '.join(ANCHOR_RULES)}, got {anchor_rule!r}")
        if objective != "kl" and not teacher:
            raise ValueError(f"DFlashObjective: objective {objective!r} fits the draft's law to "
                             f"the target's: give teacher=True (against the data only kl, the "
                             f"cross-entropy, applies)")
        if not gamma > 0:
            raise ValueError(f"DFlashObjective: gamma must be > 0, got {gamma}")
        self.target, self.head, self.anchors = freeze(target), head, anchors
        self.gamma, self.teacher, self.generator = float(gamma), bool(teacher), generator
        self.anchor_rule = anchor_rule
        self.features = feature_source(head.config.target_layers, cache_features, features,
                                       "DFlashObjective")
        self.objective, self.divergence = objective, law_objective(objective, "DFlashObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        return self.loss(tokens, loss_mask, self.block_features(tokens))

    @torch.no_grad()
    def block_features(self, tokens: torch.Tensor) -> BlockFeatures:
        """The frozen target's streams (and last hidden state, for teacher=True) of rows
        tokens [B, T]."""
        states = frozen_states(self.target, tokens, self.head.config.target_layers,
                               self.features)
        return BlockFeatures(states.streams, states.last if self.teacher else None)

    def loss(self, tokens: torch.Tensor, loss_mask: torch.Tensor, features: BlockFeatures
             ) -> LossOutput:
        """The loss of rows tokens [B, T] (loss_mask [B, T]: which tokens are prediction
        targets) from their target features; no target layer runs here, only its embedding
        and LM head."""
        blocks = anchor_blocks(tokens, loss_mask, self.head.config, self.anchors,
                               self._generator(tokens.device), self.anchor_rule)
        states = self.block_states(features, blocks)  # [B, A, K, h]
        logits = self.head.logits(states, self.target.lm_head)  # [B, A, K, V']
        batch, length = tokens.shape
        labels, valid = blocks.labels, blocks.valid
        teacher = None
        if features.last_hidden is not None:
            at = (blocks.label_positions - 1).clamp(max=length - 1)  # [B, A, K]: law of a + k
            rows = features.last_hidden[torch.arange(batch, device=tokens.device)[:, None, None],
                                        at]  # [B, A, K, H]
            with torch.no_grad():
                teacher = self.target.logits_of(rows)  # [B, A, K, V]
        vocab = self.head.draft_vocab
        if vocab is not None:
            labels, kept = vocab.draft_ids(labels)
            valid = valid & kept
            if teacher is not None:
                teacher = teacher[..., vocab.t2d]
        return dflash_loss(logits, labels, valid, self.gamma, teacher, self.divergence,
                           detached_confidence(self.head, states))

    def block_logits(self, features: BlockFeatures, blocks: AnchorBlocks) -> torch.Tensor:
        """[B, A, K, V'] each block's slot scores (K = block_size - 1) over its context."""
        return self.head.logits(self.block_states(features, blocks), self.target.lm_head)

    def block_states(self, features: BlockFeatures, blocks: AnchorBlocks) -> torch.Tensor:
        """[B, A, K, h] each block's slot states (K = block_size - 1) over its context."""
        batch, length, _ = features.streams[0].shape
        context = self.head.context(features.streams)  # [B, T, h]
        positions = torch.arange(length, device=context.device)
        keys = PrefixKeys(self.head.context_keys(context, positions))
        embeds = self.target.embed_tokens(blocks.tokens).detach()  # [B, N, h]
        hidden = self.head(embeds, blocks.positions, keys, mask=blocks.mask)  # [B, N, h]
        size = self.head.config.block_size
        return hidden.view(batch, -1, size, hidden.shape[-1])[:, :, 1:]  # [B, A, K, h]

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.training:
            return self.generator
        return torch.Generator(device=device).manual_seed(0)  # the same held-out blocks


@dataclass(frozen=True)
class AnchorBlocks:
    """A batch's training blocks, A per row of B slots (N = A x B rows): tokens [B, N] (each
    block's anchor token, then the mask token), positions [B, N], mask [B, N, T + N] (the
    context strictly before its anchor, and its own block), label_positions [B, A, B - 1]
    (a + k), labels [B, A, B - 1] (the tokens there) and valid [B, A, B - 1] (a drawn anchor,
    a label inside the row and supervised)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    label_positions: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def anchor_blocks(tokens: torch.Tensor, loss_mask: torch.Tensor, config, anchors: int,
                  generator: torch.Generator | None, rule: str = "next") -> AnchorBlocks:
    """Up to `anchors` distinct anchors per row, drawn uniformly among the positions `rule`
    allows (fixed shapes: a row with fewer has blocks that count nothing), and the blocks at
    them. rule "next": a >= 1 whose next token a + 1 is supervised; "specforge" (SpecForge's
    rule): a >= 0 with tokens a and a + 1 both supervised (a = 0 roots a block with no
    context)."""
    batch, length = tokens.shape
    device, size = tokens.device, config.block_size
    count = max(1, min(anchors, length - 2))
    allowed = torch.zeros(batch, length, dtype=torch.bool, device=device)
    supervised = loss_mask.bool()
    if rule == "specforge":
        allowed[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    else:
        allowed[:, 1:-1] = supervised[:, 2:]  # anchor a: token a + 1 is supervised
    keys = torch.rand(batch, length, generator=generator, device=device)
    keys = keys.masked_fill(~allowed, -1.0)
    chosen, order = torch.topk(keys, count, dim=-1)  # [B, A]
    drawn, anchor = chosen >= 0, order  # [B, A] each
    offsets = torch.arange(size, device=device)
    positions = anchor[..., None] + offsets  # [B, A, S]
    ids = torch.full((batch, count, size), config.mask_token_id, dtype=torch.long,
                     device=device)
    ids[..., 0] = tokens.gather(1, anchor)
    label_positions = positions[..., 1:]  # [B, A, S - 1]
    inside = label_positions < length
    at = label_positions.clamp(max=length - 1).flatten(1)
    labels = tokens.gather(1, at).view_as(label_positions)
    supervised = loss_mask.bool().gather(1, at).view_as(label_positions)
    context = torch.arange(length, device=device) < anchor[..., None]  # [B, A, T]
    own = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool, device=device)] * count)
    mask = torch.cat([context.repeat_interleave(size, dim=1),
                      own.expand(batch, -1, -1)], dim=-1)  # [B, N, T + N]
    return AnchorBlocks(ids.flatten(1), positions.flatten(1), mask, label_positions, labels,
                        drawn[..., None] & inside & supervised)


# ---- entry -----------------------------------------------------------------------------------

HEAD = "dflash_head"  # the setting naming the head's export folder


@dataclass(frozen=True)
class DFlashVariant(Variant):
    method: str = "dflash"
    tree_nodes: int | None = None  # None: a chain
    confidence_threshold: float | None = None  # a draft cut by the head's confidence

    def label(self) -> str:
        shape = "" if self.tree_nodes is None else f"/tree{self.tree_nodes}"
        cut = "" if self.confidence_threshold is None else f"/conf{self.confidence_threshold:g}"
        return self.method + shape + cut


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[DFlashVariant, ...]:
    """A row per dflash.tree_nodes value and, beside each, one per dflash.confidence_threshold."""
    settings = cfg.get("dflash", {})
    nodes = as_list(settings.get("tree_nodes")) or [None]
    if not all(n is None or is_count(n) for n in nodes):
        raise ValueError(f"dflash.tree_nodes: give node counts >= 1 (null: a chain), got "
                         f"{nodes}")
    cuts = [t for t in as_list(settings.get("confidence_threshold")) if t is not None]
    if not all(is_number(t) and 0 < float(t) < 1 for t in cuts):
        raise ValueError(f"dflash.confidence_threshold: give numbers in (0, 1) (the least "
                         f"cumulative predicted acceptance of a proposed position; null: the "
                         f"whole chain), got {cuts}")
    return tuple(DFlashVariant(tree_nodes=n, confidence_threshold=t)
                 for n in nodes for t in [None, *map(float, cuts)])


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEAD, "dflash", "dflash", "a trained head")


def fold_lengths(cfg: DictConfig, variant: Variant, lengths: tuple[int, ...]
                 ) -> tuple[int, ...]:
    """One forward drafts at most block_size - 1 tokens: longer lengths fold into that one."""
    meta = json.loads((head_folder(cfg, HEAD) / "head_config.json").read_text())
    most = int(meta["config"]["block_size"]) - 1
    return tuple(sorted({min(k, most) for k in lengths}))


def head(loaded: Loaded) -> DFlashHead:
    return loaded.once(HEAD, lambda: load_dflash(head_folder(loaded.cfg, HEAD), loaded.target))


def load(loaded: Loaded, chosen: tuple[DFlashVariant, ...]) -> None:
    head(loaded)


def drafter(loaded: Loaded, variant: DFlashVariant, k: int) -> DFlashDrafter:
    return dflash_drafter(head(loaded), loaded.cfg.dflash, k, variant.tree_nodes,
                          variant.confidence_threshold)


def dflash_drafter(head: DFlashHead, settings: DictConfig, k: int | None,
                   tree_nodes: int | None, confidence_threshold: float | None = None
                   ) -> DFlashDrafter:
    """The DFlash drafter, of generation's rows and of the trainer's judge and report alike:
    k tokens (None: the block's B - 1) from one forward, as a chain (tree_nodes None) or
    DDTree's best-first tree of tree_nodes nodes; children drawn from each position's law when
    sampling unless the `dflash` section's sampled_children is false; cut by the head's
    confidence at confidence_threshold (None: the whole draft)."""
    return DFlashDrafter(head, k, tree_nodes=tree_nodes,
                         sampled_children=bool(settings.sampled_children),
                         confidence_threshold=confidence_threshold)


def load_dflash(folder: str | Path, target: Transformer) -> DFlashHead:
    """The head of a train/dflash.py export (refused when trained for another target)."""
    return load_head(folder, DFlashHead, DFlashConfig, target=target)


# ---- the trainer (train/dflash.py) ---------------------------------------------------------

DFLASH_LOSSES = ("ce", "kl")  # against the data; against the target's law


def dflash_config(cfg: DictConfig, target: ModelConfig, mask_token_id: int) -> DFlashConfig:
    """The head's config for the target from cfg.dflash (target_layers null: num_features
    streams spaced as the references space them)."""
    d = cfg.dflash
    layers = d.get("target_layers")
    try:
        return DFlashConfig.for_target(
            target, mask_token_id=mask_token_id, num_layers=d.num_layers,
            block_size=d.block_size, num_features=d.num_features,
            target_layers=None if layers is None else tuple(OmegaConf.to_container(layers)),
            draft_vocab_size=d.get("draft_vocab_size"), qk_norm=bool(d.qk_norm),
            confidence_head=bool(d.get("confidence_head", False)))
    except ValueError as exc:
        raise ValueError(str(exc).replace("DFlashConfig: ", "dflash.", 1)) from None


def meta_head(cfg: DictConfig) -> DFlashHead:
    """The configured head on the meta device (no weights), its mask token dflash.mask_token_id
    or 0 before the training rows exist."""
    mask = cfg.dflash.get("mask_token_id")
    with torch.device("meta"):
        return DFlashHead(dflash_config(cfg, model_config(cfg.model), mask or 0))


def check_dflash_settings(cfg: DictConfig) -> None:
    """Every cfg.dflash setting checked from the config alone (a head on the meta device, no
    weights): the head, its objective's settings and the drafter the report uses."""
    d = cfg.dflash
    dflash_trainer_drafter(cfg, meta_head(cfg))
    if not is_count(d.anchors):
        raise ValueError(f"dflash.anchors must be an integer >= 1, got {d.anchors!r}")
    if not float(d.gamma) > 0:
        raise ValueError(f"dflash.gamma must be > 0 (slot k weighs exp(-(k-1)/gamma)), got "
                         f"{d.gamma}")
    if d.loss not in DFLASH_LOSSES:
        raise ValueError(f"dflash.loss must be ce (against the data) or kl (against the "
                         f"target's law), got {d.loss!r}")
    if d.get("anchor_rule", "next") not in ANCHOR_RULES:
        raise ValueError(f"dflash.anchor_rule must be next (a >= 1, token a + 1 supervised) or "
                         f"specforge (a >= 0, tokens a and a + 1 supervised), got "
                         f"{d.anchor_rule!r}")
    objective = training.training_objective(cfg)
    if objective != "kl" and d.loss != "kl":
        raise ValueError(f"trainer.objective={objective} fits the draft's law to the target's: "
                         f"set dflash.loss=kl (against the target's law) with it; "
                         f"dflash.loss=ce trains on the data's tokens, by cross-entropy only")


def dflash_head(cfg: DictConfig, target: Transformer, train: TokenRows) -> DFlashHead:
    """A fresh head sized for the target. The mask token is dflash.mask_token_id, or (null)
    the training rows' rarest token (the highest id among equals), so that it stands for
    nothing the rows say; with dflash.draft_vocab_size the draft vocabulary is the rows' most
    frequent tokens (where the loss counts). Its final norm (and LM head rows) start from the
    target's."""
    config = dflash_config(cfg, target.config,
                           training.mask_token(cfg.dflash.get("mask_token_id"), target, train))
    torch.manual_seed(int(cfg.seed))
    head = DFlashHead(config).to(target.embed_tokens.weight)
    if config.draft_vocab_size is not None:
        head.set_draft_vocab(draft_vocabulary(train.tokens, config.vocab_size,
                                              config.draft_vocab_size, train.loss_mask))
    return head.init_from_target(target)


def dflash_objective(cfg: DictConfig, target: Transformer, head: DFlashHead,
                     features: FeatureSource | None = None) -> DFlashObjective:
    """Blocks at dflash.anchors anchors a row (where dflash.anchor_rule allows them), slots
    weighted by dflash.gamma, against the data (dflash.loss=ce) or the target's law (kl) by
    trainer.objective; features: the target's states from a feature store."""
    d = cfg.dflash
    return DFlashObjective(target, head, anchors=int(d.anchors), gamma=float(d.gamma),
                           teacher=d.loss == "kl", objective=training.training_objective(cfg),
                           cache_features=bool(d.get("cache_features", False)),
                           features=features, anchor_rule=d.get("anchor_rule", "next"))


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    return dflash_objective(run.cfg, run.target, run.module, features)


def exporter(run: training.TrainingRun, trained: torch.nn.Module) -> training.Export:
    """The head alone (safetensors + config), in the published checkpoints' names."""
    return training.head_exporter(run.module, "head.", run.target)


def dflash_trainer_drafter(cfg: DictConfig, trained: DFlashHead) -> DFlashDrafter:
    """train/dflash.py's drafter (`dflash_drafter` on its settings): dflash.num_draft_tokens
    (null: the block's B - 1) as a chain, or DDTree's tree of dflash.tree_nodes nodes; cut at
    dflash.confidence_threshold (a head trained with dflash.confidence_head)."""
    d = cfg.dflash
    return dflash_drafter(trained, d, d.get("num_draft_tokens"), d.get("tree_nodes"),
                          d.get("confidence_threshold"))


def dflash_drafters(cfg: DictConfig, target: Transformer, export: Path) -> training.ExportDrafters:
    """The exported head, drafting as the config says (dflash.num_draft_tokens, tree_nodes)."""
    return {"": (dflash_trainer_drafter(cfg, load_dflash(export, target)), target)}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the head, on meta tensors."""
    print(model_plan(cfg).format())
    print(head_training_lines(meta_head(cfg), int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the trained head over plain decoding of the
    target."""
    drafter, comparison = training.final_comparison(cfg, dflash_drafters, export)
    top1 = training.heldout_top1(metrics, "eval/dflash/")
    shape = (f"a chain of {drafter.k}" if drafter.shape.nodes is None
             else f"a best-first tree of {drafter.shape.nodes} nodes, {drafter.k} deep")
    layers = drafter.head.config.num_layers
    training.log_report(cfg, tracker, comparison, {**top1, "head": str(export)},
                        f"DFlash head ({layers} layer{'s' if layers > 1 else ''}, blocks of "
                        f"{drafter.head.config.block_size}, drafting {shape}): {export}",
                        f"top-1 agreement with the data per slot (held-out): {top1}")


def random_dflash(target: Transformer, tree: TreeChoices, seed: int) -> DFlashDrafter:
    """bench_decode's drafter: a random one-layer DFlash head, blocks of 9 (8 tokens drafted
    in one forward, a chain)."""
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, mask_token_id=target.config.vocab_size - 1,
                                     block_size=9)
    return DFlashDrafter(DFlashHead(config).to(target.embed_tokens.weight).eval())


ENTRIES = (MethodEntry(
    name="dflash", summary="a DFlash block drafter: k tokens in one forward over the target's "
                           "features, as a chain or a best-first tree",
    variants=variants, load=load, drafter=drafter, check=check, lengths=fold_lengths,
    default_when=when_set(HEAD), head=DFlashHead, color="tab:olive", order=45,
    cost_rows={"dflash": CostRow("DFlash head, one layer, 8 tokens drafted in one forward (a "
                                 "chain)", random_dflash)}),)

TRAINER = TrainerEntry(
    name="dflash", config="train_dflash", check=check_dflash_settings, dry_run=dry_run,
    module=dflash_head, streams=lambda head: head.config.target_layers, objective=objective,
    exporter=exporter, drafters=dflash_drafters, report=report,
    report_settings=("dflash.num_draft_tokens", "dflash.tree_nodes", "dflash.sampled_children"),
    store_layers={"dflash": default_target_layers}, curve_variants={"dflash": ()}, order=45)
