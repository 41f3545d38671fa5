"""What each trainer composes from its config: one section per trainable method, read by
its entry point (train/<method>.py) through `from_config`, each in the same four steps:

1. `check_<method>_settings(cfg)`: every setting checked from the config alone, before any
   weights load (a trainer passes it to `start_training`);
2. the fresh trainable module, sized for the target (`medusa_heads`, `eagle_head`,
   `early_exit_heads`, `draft_from_target`, `dflash_head`);
3. `<method>_objective(cfg, target, module, ...)`: what `training.loop.fit` trains;
4. `<method>_drafters(cfg, target, export)`: the drafters an export makes, each with the
   target it verifies on, for the trainer's judge (`from_config.tau_judge`) and its report.

What the method's registry entry also needs (loading an export, its drafter from a tree
config) stays in its module under `methods/`, and is imported from there. Settings shared by
every trainer (the trainer, the optimizer, the data, the judge) are `from_config.training`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.checks import is_count, is_int_in
from selfspec.drafters import (
    DFlashDrafter,
    EagleDrafter,
    EarlyExitDrafter,
    ParallelEagleDrafter,
    SmallModelDrafter,
)
from selfspec.from_config.common import checked_settings
from selfspec.from_config.methods.dflash import load_dflash
from selfspec.from_config.methods.eagle import load_eagle
from selfspec.from_config.methods.early_exit import (
    early_exit_layers,
    early_exit_thresholds,
    load_early_exit,
)
from selfspec.from_config.methods.medusa import load_medusa, medusa_drafter
from selfspec.from_config.methods.small_model import read_pard
from selfspec.from_config.models import model_config, target_quantization
from selfspec.from_config.training import ExportDrafters
from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.draft_vocab import (
    draft_vocabulary,
    load_draft_vocab,
    most_frequent,
    rarest_token,
    token_counts,
)
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.early_exit import ExitConfig, ExitHead
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.model import ModelConfig, Transformer, dense_weight
from selfspec.model.lora import LoraSettings, add_lora
from selfspec.training.features import FeatureSource
from selfspec.training.objectives import (
    DFlashObjective,
    DraftModelObjective,
    Eagle3Objective,
    EagleObjective,
    EarlyExitObjective,
    Medusa2Objective,
    MedusaObjective,
)
from selfspec.training.rows import TokenRows
from selfspec.tree import Tree

# ---- Medusa heads (train/medusa.py) -------------------------------------------------------------


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
    """Every cfg.medusa setting checked from the config alone (no weights); returns the
    version. A model without an `arch` block has its config.json read, nothing more."""
    version = medusa_version(cfg)
    medusa_config(cfg, model_config(cfg.model))
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
    return version


def check_medusa_tree(cfg: DictConfig, target: Transformer) -> None:
    """Refuse a cfg.tree the configured heads cannot fill, before any weights are built."""
    with torch.device("meta"):
        medusa_drafter(cfg.tree, MedusaHeads(medusa_config(cfg, target.config)))


def medusa_heads(cfg: DictConfig, target: Transformer, train: TokenRows | None = None
                 ) -> tuple[MedusaHeads, MedusaConfig]:
    """Fresh Medusa heads sized for the target (output layers copied from its LM head); with
    medusa.draft_vocab_size, over the most frequent tokens of the training rows `train`."""
    config = medusa_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    heads = MedusaHeads(config).to(target.embed_tokens.weight.dtype)
    if config.draft_vocab_size is not None:
        if train is None:
            raise ValueError("medusa.draft_vocab_size: the draft vocabulary is read from the "
                             "training rows: pass them to from_config.medusa_heads")
        heads.set_draft_vocab(draft_vocabulary(train.tokens, config.vocab_size,
                                               config.draft_vocab_size, train.loss_mask))
    if cfg.medusa.init_from_lm_head:
        heads.init_from_lm_head(dense_weight(target.lm_head).detach())
    return heads, config


def medusa_objective(
    cfg: DictConfig, target: Transformer, heads: MedusaHeads,
    features: FeatureSource | None = None,
) -> MedusaObjective | Medusa2Objective:
    """The training objective of cfg.medusa.version; Medusa-2 wraps the target with LoRA.
    features: the target's states read from a feature store (Medusa-1)."""
    decay = float(cfg.medusa.decay)
    cache = bool(cfg.medusa.get("cache_features", False))
    if medusa_version(cfg) == 1:
        return MedusaObjective(target, heads, decay=decay, cache_features=cache,
                               features=features)
    if cache or features is not None:
        raise ValueError("medusa.cache_features=true and trainer.features need a frozen target "
                         "(Medusa-1): Medusa-2 trains the target, whose features change every "
                         "step")
    adapted = add_lora(target, lora_settings(cfg))
    return Medusa2Objective(adapted, heads, decay=decay, lm_weight=float(cfg.medusa.lm_weight),
                            adapter_lr_scale=float(cfg.medusa.lora.lr_scale))


