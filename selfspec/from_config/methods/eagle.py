"""EAGLE heads (`EagleHead`, drafted by `EagleDrafter`): a one-layer head over the target's
features, trained by train/eagle.py. eagle.version 1: an EAGLE-1 head drafting a static tree;
2: the same head drafting EAGLE-2 dynamic trees; 3: an EAGLE-3 head (fused target layers, a
draft vocabulary, trained with the training-time test) drafting dynamic trees.

Rows: eagle, at each draft length k an EAGLE-2 dynamic tree k deep with eagle.total_tokens
nodes and eagle.top_k children per frontier node (whatever the head's version); a P-EAGLE head
(trained with eagle.parallel=K) drafts its k <= K tokens from one forward instead, a chain or
(eagle.tree_nodes) a best-first tree (`ParallelEagleDrafter`).

Trainer (train/eagle.py, conf/train_eagle.yaml): a fresh head of eagle.version (EAGLE-3's draft
vocabulary from the training rows; eagle.parallel=K: P-EAGLE's), trained on the frozen target;
the export holds the head and the training rows' token counts; the judge and the report draft
as `eagle_trainer_drafter` reads the trainer's settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from selfspec.checks import check_count, is_count
from selfspec.drafters import EagleDrafter, ParallelEagleDrafter
from selfspec.from_config import training
from selfspec.from_config.methods.entry import (
    Loaded,
    MethodEntry,
    TrainerEntry,
    head_folder,
    one_variant,
    required_head_folder,
    when_set,
)
from selfspec.from_config.models import model_config, model_plan
from selfspec.heads.base import LossOutput
from selfspec.heads.draft_vocab import DraftVocab, draft_vocabulary, load_draft_vocab
from selfspec.heads.eagle import EagleConfig, EagleHead, default_target_layers
from selfspec.heads.eagle_losses import (
    DraftTeacher,
    eagle3_loss,
    eagle_loss,
    parallel_confidence_loss,
    parallel_eagle3_loss,
)
from selfspec.heads.io import load_head
from selfspec.measure.grid import Variant
from selfspec.measure.method_costs import EAGLE2_PAPER, CostRow, TreeChoices
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
    parallel_rows,
)
from selfspec.training.rows import TokenRows
from selfspec.tree import Tree

HEAD = "eagle_head"  # the setting naming the head's export folder


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    required_head_folder(cfg, HEAD, "eagle", "eagle", "a trained head")
    check_eagle_tree(cfg, lengths)
    size = cfg.eagle.get("draft_vocab")
    if size is not None and not is_count(size):
        raise ValueError(f"eagle.draft_vocab must be null or a token count >= 1, got {size!r}")


def check_eagle_tree(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """EAGLE drafts an EAGLE-2 tree as deep as each draft length k, with eagle.total_tokens
    nodes and eagle.top_k children per frontier node: every k must fit in total_tokens."""
    e = cfg.eagle
    for key in ("total_tokens", "top_k"):
        if not is_count(e[key]):
            raise ValueError(f"eagle.{key} must be an integer >= 1, got {e[key]!r}")
    if max(lengths) > e.total_tokens:
        raise ValueError(f"eagle.total_tokens ({e.total_tokens}) < the longest draft length "
                         f"({max(lengths)}): a tree that deep needs that many nodes; raise "
                         f"eagle.total_tokens or lower num_draft_tokens")


def head(loaded: Loaded) -> EagleHead:
    return loaded.once(HEAD, lambda: load_eagle(head_folder(loaded.cfg, HEAD), loaded.target))


def drafter(loaded: Loaded, variant: Variant, k: int) -> EagleDrafter | ParallelEagleDrafter:
    return eagle_drafter(head(loaded), loaded.cfg.eagle, k, draft_vocab=draft_vocab(loaded))


def eagle_drafter(eagle: EagleHead, settings: DictConfig, depth: int | None = None, *,
                  tree: Tree | None = None, draft_vocab: DraftVocab | None = None
                  ) -> EagleDrafter | ParallelEagleDrafter:
    """The EAGLE drafter, of generation's rows and of the trainer's judge and report alike, from
    an `eagle` settings section (sampled_children; an EAGLE-2 tree's total_tokens and top_k; a
    P-EAGLE head's tree_nodes and confidence_threshold): a P-EAGLE head drafts `depth` tokens
    (None: its K) from one forward, a chain cut by its confidence at confidence_threshold when
    set; another head the static `tree` when given, else an EAGLE-2 dynamic tree `depth` deep
    (over the K most frequent tokens of `draft_vocab`, when given)."""
    sampled = bool(settings.sampled_children)
    most, threshold = eagle.config.parallel, settings.get("confidence_threshold")
    if most > 1:
        if depth is not None and depth > most:
            raise ValueError(f"eagle: the P-EAGLE head drafts at most {most} tokens a forward; "
                             f"use num_draft_tokens <= {most}")
        return ParallelEagleDrafter(eagle, depth, tree_nodes=settings.get("tree_nodes"),
                                    sampled_children=sampled, confidence_threshold=threshold)
    if threshold is not None:
        raise ValueError(f"eagle.confidence_threshold={threshold} cuts a P-EAGLE head's chain "
                         f"(one trained with eagle.parallel=K and eagle.confidence_head=true); "
                         f"this head drafts one token a forward: set it to null")
    if tree is not None:
        return EagleDrafter(eagle, tree, sampled_children=sampled)
    return EagleDrafter(eagle, total_tokens=settings.total_tokens, depth=depth,
                        top_k=settings.top_k, sampled_children=sampled, draft_vocab=draft_vocab)


def draft_vocab(loaded: Loaded) -> DraftVocab | None:
    """eagle.draft_vocab=K: the K most frequent tokens of the head's training data (the counts
    train/eagle.py keeps beside its export); null: the whole vocabulary."""
    size = loaded.cfg.eagle.get("draft_vocab")
    if size is None:
        return None
    folder = head_folder(loaded.cfg, HEAD)
    return loaded.once(f"eagle_vocab/{size}", lambda: load_draft_vocab(folder, size))


def load(loaded: Loaded, chosen: tuple[Variant, ...]) -> None:
    head(loaded)


def load_eagle(folder: str | Path, target: Transformer) -> EagleHead:
    """The head of a train/eagle.py export (refused when trained for another target)."""
    return load_head(folder, EagleHead, EagleConfig, target=target)


# ---- the trainer (train/eagle.py) ----------------------------------------------------------


EAGLE_VERSIONS = {1: "EAGLE-1 head, static tree", 2: "EAGLE-1 head, EAGLE-2 dynamic tree",
                  3: "EAGLE-3 head, EAGLE-2 dynamic tree"}


def eagle_version(cfg: DictConfig) -> int:
    """1: an EAGLE-1 head drafting cfg.tree (static); 2: the same head drafting EAGLE-2 dynamic
    trees; 3: an EAGLE-3 head (fused layers, draft vocabulary) drafting dynamic trees."""
    version = cfg.eagle.get("version", 1)
    if version not in EAGLE_VERSIONS:
        choices = "; ".join(f"{v}: {what}" for v, what in EAGLE_VERSIONS.items())
        raise ValueError(f"eagle.version must be 1, 2 or 3 ({choices}), got {version!r}")
    return int(version)


EAGLE3_DRAFT_VOCAB = 1024  # eagle.draft_vocab_size=null: a small target's CPU default


def eagle_config(cfg: DictConfig, target_config: ModelConfig, mask_token_id: int | None = None
                 ) -> EagleConfig:
    """The head's config for the target: EAGLE-1 (versions 1, 2) or EAGLE-3 (version 3, with
    eagle.draft_vocab_size and eagle.target_layers, null = the inputs of 2, L//2, L-3), and
    with eagle.parallel=K > 1 P-EAGLE's (mask_token_id: its mask; None: eagle.mask_token_id,
    or token 0 for a config checked before its training rows exist)."""
    e, version = cfg.eagle, eagle_version(cfg)
    layers, fc_bias = e.get("target_layers"), e.get("fc_bias")
    parallel = e.get("parallel", 1)
    if mask_token_id is None:
        mask_token_id = e.get("mask_token_id", 0) or 0  # 0: a config checked before its rows
    if fc_bias is not None and not isinstance(fc_bias, bool):
        raise ValueError(f"eagle.fc_bias must be null, true or false, got {fc_bias!r}")
    if parallel != 1 and version != 3:
        raise ValueError(f"eagle.parallel={parallel} (P-EAGLE) drafts with EAGLE-3 heads: set "
                         f"eagle.version=3, or eagle.parallel=1")
    if e.get("confidence_head", False) and parallel == 1:
        raise ValueError("eagle.confidence_head=true sizes a P-EAGLE block: set eagle.version=3 "
                         "and eagle.parallel=K > 1, or leave it false")
    if version < 3:
        if e.get("draft_vocab_size") is not None or layers is not None:
            raise ValueError(f"eagle.draft_vocab_size and eagle.target_layers are EAGLE-3's: an "
                             f"EAGLE-{version} head reads the last hidden state and scores the "
                             f"whole vocabulary through the target's LM head (drafting, "
                             f"eagle.draft_vocab=K keeps K rows of it); leave them unset, or set "
                             f"eagle.version=3")
        return EagleConfig.for_target(target_config, 1, fc_bias=fc_bias)
    draft_vocab = e.get("draft_vocab_size")
    try:
        return EagleConfig.for_target(
            target_config, 3, fc_bias=fc_bias,
            draft_vocab_size=EAGLE3_DRAFT_VOCAB if draft_vocab is None else draft_vocab,
            target_layers=None if layers is None else tuple(OmegaConf.to_container(layers)),
            parallel=parallel, mask_token_id=None if parallel == 1 else mask_token_id,
            confidence_head=bool(e.get("confidence_head", False)))
    except ValueError as exc:
        raise ValueError(str(exc).replace("EagleConfig: ", "eagle.", 1)) from None


PARALLEL_LOSSES = ("per_copy", "pooled")  # P-EAGLE: one mean a copy, or one over all rows


def check_eagle_settings(cfg: DictConfig) -> int:
    """Every cfg.eagle setting checked from the config alone (a head on the meta device, no
    weights): the head's config, loss weights, and the drafter the report will use (tree
    sizes, total_tokens >= depth, top_k within the vocabulary). Returns the version."""
    version = eagle_version(cfg)
    with torch.device("meta"):
        meta_head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    eagle_trainer_drafter(cfg, meta_head)
    e = cfg.eagle
    for key in ("feature_weight", "token_weight", "feature_noise"):
        if not float(e[key]) >= 0:
            raise ValueError(f"eagle.{key} must be >= 0, got {e[key]}")
    if not float(e.ttt_decay) > 0:
        raise ValueError(f"eagle.ttt_decay must be > 0 (step j weighs decay**j), "
                         f"got {e.ttt_decay}")
    if not is_count(e.ttt_steps):
        raise ValueError(f"eagle.ttt_steps must be an integer >= 1, got {e.ttt_steps!r}")
    if not 0 < float(e.parallel_keep) <= 1:
        raise ValueError(f"eagle.parallel_keep must be in (0, 1] (a copy's chance to be kept "
                         f"once the one before it is), got {e.parallel_keep}")
    if e.get("parallel_loss", "per_copy") not in PARALLEL_LOSSES:
        raise ValueError(f"eagle.parallel_loss must be per_copy (one mean a copy, summed) or "
                         f"pooled (one mean over every kept row), got {e.parallel_loss!r}")
    if not 0 <= float(e.get("parallel_keep_floor", 0.0)) <= 1:
        raise ValueError(f"eagle.parallel_keep_floor must be in [0, 1] (the least share of "
                         f"anchors whose copy j is kept), got {e.parallel_keep_floor}")
    training.training_objective(cfg)
    return version


def eagle_head(cfg: DictConfig, target: Transformer, train: TokenRows) -> EagleHead:
    """A fresh head sized for the target. EAGLE-3: the draft vocabulary is the
    eagle.draft_vocab_size most frequent tokens of the training rows (where the loss counts),
    and the head's LM head starts from the target's rows of it; P-EAGLE's mask token is
    eagle.mask_token_id or (null) the rows' rarest token, so that it stands for nothing the
    rows say. EAGLE-1 heads score the full vocabulary through the target's LM head."""
    mask = None
    if cfg.eagle.get("parallel", 1) != 1:
        mask = training.mask_token(cfg.eagle.get("mask_token_id"), target, train)
    config = eagle_config(cfg, target.config, mask)
    torch.manual_seed(int(cfg.seed))
    head = EagleHead(config).to(target.embed_tokens.weight.dtype)
    if config.version == 3:
        vocab = draft_vocabulary(train.tokens, config.vocab_size, config.draft_vocab_size,
                                 train.loss_mask)
        head.set_draft_vocab(vocab).init_from_target(target)
    return head


