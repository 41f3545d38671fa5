"""The small draft model (`SmallModelDrafter`): a separate, smaller model with the target's
tokenizer (model.draft), or one cut from the target and trained by train/draft.py.

Rows: small_model[/V{K}][/top{W}][/stop{t}][/pard] for each K in small_model.draft_vocab (its K
most frequent training tokens; null: the whole vocabulary), W in small_model.first_candidates
(the first token's candidates; 1: a chain), t in small_model.confidence_threshold (end a draft
below that top-1 probability; null: never) and small_model.parallel (true: PARD, all k tokens
from one forward with k - 1 mask tokens, for a draft train/draft.py trained so; its rows are
chains without a confidence stop, so they come only with W = 1 and t = null).

Trainer (train/draft.py, conf/train_draft.yaml): a draft cut from the target (its first
draft_model.num_layers layers, final norm and LM head) distilled on the frozen target's law,
token by token or (draft_model.parallel=K) as PARD's parallel draft; the export is a Hugging
Face folder with the target's tokenizer, the training rows' token counts and (PARD) pard.json;
the judge and the report draft draft_model.num_draft_tokens tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from selfspec.checks import is_count, is_int_in
from selfspec.drafters import SmallModelDrafter
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config import training
from selfspec.from_config.common import as_list, device, positive_int
from selfspec.from_config.methods import draft_model_settings
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    TrainerEntry,
    always,
    read_moved_setting,
)
from selfspec.from_config.models import (
    compile_steps,
    load_model,
    model_config,
    model_plan,
    resolve_model_path,
    target_quantization,
)
from selfspec.heads.base import LossOutput
from selfspec.heads.draft_vocab import (
    DraftVocab,
    load_draft_vocab,
    most_frequent,
    save_token_counts,
)
from selfspec.heads.early_exit import exit_loss
from selfspec.measure.grid import Variant
from selfspec.model import Transformer
from selfspec.model.plan import trainable_line
from selfspec.tracking import Tracker
from selfspec.training.features import FeatureSource
from selfspec.training.loop import state_part
from selfspec.training.objectives import (
    feature_source,
    freeze,
    frozen_states,
    law_objective,
    parallel_rows,
)
from selfspec.training.rows import TokenRows

# ---- objective -------------------------------------------------------------------------------


class DraftModelObjective(nn.Module):
    """A separate draft model distilled on the frozen target's law (`exit_loss`: by
    `objective`, plus hard_weight x cross-entropy to the tokens). Only the draft's
    parameters that require grad train (a draft cut from the target keeps its embedding and
    LM head frozen).

    draft_vocab: both laws restricted to those ids (EAGLE-3's loss), the draft scoring only
    them, as it will when drafting; on a small real target the full LM head and its softmax
    are most of a training step. cache_features: the target's last hidden states are computed
    once per row and its LM head re-applied, not its layers (see FeatureCache); features: read
    them from elsewhere (a feature store).

    parallel: K > 1 trains PARD's parallel draft, which fills k - 1 mask tokens
    (`mask_token_id`) after the last real one in one forward: the row is replicated K times
    (`parallel_rows`), copy j holding the mask at every position, and the mask at position p of
    copy j sees the real tokens up to p - j and the masks of copies 1..j at p - j + 1..p, so
    it stands where a draft's j-th mask stands and learns the target's law at p, as the
    real row does. Every copy's rows count alike."""

    def __init__(self, target: Transformer, draft: Transformer, hard_weight: float = 0.0,
                 cache_features: bool = False, draft_vocab: DraftVocab | None = None,
                 features: FeatureSource | None = None, parallel: int = 1,
                 mask_token_id: int | None = None, objective: str = "kl"):
        super().__init__()
        if not hard_weight >= 0:
            raise ValueError(f"DraftModelObjective: hard_weight must be >= 0, got {hard_weight}")
        if hard_weight and draft_vocab is not None:
            raise ValueError("DraftModelObjective: hard_weight > 0 with a draft vocabulary is not "
                             "supported (tokens outside it have no label); set one of them")
        if not is_count(parallel) or (parallel > 1) != (mask_token_id is not None):
            raise ValueError(f"DraftModelObjective: parallel must be an integer >= 1, with a "
                             f"mask_token_id when > 1, got {parallel!r} and {mask_token_id!r}")
        self.target, self.draft, self.hard_weight = freeze(target), draft, hard_weight
        self.parallel, self.mask_token_id = parallel, mask_token_id
        self.features = feature_source((), cache_features, features, "DraftModelObjective")
        self.objective = objective
        self.divergence = law_objective(objective, "DraftModelObjective")
        ids = None if draft_vocab is None else draft_vocab.target_ids
        self.register_buffer("vocab_ids", ids, persistent=False)

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            hidden = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
            teacher = self._scores(self.target, hidden)
        rows = parallel_rows(tokens, loss_mask, self.parallel, self.mask_token_id)
        out = self.draft(rows.tokens, rows.positions, mask=rows.mask, with_logits=False,
                         return_hidden=(self.draft.config.num_layers,))
        logits = self._scores(self.draft, self.draft.norm(out.hidden[0]))  # [B, K T, V]
        copies = logits.view(*tokens.shape[:1], self.parallel, tokens.shape[1], -1)
        parts = [exit_loss(copies[:, j], teacher, tokens, rows.loss_mask[:, j],
                           self.hard_weight, self.divergence) for j in range(self.parallel)]
        part = parts[0]
        metrics = {f"draft/{k}": v for k, v in part.metrics.items()}
        if self.parallel == 1:
            return LossOutput(part.loss, metrics)
        counts = rows.loss_mask[:, :, 1:].sum(dim=(0, 2)).float()  # [K] rows each copy counts
        loss = sum(p.loss * n for p, n in zip(parts, counts, strict=True)) / counts.sum().clamp(
            min=1.0)
        metrics |= {f"draft/mask{j}_top1": p.metrics["top1"] for j, p in enumerate(parts) if j}
        return LossOutput(loss, metrics)

    def _scores(self, model: Transformer, normed: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (or [B, T, K] over the draft vocabulary) of final-norm states."""
        weight = model.lm_head.weight
        weight = weight if self.vocab_ids is None else weight[self.vocab_ids]
        return model.final_logits(F.linear(normed, weight)).float()


# ---- entry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmallModelVariant(Variant):
    method: str = "small_model"
    draft_vocab: int | None = None
    first_candidates: int = 1
    confidence_threshold: float | None = None
    parallel: bool = False

    def label(self) -> str:
        return (self.method + ("" if self.draft_vocab is None else f"/V{self.draft_vocab}")
                + ("" if self.first_candidates == 1 else f"/top{self.first_candidates}")
                + ("" if self.confidence_threshold is None
                   else f"/stop{self.confidence_threshold:g}")
                + ("/pard" if self.parallel else ""))


def variants(cfg: DictConfig, with_comparisons: bool = True) -> tuple[SmallModelVariant, ...]:
    group = cfg.get("small_model", {})
    sizes = as_list(group.get("draft_vocab")) or [None]
    widths = as_list(group.get("first_candidates")) or [1]
    stops = as_list(group.get("confidence_threshold")) or [None]
    if not all(is_count(k) for k in sizes if k is not None):
        raise ValueError(f"small_model.draft_vocab: give token counts >= 1 (or null for the "
                         f"whole vocabulary), got {sizes}")
    if not all(map(is_count, widths)):
        raise ValueError(f"small_model.first_candidates: give candidate counts >= 1 (1: a "
                         f"chain), got {widths}")
    stops = [check_confidence_threshold("small_model", t) for t in stops]
    parallel = as_list(group.get("parallel")) or [False]
    if not all(isinstance(p, bool) for p in parallel):
        raise ValueError(f"small_model.parallel: give true (PARD) or false, got {parallel}")
    return tuple(SmallModelVariant(draft_vocab=k, first_candidates=w, confidence_threshold=t,
                                   parallel=p)
                 for k in sizes for w in widths for t in stops for p in parallel
                 if not p or (w == 1 and t is None))


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    resolve_model_path(draft_model_settings(cfg), "model.draft")


OLD_KEYS = ("confidence_threshold", "draft_vocab", "first_candidates")  # before small_model.*


def read_old_keys(cfg: DictConfig) -> None:
    """Its settings given under their old top-level keys (`first_candidates=3`), checked under
    the key given, read into small_model.* with a warning."""
    for old in OLD_KEYS:
        value = cfg.get(old)
        if value is None:
            continue
        if old == "first_candidates":
            positive_int(cfg, old)
        elif old == "confidence_threshold":
            check_confidence_threshold("drafter=small_model", value)
        read_moved_setting(cfg, old, f"small_model.{old}")


def draft_model(loaded: Loaded) -> Transformer:
    """model.draft, loaded once (hf_assisted reads the same folder)."""
    cfg = loaded.cfg
    return loaded.once("draft_model", lambda: load_model(
        draft_model_settings(cfg), "model.draft", cfg.model.dtype, device(cfg),
        compile_steps(cfg)))


def _vocab(loaded: Loaded, size: int | None) -> DraftVocab | None:
    if size is None:
        return None
    return loaded.once(f"draft_vocab/{size}",
                       lambda: load_draft_vocab(draft_model(loaded).source, size))


def load(loaded: Loaded, chosen: tuple[SmallModelVariant, ...]) -> None:
    draft_model(loaded)
    for variant in chosen:
        _vocab(loaded, variant.draft_vocab)
        if variant.parallel:
            read_pard(draft_model(loaded).source)


def drafter(loaded: Loaded, variant: SmallModelVariant, k: int) -> SmallModelDrafter:
    return small_model_drafter(draft_model(loaded), variant, k,
                               _vocab(loaded, variant.draft_vocab))


def small_model_drafter(model: Transformer, variant: SmallModelVariant, k: int,
                        draft_vocab: DraftVocab | None) -> SmallModelDrafter:
    """The draft model's drafter, of generation's rows and of the trainer's judge and report
    alike: k tokens a step as the variant says (the first token's candidates, the confidence
    stop; PARD's parallel draft with the mask token recorded beside the model), scoring only
    `draft_vocab` (the variant's K most frequent training tokens) when given."""
    mask = read_pard(model.source)["mask_token_id"] if variant.parallel else None
    return SmallModelDrafter(model, num_draft_tokens=k, draft_vocab=draft_vocab,
                             confidence_threshold=variant.confidence_threshold,
                             first_candidates=variant.first_candidates, mask_token_id=mask)


PARD_FILE = "pard.json"  # beside a draft trained to fill masks: its mask token, its K


def write_pard(folder: str | Path, mask_token_id: int, parallel: int) -> None:
    """Record, beside a draft model train/draft.py trained for PARD, what drafting needs."""
    (Path(folder) / PARD_FILE).write_text(json.dumps({"mask_token_id": int(mask_token_id),
                                                      "parallel": int(parallel)}) + "\n")


def read_pard(folder: str | Path | None) -> dict:
    """The PARD settings recorded beside a draft model, or an error naming the fix."""
    path = Path(str(folder)) / PARD_FILE
    if folder is None or not path.is_file():
        raise FileNotFoundError(f"small_model.parallel=true needs a draft trained to fill mask "
                                f"tokens (train/draft.py draft_model.parallel=K): no {PARD_FILE} "
                                f"in {folder}")
    return json.loads(path.read_text())


# ---- the trainer of draft models cut from the target (train/draft.py) ------------------------


def check_draft_model_settings(cfg: DictConfig) -> int:
    """Every cfg.draft_model setting of train/draft.py checked from the config alone (no
    weights); returns the draft's layer count."""
    d, target = cfg.draft_model, model_config(cfg.model)
    if target_quantization(cfg.model) is not None:
        raise ValueError("train/draft.py cuts the draft from the target's full-precision "
                         "weights: set model.quantize=null (a draft trained so can still draft "
                         "for the quantized target in a sweep)")
    for key in ("num_layers", "num_draft_tokens"):
        if not is_count(d[key]):
            raise ValueError(f"draft_model.{key} must be an integer >= 1, got {d[key]!r}")
    if d.num_layers >= target.num_layers:
        raise ValueError(f"draft_model.num_layers={d.num_layers}: a draft must be shallower than "
                         f"the target ({target.num_layers} layers)")
    if not float(d.hard_weight) >= 0:
        raise ValueError(f"draft_model.hard_weight must be >= 0, got {d.hard_weight}")
    size = d.get("draft_vocab")
    if size is not None and not (isinstance(size, int) and 1 <= size <= target.vocab_size):
        raise ValueError(f"draft_model.draft_vocab must be null or 1..vocab_size, got {size!r}")
    parallel, mask = d.get("parallel", 1), d.get("mask_token_id")
    if not is_count(parallel):
        raise ValueError(f"draft_model.parallel must be an integer >= 1 (1: token by token; "
                         f"K: PARD, K tokens from one forward), got {parallel!r}")
    if mask is not None and not is_int_in(mask, range(target.vocab_size)):
        raise ValueError(f"draft_model.mask_token_id must be null or a token id in "
                         f"[0, {target.vocab_size}), got {mask!r}")
    if parallel > 1 and d.num_draft_tokens > parallel:
        raise ValueError(f"draft_model.num_draft_tokens={d.num_draft_tokens}: a draft trained "
                         f"to fill {parallel - 1} masks drafts at most {parallel} tokens at once")
    training.training_objective(cfg)
    return int(d.num_layers)


def draft_from_target(cfg: DictConfig, target: Transformer) -> Transformer:
    """A fresh draft: the target's first draft_model.num_layers layers, its final norm and LM
    head (copies), the embedding and LM head frozen unless draft_model.train_embeddings."""
    return freeze_draft_embeddings(cfg, target.first_layers(int(cfg.draft_model.num_layers)))


def freeze_draft_embeddings(cfg: DictConfig, draft: Transformer) -> Transformer:
    if not cfg.draft_model.get("train_embeddings", False):
        draft.embed_tokens.requires_grad_(False)
        draft.lm_head.requires_grad_(False)
    return draft


def pard(cfg: DictConfig) -> int:
    """draft_model.parallel: 1 drafts token by token; K > 1 is PARD's, K tokens a forward."""
    return int(cfg.draft_model.get("parallel", 1))


def draft_model_mask(cfg: DictConfig, target: Transformer, train: TokenRows) -> int | None:
    """PARD's mask token (draft_model.parallel > 1, `mask_token`); None for a draft that
    drafts token by token."""
    if pard(cfg) == 1:
        return None
    return training.mask_token(cfg.draft_model.get("mask_token_id"), target, train)


def draft_model_objective(cfg: DictConfig, target: Transformer, draft: Transformer,
                          counts: torch.Tensor, mask_token_id: int | None = None,
                          features: FeatureSource | None = None) -> DraftModelObjective:
    """The draft distilled on the frozen target's law by trainer.objective (plus
    draft_model.hard_weight x
    cross-entropy to the tokens), over draft_model.draft_vocab's most frequent tokens of the
    training rows' counts [V] when set; features: the target's states from a feature store.
    With a mask token (`draft_model_mask`), PARD's parallel draft of draft_model.parallel
    tokens."""
    d = cfg.draft_model
    vocab = None if d.draft_vocab is None else most_frequent(counts, int(d.draft_vocab))
    return DraftModelObjective(target, draft, float(d.hard_weight), bool(d.cache_features),
                               vocab, features, parallel=pard(cfg), mask_token_id=mask_token_id,
                               objective=training.training_objective(cfg))


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    return draft_model_objective(run.cfg, run.target, run.module,
                                 training.rows_token_counts(run.target, run.train),
                                 draft_model_mask(run.cfg, run.target, run.train), features)


def exporter(run: training.TrainingRun, trained: DraftModelObjective) -> training.Export:
    """The draft as a Hugging Face folder, the target's tokenizer and the training rows' token
    counts (any draft vocabulary size is chosen from them later); a PARD draft its pard.json."""
    cfg, mask = run.cfg, trained.mask_token_id
    counts = training.rows_token_counts(run.target, run.train)

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        draft = draft_from_target(cfg, run.target)
        draft.load_state_dict(state_part(state, "draft."), strict=False)
        draft.save_pretrained(folder)
        run.tokenizer.save_pretrained(folder)
        save_token_counts(folder, counts)
        if mask is not None:
            write_pard(folder, mask, pard(cfg))

    return export


def draft_model_drafters(cfg: DictConfig, target: Transformer, export: Path
                         ) -> training.ExportDrafters:
    """The exported draft, drafting draft_model.num_draft_tokens tokens for `target`
    (`small_model_drafter` on the trainer's settings)."""
    weight = target.embed_tokens.weight
    draft = Transformer.from_pretrained(export, dtype=weight.dtype, device=weight.device)
    size = cfg.draft_model.draft_vocab
    variant = SmallModelVariant(draft_vocab=size, parallel=pard(cfg) > 1)
    vocab = None if size is None else load_draft_vocab(export, int(size))
    k = int(cfg.draft_model.num_draft_tokens)
    return {"": (small_model_drafter(draft, variant, k, vocab), target)}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the draft, on meta tensors."""
    print(model_plan(cfg).format())
    config = model_config(cfg.model)
    with torch.device("meta"):  # sized from the config: no weights, no memory
        draft = Transformer(config).first_layers(check_draft_model_settings(cfg))
    freeze_draft_embeddings(cfg, draft)
    count = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(trainable_line(f"trainable draft (the target's first {draft.config.num_layers} "
                         f"layers and final norm)", count, int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the exported draft over plain decoding of the
    target, on fresh weights, whatever DeepSpeed did to the trained ones."""
    _, comparison = training.final_comparison(cfg, draft_model_drafters, export)
    top1 = metrics.get("eval/draft/top1")
    parallel = pard(cfg)
    training.log_report(
        cfg, tracker, comparison,
        {"draft": str(export), "heldout_top1": None if top1 is None else round(top1, 3)},
        f"draft model: {export} (draft vocabulary: {cfg.draft_model.draft_vocab or 'whole'}"
        f"{f'; PARD, up to {parallel} tokens a forward' if parallel > 1 else ''})",
        f"held-out top-1 agreement with the target: {top1}")


ENTRIES = (MethodEntry(
    name="small_model", summary="a separate small draft model with the target's tokenizer",
    variants=variants, load=load, drafter=drafter, check=check, default_when=always,
    color="tab:blue", order=0, runs_draft_model=True, read_old_keys=read_old_keys),)

TRAINER = TrainerEntry(
    name="draft", config="train_draft", check=check_draft_model_settings, dry_run=dry_run,
    module=lambda cfg, target, train: draft_from_target(cfg, target), objective=objective,
    exporter=exporter, drafters=draft_model_drafters, report=report,
    curve_variants={"draft": (), "pard": ("draft_model.parallel=4",)}, order=60)