def medusa_drafters(cfg: DictConfig, target: Transformer, export: Path) -> ExportDrafters:
    """The exported heads on cfg.tree, and the target they verify on: `target`, or for a
    Medusa-2 export a fresh copy of it with the export's adapter merged."""
    heads, adapted = load_medusa(cfg, export, target)
    return {"": (medusa_drafter(cfg.tree, heads), adapted or target)}


# ---- EAGLE heads (train/eagle.py) ---------------------------------------------------------------


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
            parallel=parallel, mask_token_id=None if parallel == 1 else mask_token_id)
    except ValueError as exc:
        raise ValueError(str(exc).replace("EagleConfig: ", "eagle.", 1)) from None


def check_eagle_settings(cfg: DictConfig) -> int:
    """Every cfg.eagle setting checked from the config alone (a head on the meta device, no
    weights): the head's config, loss weights, and the drafter the report will use (tree
    sizes, total_tokens >= depth, top_k within the vocabulary). Returns the version."""
    version = eagle_version(cfg)
    with torch.device("meta"):
        meta_head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    eagle_drafter(cfg, meta_head)
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
    return version


def eagle_head(cfg: DictConfig, target: Transformer, train: TokenRows
               ) -> tuple[EagleHead, EagleConfig]:
    """A fresh head sized for the target. EAGLE-3: the draft vocabulary is the
    eagle.draft_vocab_size most frequent tokens of the training rows (where the loss counts),
    and the head's LM head starts from the target's rows of it; P-EAGLE's mask token is
    eagle.mask_token_id or (null) the rows' rarest token, so that it stands for nothing the
    rows say. EAGLE-1 heads score the full vocabulary through the target's LM head."""
    mask = None
    if cfg.eagle.get("parallel", 1) != 1:
        mask = mask_token(cfg.eagle.get("mask_token_id"), target, train)
    config = eagle_config(cfg, target.config, mask)
    torch.manual_seed(int(cfg.seed))
    head = EagleHead(config).to(target.embed_tokens.weight.dtype)
    if config.version == 3:
        vocab = draft_vocabulary(train.tokens, config.vocab_size, config.draft_vocab_size,
                                 train.loss_mask)
        head.set_draft_vocab(vocab).init_from_target(target)
    return head, config


def eagle_objective(
    cfg: DictConfig, target: Transformer, head: EagleHead,
    features: FeatureSource | None = None,
) -> EagleObjective | Eagle3Objective:
    """The training objective of cfg.eagle.version: EAGLE-1 heads (versions 1, 2) learn the
    next feature and token law with uniform feature noise (drawn from torch's default
    generator, which `fit` seeds and checkpoints); EAGLE-3 heads the training-time test.
    features: the target's states read from a feature store."""
    e = cfg.eagle
    cache = bool(e.get("cache_features", False))
    if eagle_version(cfg) < 3:
        return EagleObjective(target, head, feature_weight=float(e.feature_weight),
                              token_weight=float(e.token_weight),
                              feature_noise=float(e.feature_noise), cache_features=cache,
                              features=features)
    return Eagle3Objective(target, head, steps=int(e.ttt_steps), decay=float(e.ttt_decay),
                           cache_features=cache, features=features,
                           keep=float(e.parallel_keep))