class EagleObjective(nn.Module):
    """EAGLE-1 (and EAGLE-2, which drafts with the same heads): row t of the head reads
    (token t+1, the frozen target's feature f_t) and learns f_{t+1} (smooth-L1, weight
    feature_weight) and the target's law of token t+2 through the target's LM head (by
    `objective`, weight token_weight). Row t counts when token t+2 is a prediction target.

    feature_noise: during training the input features get uniform noise in
    [-feature_noise, feature_noise] (the head learns to read its own imperfect features), drawn
    from `generator` (None: torch's default generator, which `fit` seeds and checkpoints).
    cache_features: keep each row's last hidden states (`FeatureCache`; the noise is drawn
    afresh every step); features: read them from elsewhere (a feature store).
    """

    def __init__(self, target: Transformer, head: EagleHead, feature_weight: float = 1.0,
                 token_weight: float = 0.1, feature_noise: float = 0.0,
                 generator: torch.Generator | None = None, cache_features: bool = False,
                 features: FeatureSource | None = None, objective: str = "kl"):
        super().__init__()
        if head.config.version != 1:
            raise ValueError("EagleObjective trains EAGLE-1 heads; use Eagle3Objective for EAGLE-3")
        if not feature_noise >= 0:
            raise ValueError(f"EagleObjective: feature_noise must be >= 0, got {feature_noise}")
        self.target, self.head = freeze(target), head
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.feature_noise, self.generator = feature_noise, generator
        self.features = feature_source((), cache_features, features, "EagleObjective")
        self.objective, self.divergence = objective, law_objective(objective, "EagleObjective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            last = frozen_states(self.target, tokens, (), self.features).last  # [B, T, H]
            embeds = self.target.embed_tokens(tokens)
        feature = self._noisy(last[:, :-1])  # [B, T-1, H] f_t for t <= T-2
        positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
        predicted = self.head(embeds[:, 1:], feature, positions)  # [B, T-1, H] f_{t+1}
        valid = torch.cat([loss_mask[:, 2:].bool(), loss_mask.new_zeros(
            loss_mask.shape[0], 1, dtype=torch.bool)], dim=1)  # [B, T-1]: token t+2 counts
        # Both LM heads score only the rows that count (a chat row's prompt does not): [1, n].
        kept, next_feature = predicted[valid][None], last[:, 1:][valid][None]
        with torch.no_grad():
            target_logits = self.target.logits_of(next_feature)
        return eagle_loss(kept, self.head.logits(kept, self.target.lm_head), next_feature,
                          target_logits, None, self.feature_weight, self.token_weight,
                          divergence=self.divergence)

    def _noisy(self, feature: torch.Tensor) -> torch.Tensor:
        if not self.training or self.feature_noise == 0:
            return feature
        noise = torch.rand(feature.shape, generator=self.generator, device=feature.device,
                           dtype=feature.dtype)  # [B, T-1, H] uniform in [0, 1)
        return feature + (2 * noise - 1) * self.feature_noise


class Eagle3Objective(nn.Module):
    """EAGLE-3: the head fuses the frozen target's layers `head.config.target_layers` and is
    trained by the training-time test (`EagleHead.unroll`, `steps` steps, step j weighing
    decay**j) against the target's law restricted to the head's draft vocabulary.
    cache_features: keep each row's fused streams and last hidden state (`FeatureCache`);
    features: read them from elsewhere (a feature store holding those layers).

    A P-EAGLE head (`parallel=K`) trains instead on its rows and K - 1 copies of mask pairs in
    one forward (`parallel_pairs`), copy j weighing decay**j (`parallel_eagle3_loss`); keep:
    PARD's conditional drop, each anchor's copy j kept with probability keep once its copy
    j - 1 is (1: every copy of every anchor), so with probability keep**j, or max(keep**j,
    keep_floor) (`copy_keep_chances`; speculators' P-EAGLE keeps max(0.7**j, 0.2) of its rows),
    drawn from `generator` (None: torch's default generator, which `fit` seeds and
    checkpoints; held-out evaluation draws from a fixed seed); pooled: one mean over every
    kept row in place of one a copy (speculators')."""

    def __init__(self, target: Transformer, head: EagleHead, steps: int = 7, decay: float = 0.8,
                 cache_features: bool = False, features: FeatureSource | None = None,
                 keep: float = 0.5, generator: torch.Generator | None = None,
                 objective: str = "kl", keep_floor: float = 0.0, pooled: bool = False):
        super().__init__()
        if head.config.version != 3:
            raise ValueError("Eagle3Objective trains EAGLE-3 heads; use EagleObjective for EAGLE-1")
        check_count("steps", steps, owner="Eagle3Objective")
        if not 0 < keep <= 1:
            raise ValueError(f"Eagle3Objective: keep must be in (0, 1], got {keep}")
        if not 0 <= keep_floor <= 1:
            raise ValueError(f"Eagle3Objective: keep_floor must be in [0, 1], got {keep_floor}")
        self.target, self.head, self.steps, self.decay = freeze(target), head, steps, decay
        self.keep, self.keep_floor, self.generator = float(keep), float(keep_floor), generator
        self.pooled = bool(pooled)
        self.features = feature_source(head.config.target_layers, cache_features, features,
                                       "Eagle3Objective")
        self.objective, self.divergence = objective, law_objective(objective, "Eagle3Objective")

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            states = frozen_states(self.target, tokens, self.head.config.target_layers,
                                   self.features)
            embeds = self.target.embed_tokens(tokens)
            # the target's laws where a loss row reads them: position p's, when token p + 1
            # counts (not a chat row's prompt)
            needed = torch.cat([loss_mask[:, 1:].bool(), torch.zeros_like(
                loss_mask[:, :1], dtype=torch.bool)], dim=1)  # [B, T]
            teacher = DraftTeacher.at_rows(states.last, needed, self.target.logits_of,
                                           self.head.t2d)
        feature = self.head.target_feature(states.last, states.streams)[:, :-1]  # [B, T-1, H]
        if self.head.config.parallel > 1:
            return self._parallel(tokens, loss_mask, feature, teacher)
        hidden = self.head.unroll(embeds, feature, self.steps)  # steps x [B, T-1, H]
        # the head's LM head scores only the rows that count (a chat row's prompt does not)
        return eagle3_loss(hidden, teacher, self.head.t2d, loss_mask, decay=self.decay,
                           scores=self.head.logits, divergence=self.divergence)

    def _parallel(self, tokens: torch.Tensor, loss_mask: torch.Tensor, feature: torch.Tensor,
                  teacher: DraftTeacher) -> LossOutput:
        """P-EAGLE: row t of copy 0 reads (token t+1, f_t); copy j's row t, a mask pair,
        stands where a draft's j-th mask pair stands after the real pair t - j, and both score
        token t + 2."""
        config = self.head.config
        generator = self.generator if self.training else torch.Generator(
            device=tokens.device).manual_seed(0)  # the same held-out copies
        pairs = parallel_pairs(tokens[:, 1:], config.parallel, config.mask_token_id, self.keep,
                               generator, self.keep_floor)
        embeds = self.target.embed_tokens(pairs.tokens).detach()  # [B, N, h]
        masks = pairs.tokens.shape[1] - feature.shape[1]
        features = torch.cat([feature, self.head.mask_hidden.expand(
            feature.shape[0], masks, -1).to(feature)], dim=1)  # [B, N, h]
        hidden = self.head(embeds, features, pairs.positions, mask=pairs.mask)
        logits = self.head.logits(hidden)
        out = parallel_eagle3_loss(logits, pairs.copies, pairs.positions, teacher,
                                   self.head.t2d, config.parallel, loss_mask, decay=self.decay,
                                   divergence=self.divergence, pooled=self.pooled)
        confidence = detached_confidence(self.head, hidden)
        if confidence is None:
            return out
        confident = parallel_confidence_loss(confidence, logits, pairs.copies, pairs.positions,
                                             teacher, self.head.t2d, config.parallel,
                                             loss_mask)
        return LossOutput(out.loss + confident.loss, out.metrics | confident.metrics)


@dataclass(frozen=True)
class ParallelPairs:
    """P-EAGLE's rows of a batch of pairs [B, T]: tokens [B, N] (the real row, then the mask
    pairs kept), and of each row its copy [N] (0: real; j: the j-th mask pair after the real
    pair at position - j), position [N] and the attention mask [N, N]."""

    tokens: torch.Tensor
    copies: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


def copy_keep_chances(copies: int, keep: float, floor: float = 0.0) -> list[float]:
    """Copy j's chance (j = 1..copies - 1) to be kept once copy j - 1 is, such that copy j is
    kept with probability max(keep**j, floor): keep while keep**j >= floor (PARD's
    conditional drop), then what holds the kept share at the floor."""
    return [keep if keep**j >= floor else floor / max(keep ** (j - 1), floor)
            for j in range(1, copies)]


def kept_copies(length: int, copies: int, keep: float, floor: float,
                generator: torch.Generator | None, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """[length] how many mask copies each anchor keeps (copy j only when copies 1..j - 1
    are), by `copy_keep_chances`."""
    draws = torch.rand(length, copies - 1, generator=generator, device=device)
    chances = torch.tensor(copy_keep_chances(copies, keep, floor), dtype=draws.dtype,
                           device=device)
    return (draws < chances).long().cumprod(dim=1).sum(dim=1)


def parallel_pairs(tokens: torch.Tensor, copies: int, mask_token_id: int, keep: float,
                   generator: torch.Generator | None, keep_floor: float = 0.0
                   ) -> ParallelPairs:
    """The replicated rows of PARD (`parallel_rows`, whose attention a mask pair shares),
    thinned by its conditional drop: anchor a's copy j (at position a + j) is kept with
    probability keep once its copy j - 1 is (`kept_copies`: max(keep**j, keep_floor) in all),
    the same anchors for every row of the batch, so every kept row's keys are kept too."""
    length = tokens.shape[1]
    rows = parallel_rows(tokens, torch.ones_like(tokens), copies, mask_token_id)
    copy = torch.arange(copies, device=tokens.device).repeat_interleave(length)  # [K T]
    depth = kept_copies(length, copies, keep, keep_floor, generator, tokens.device)  # [T]
    anchor = rows.positions - copy  # [K T]
    kept = (copy == 0) | ((anchor >= 0) & (copy <= depth[anchor.clamp(min=0)]))
    picked = kept.nonzero().flatten()
    return ParallelPairs(rows.tokens[:, picked], copy[picked], rows.positions[picked],
                         rows.mask[picked][:, picked])


def eagle_objective(
    cfg: DictConfig, target: Transformer, head: EagleHead,
    features: FeatureSource | None = None,
) -> EagleObjective | Eagle3Objective:
    """The training objective of cfg.eagle.version: EAGLE-1 heads (versions 1, 2) learn the
    next feature and token law with uniform feature noise (drawn from torch's default
    generator, which `fit` seeds and checkpoints); EAGLE-3 heads the training-time test; both
    meet the target's law by trainer.objective. features: the target's states read from a
    feature store."""
    e = cfg.eagle
    cache, name = bool(e.get("cache_features", False)), training.training_objective(cfg)
    if eagle_version(cfg) < 3:
        return EagleObjective(target, head, feature_weight=float(e.feature_weight),
                              token_weight=float(e.token_weight),
                              feature_noise=float(e.feature_noise), cache_features=cache,
                              features=features, objective=name)
    return Eagle3Objective(target, head, steps=int(e.ttt_steps), decay=float(e.ttt_decay),
                           cache_features=cache, features=features,
                           keep=float(e.parallel_keep), objective=name,
                           keep_floor=float(e.get("parallel_keep_floor", 0.0)),
                           pooled=e.get("parallel_loss", "per_copy") == "pooled")


def objective(run: training.TrainingRun, features: FeatureSource | None) -> torch.nn.Module:
    return eagle_objective(run.cfg, run.target, run.module, features)


def exporter(run: training.TrainingRun, trained: torch.nn.Module) -> training.Export:
    """The head (safetensors + config, in the published checkpoints' names) and the training
    rows' token counts (an EAGLE-1 head's eagle.draft_vocab is chosen from them)."""
    counts = training.rows_token_counts(run.target, run.train)
    return training.head_exporter(run.module, "head.", run.target, counts)


def eagle_trainer_drafter(cfg: DictConfig, eagle: EagleHead
                          ) -> EagleDrafter | ParallelEagleDrafter:
    """train/eagle.py's drafter (`eagle_drafter` on its settings): version 1 a static tree
    (cfg.tree's `choices`), versions 2 and 3 an EAGLE-2 dynamic tree eagle.depth deep; a
    P-EAGLE head its K tokens from one forward."""
    if eagle.config.parallel > 1:
        return eagle_drafter(eagle, cfg.eagle)
    if eagle_version(cfg) > 1:
        return eagle_drafter(eagle, cfg.eagle, int(cfg.eagle.depth))
    if cfg.tree.get("choices") is None:
        raise ValueError(f"eagle.version=1 drafts a static tree: pick one with `choices` "
                         f"(tree=chain4|medusa_small|medusa_63), not tree={cfg.tree.name}; "
                         f"or draft dynamic trees with eagle.version=2")
    tree = Tree.from_paths(OmegaConf.to_container(cfg.tree.choices))
    return eagle_drafter(eagle, cfg.eagle, tree=tree)


def eagle_drafters(cfg: DictConfig, target: Transformer, export: Path) -> training.ExportDrafters:
    """The exported head, drafting as the config says (eagle.version's tree) for `target`."""
    return {"": (eagle_trainer_drafter(cfg, load_eagle(export, target)), target)}


def dry_run(cfg: DictConfig) -> None:
    """The memory plan of the target and the head, on meta tensors."""
    eagle_version(cfg)
    print(model_plan(cfg).format())
    with torch.device("meta"):  # sized from the config: no weights, no memory
        head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    print(head_training_lines(head, int(cfg.num_gpus)))


def report(cfg: DictConfig, export: Path, metrics: dict, tracker: Tracker) -> None:
    """tau, speedup and draft time share of the trained head over plain decoding of the
    target."""
    _, comparison = training.final_comparison(cfg, eagle_drafters, export)
    top1, version = training.heldout_top1(metrics), eagle_version(cfg)
    parallel = int(cfg.eagle.get("parallel", 1))
    kind = (f"P-EAGLE: EAGLE-3 head, {parallel} tokens a forward" if parallel > 1
            else EAGLE_VERSIONS[version])
    training.log_report(cfg, tracker, comparison,
                        {**top1, "head": str(export), "eagle_version": version},
                        f"EAGLE head ({kind}): {export}",
                        f"top-1 agreement with the target (held-out): {top1}")


def random_eagle(version: int, static_tree: bool):
    """bench_decode's EAGLE drafter over a random head of `version` (EAGLE-3: a quarter of the
    vocabulary drafted): over the static tree given, or EAGLE-2's published 60-node tree."""

    def drafter(target: Transformer, tree: TreeChoices, seed: int) -> EagleDrafter:
        config = target.config
        torch.manual_seed(seed)
        extra = {"draft_vocab_size": config.vocab_size // 4} if version == 3 else {}
        head = EagleHead(EagleConfig.for_target(config, version, **extra))
        shape = {"tree": tree} if static_tree else {"total_tokens": 60, "depth": 6, "top_k": 10}
        return EagleDrafter(head.to(target.embed_tokens.weight).eval(), **shape)

    return drafter


def tree_depth(drafter: EagleDrafter) -> int:
    return drafter.shape.depth


COST_ROWS = {
    "eagle2": CostRow("EAGLE-1 head, EAGLE-2 tree: 60 nodes, depth 6, top-10",
                      random_eagle(1, False), tree_depth, 4.98, EAGLE2_PAPER),
    "eagle3": CostRow("EAGLE-3 head, EAGLE-2 tree: 60 nodes, depth 6, top-10",
                      random_eagle(3, False), tree_depth),
    "eagle1": CostRow("EAGLE-1 head, the static tree (EAGLE-1's tau is for its own tree)",
                      random_eagle(1, True), tree_depth, 3.94, EAGLE2_PAPER),
}

ENTRIES = (MethodEntry(
    name="eagle",
    summary="an EAGLE-1/EAGLE-3 head over the target's features, drafting EAGLE-2 trees",
    variants=one_variant("eagle"), load=load, drafter=drafter, check=check,
    default_when=when_set(HEAD), head=EagleHead, color="tab:red", order=40,
    cost_rows=COST_ROWS),)

TRAINER = TrainerEntry(
    name="eagle", config="train_eagle", check=check_eagle_settings, dry_run=dry_run,
    module=eagle_head, streams=lambda head: head.config.target_layers, objective=objective,
    exporter=exporter, drafters=eagle_drafters, report=report,
    report_settings=("eagle.total_tokens", "eagle.depth", "eagle.top_k", "eagle.sampled_children"),
    store_layers={"eagle3": default_target_layers},
    curve_variants={"eagle1": ("eagle.version=1",), "eagle2": ("eagle.version=2",),
                    "eagle3": ("eagle.version=3",),
                    "peagle": ("eagle.version=3", "eagle.parallel=4")},
    store_bench=("eagle2", "eagle3"), order=40)