def eagle_drafter(cfg: DictConfig, eagle: EagleHead) -> EagleDrafter | ParallelEagleDrafter:
    """train/eagle.py's drafter: version 1 a static tree (cfg.tree's `choices`), versions 2
    and 3 an EAGLE-2 dynamic tree (eagle.total_tokens, eagle.depth, eagle.top_k); a P-EAGLE
    head its K tokens from one forward, a chain or (eagle.tree_nodes) a best-first tree."""
    e, sampled = cfg.eagle, bool(cfg.eagle.sampled_children)
    if eagle.config.parallel > 1:
        return ParallelEagleDrafter(eagle, tree_nodes=e.get("tree_nodes"),
                                    sampled_children=sampled)
    if eagle_version(cfg) == 1:
        if cfg.tree.get("choices") is None:
            raise ValueError(f"eagle.version=1 drafts a static tree: pick one with `choices` "
                             f"(tree=chain4|medusa_small|medusa_63), not tree={cfg.tree.name}; "
                             f"or draft dynamic trees with eagle.version=2")
        choices = OmegaConf.to_container(cfg.tree.choices)
        return EagleDrafter(eagle, Tree.from_paths(choices), sampled_children=sampled)
    return EagleDrafter(eagle, total_tokens=e.total_tokens, depth=e.depth, top_k=e.top_k,
                        sampled_children=sampled)


def eagle_drafters(cfg: DictConfig, target: Transformer, export: Path) -> ExportDrafters:
    """The exported head, drafting as the config says (eagle.version's tree) for `target`."""
    return {"": (eagle_drafter(cfg, load_eagle(export, target)), target)}


# ---- early exits (train/early_exit.py) ----------------------------------------------------------


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
    store), each on the target's final law (plus early_exit.hard_weight x cross-entropy to
    the tokens)."""
    return EarlyExitObjective(target, heads, hard_weight=float(cfg.early_exit.hard_weight),
                              features=features)


def early_exit_drafter(cfg: DictConfig, head: ExitHead, k: int | None = None,
                       threshold: float | None = None) -> EarlyExitDrafter:
    """train/early_exit.py's drafter: up to early_exit.num_draft_tokens (or k) tokens, stopping
    below the (first) early_exit.confidence_threshold unless one is given."""
    k = int(cfg.early_exit.num_draft_tokens) if k is None else k
    threshold = early_exit_thresholds(cfg)[0] if threshold is None else threshold
    return EarlyExitDrafter(head, k, threshold)


def early_exit_drafters(cfg: DictConfig, target: Transformer, export: Path) -> ExportDrafters:
    """The exported adapter of each exit layer E, drafting for `target` (named E{E})."""
    exits = {e: load_early_exit(export / f"E{e}", target, exit_layer=e)
             for e in early_exit_layers(cfg, target.config.num_layers)}
    return {f"E{e}": (early_exit_drafter(cfg, head), target) for e, head in exits.items()}


# ---- draft models cut from the target (train/draft.py) ------------------------------------------


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


def mask_token(setting: int | None, target: Transformer, train: TokenRows) -> int:
    """The mask token of a method that drafts from masks (PARD, DFlash, P-EAGLE): its
    `mask_token_id` setting, or (null) the training rows' rarest token (the highest id among
    equals), so that it stands for nothing the rows say."""
    if setting is not None:
        return int(setting)
    return rarest_token(token_counts(train.tokens, target.config.vocab_size))


def draft_model_mask(cfg: DictConfig, target: Transformer, train: TokenRows) -> int | None:
    """PARD's mask token (draft_model.parallel > 1, `mask_token`); None for a draft that
    drafts token by token."""
    d = cfg.draft_model
    if int(d.get("parallel", 1)) == 1:
        return None
    return mask_token(d.get("mask_token_id"), target, train)


def draft_model_objective(cfg: DictConfig, target: Transformer, draft: Transformer,
                          counts: torch.Tensor, mask_token_id: int | None = None,
                          features: FeatureSource | None = None) -> DraftModelObjective:
    """The draft distilled on the frozen target's law (plus draft_model.hard_weight x
    cross-entropy to the tokens), over draft_model.draft_vocab's most frequent tokens of the
    training rows' counts [V] when set; features: the target's states from a feature store.
    With a mask token (`draft_model_mask`), PARD's parallel draft of draft_model.parallel
    tokens."""
    d = cfg.draft_model
    vocab = None if d.draft_vocab is None else most_frequent(counts, int(d.draft_vocab))
    return DraftModelObjective(target, draft, float(d.hard_weight), bool(d.cache_features),
                               vocab, features, parallel=int(d.get("parallel", 1)),
                               mask_token_id=mask_token_id)


def draft_model_drafters(cfg: DictConfig, target: Transformer, export: Path
                         ) -> ExportDrafters:
    """The exported draft, drafting draft_model.num_draft_tokens tokens for `target`."""
    weight = target.embed_tokens.weight
    draft = Transformer.from_pretrained(export, dtype=weight.dtype, device=weight.device)
    size = cfg.draft_model.draft_vocab
    vocab = None if size is None else load_draft_vocab(export, int(size))
    k = int(cfg.draft_model.num_draft_tokens)
    mask = read_pard(export)["mask_token_id"] if int(cfg.draft_model.get("parallel", 1)) > 1 \
        else None
    return {"": (SmallModelDrafter(draft, k, draft_vocab=vocab, mask_token_id=mask), target)}


# ---- DFlash block drafters (train/dflash.py) ----------------------------------------------------

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
            draft_vocab_size=d.get("draft_vocab_size"), qk_norm=bool(d.qk_norm))
    except ValueError as exc:
        raise ValueError(str(exc).replace("DFlashConfig: ", "dflash.", 1)) from None


def check_dflash_settings(cfg: DictConfig) -> None:
    """Every cfg.dflash setting checked from the config alone (a head on the meta device, no
    weights): the head, its objective's settings and the drafter the report uses."""
    d, target = cfg.dflash, model_config(cfg.model)
    mask = d.get("mask_token_id")
    with torch.device("meta"):
        meta_head = DFlashHead(dflash_config(cfg, target, 0 if mask is None else mask))
    dflash_drafter(cfg, meta_head)
    if not is_count(d.anchors):
        raise ValueError(f"dflash.anchors must be an integer >= 1, got {d.anchors!r}")
    if not float(d.gamma) > 0:
        raise ValueError(f"dflash.gamma must be > 0 (slot k weighs exp(-(k-1)/gamma)), got "
                         f"{d.gamma}")
    if d.loss not in DFLASH_LOSSES:
        raise ValueError(f"dflash.loss must be ce (against the data) or kl (against the "
                         f"target's law), got {d.loss!r}")


def dflash_head(cfg: DictConfig, target: Transformer, train: TokenRows) -> DFlashHead:
    """A fresh head sized for the target. The mask token is dflash.mask_token_id, or (null)
    the training rows' rarest token (the highest id among equals), so that it stands for
    nothing the rows say; with dflash.draft_vocab_size the draft vocabulary is the rows' most
    frequent tokens (where the loss counts). Its final norm (and LM head rows) start from the
    target's."""
    config = dflash_config(cfg, target.config,
                           mask_token(cfg.dflash.get("mask_token_id"), target, train))
    torch.manual_seed(int(cfg.seed))
    head = DFlashHead(config).to(target.embed_tokens.weight)
    if config.draft_vocab_size is not None:
        head.set_draft_vocab(draft_vocabulary(train.tokens, config.vocab_size,
                                              config.draft_vocab_size, train.loss_mask))
    return head.init_from_target(target)


def dflash_objective(cfg: DictConfig, target: Transformer, head: DFlashHead,
                     features: FeatureSource | None = None) -> DFlashObjective:
    """Blocks at dflash.anchors anchors a row, slots weighted by dflash.gamma, against the data
    (dflash.loss=ce) or the target's law (kl); features: the target's states from a feature
    store."""
    d = cfg.dflash
    return DFlashObjective(target, head, anchors=int(d.anchors), gamma=float(d.gamma),
                           teacher=d.loss == "kl",
                           cache_features=bool(d.get("cache_features", False)),
                           features=features)


def dflash_drafter(cfg: DictConfig, trained: DFlashHead) -> DFlashDrafter:
    """train/dflash.py's drafter (held-out tau, the report): dflash.num_draft_tokens (null:
    the block's B - 1) as a chain, or DDTree's tree of dflash.tree_nodes nodes."""
    d = cfg.dflash
    return DFlashDrafter(trained, d.get("num_draft_tokens"), tree_nodes=d.get("tree_nodes"),
                         sampled_children=bool(d.sampled_children))


def dflash_drafters(cfg: DictConfig, target: Transformer, export: Path) -> ExportDrafters:
    """The exported head, drafting as the config says (dflash.num_draft_tokens, tree_nodes)."""
    return {"": (dflash_drafter(cfg, load_dflash(export, target)), target)}
