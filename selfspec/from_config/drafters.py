"""Heads and drafters from configs: eval/generate.py's drafter, Medusa heads, trees and
their settings."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.decode import GenerationSettings
from selfspec.draft_vocab import draft_vocabulary, load_draft_vocab
from selfspec.drafters import (
    Drafter,
    EagleDrafter,
    EarlyExitDrafter,
    LookupCorpus,
    MedusaDrafter,
    MedusaProductDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
)
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config.common import (
    as_list,
    checked_settings,
    device,
    positive_int,
    sampling_params,
)
from selfspec.from_config.models import (
    draft_model_config,
    load_model,
    load_target,
    load_tokenizer,
    model_config,
    resolve_model_path,
)
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.early_exit import ExitConfig, ExitHead, check_exit_layer
from selfspec.heads.io import load_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.instructions import cached_answers, shipped_answers
from selfspec.lora import ADAPTER_DIR, LoraSettings, merge_adapter
from selfspec.model import ModelConfig, Transformer
from selfspec.training import TokenRows
from selfspec.tree import Tree

DRAFTERS = ("small_model", "ngram", "none")
SHIPPED = "shipped"  # ngram.corpus=shipped: the answers that ship with the model


def generation_settings(cfg: DictConfig) -> GenerationSettings:
    """eval/generate.py's settings, checked with its device, target folder and drafter choice
    before any model loads."""
    device(cfg)
    resolve_model_path(cfg.model)
    drafter_choice(cfg)
    return GenerationSettings(max_new_tokens=cfg.max_new_tokens,
                              sampling=sampling_params(cfg.sampling), seed=int(cfg.seed))


def drafter_choice(cfg: DictConfig) -> tuple[str, int]:
    """(cfg.drafter, cfg.num_draft_tokens), checked; the small draft model must be on disk."""
    kind, k = cfg.drafter, cfg.num_draft_tokens
    if kind not in DRAFTERS:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DRAFTERS)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}")
    if kind == "small_model":
        resolve_model_path(draft_model_config(cfg, "use drafter=ngram"), "model.draft")
        if "first_candidates" in cfg:
            positive_int(cfg, "first_candidates")
    if kind == "ngram":
        check_ngram_settings(cfg.ngram, cfg.model)
        if len(tree_node_counts(cfg.ngram)) > 1:
            raise ValueError(f"ngram.tree_nodes: give one node count (or null) here, got "
                             f"{tree_node_counts(cfg.ngram)}; a list is for eval/sweep.py")
    check_confidence_threshold("drafter=small_model", cfg.get("confidence_threshold"))
    return kind, k


def build_drafter(cfg: DictConfig, target: Transformer) -> Drafter | None:
    """The drafter named by cfg.drafter (small_model | ngram | none); None = plain decoding."""
    kind, k = drafter_choice(cfg)
    if kind == "none":
        return None
    if kind == "ngram":
        corpus = None
        if cfg.ngram.get("corpus"):
            corpus = load_lookup_corpus(cfg.ngram, cfg.model, load_tokenizer(target.source),
                                        target)
        return ngram_drafter(cfg.ngram, k, corpus, tree_node_counts(cfg.ngram)[0])
    draft_cfg = draft_model_config(cfg, "use drafter=ngram")
    draft = load_model(draft_cfg, "model.draft", cfg.model.dtype, device(cfg))
    size = cfg.get("draft_vocab")
    vocab = None if size is None else load_draft_vocab(draft.source, int(size))
    return SmallModelDrafter(draft, num_draft_tokens=k, draft_vocab=vocab,
                             confidence_threshold=cfg.get("confidence_threshold"),
                             first_candidates=cfg.get("first_candidates", 1))


def ngram_drafter(cfg_ngram: DictConfig, k: int, corpus: LookupCorpus | None,
                  tree_nodes: int | None = None) -> NgramDrafter:
    """N-gram lookup drafting k tokens deep: in the context, and in `corpus` when given (then
    a tree of max(k, tree_nodes) nodes when tree_nodes is set)."""
    nodes = k if corpus is None or tree_nodes is None else max(k, tree_nodes)
    return NgramDrafter(num_draft_tokens=k, max_ngram=int(cfg_ngram.max_ngram), corpus=corpus,
                        max_nodes=nodes)


def ngram_medusa_drafter(cfg_ngram: DictConfig, k: int, heads: MedusaHeads,
                         corpus: LookupCorpus | None,
                         tree_nodes: int | None = None) -> UnionDrafter:
    """Medusa's candidates (ngram.medusa_choices) and n-gram lookup k deep (`ngram_drafter`)
    merged into one tree of at most ngram.merged_nodes nodes, Medusa's first."""
    medusa = MedusaDrafter(heads, medusa_choices(cfg_ngram))
    lookup = ngram_drafter(cfg_ngram, k, corpus, tree_nodes)
    return UnionDrafter([medusa, lookup], max_nodes=merged_nodes(cfg_ngram))


def medusa_choices(cfg_ngram: DictConfig) -> Tree:
    """ngram.medusa_choices as a tree (ngram+medusa's Medusa part), checked."""
    choices = cfg_ngram.get("medusa_choices")
    fix = "give Medusa choices, lists of head ranks such as [[0],[1],[0,0]]"
    if not OmegaConf.is_list(choices) or not choices:
        raise ValueError(f"ngram.medusa_choices: {fix}, got {choices!r}")
    try:
        return Tree.from_paths(OmegaConf.to_container(choices))
    except (ValueError, TypeError) as error:
        raise ValueError(f"ngram.medusa_choices: {fix}; {error}") from None


def merged_nodes(cfg_ngram: DictConfig) -> int:
    value = cfg_ngram.get("merged_nodes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ngram.merged_nodes must be an integer >= 1 (the merged tree's most "
                         f"nodes), got {value!r}")
    return value


def tree_node_counts(cfg_ngram: DictConfig) -> list[int | None]:
    """ngram.tree_nodes as a list (one entry: null or a count; a sweep may give several)."""
    return as_list(cfg_ngram.get("tree_nodes")) or [None]


def check_ngram_settings(cfg_ngram: DictConfig, cfg_model: DictConfig) -> None:
    """The n-gram settings, checked before any model loads (the corpus file must exist)."""
    if cfg_ngram.get("corpus"):
        corpus_path(cfg_ngram, cfg_model)
    lookup_settings(cfg_ngram)


def corpus_path(cfg_ngram: DictConfig, cfg_model: DictConfig) -> Path:
    """ngram.corpus's file: a path, or `shipped` for the answers that ship with the model
    (model.answers, in selfspec/assets/answers/)."""
    if str(cfg_ngram.corpus) == SHIPPED:
        return shipped_corpus(cfg_model)
    path = Path(str(cfg_ngram.corpus)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"ngram.corpus: no file at {path}; give the JSON-lines answers file a trainer wrote "
            f"(train_data.cache_dir/chat-distill-*.jsonl), ngram.corpus={SHIPPED} (a model "
            f"whose answers ship), or ngram.corpus=null")
    return path


def shipped_corpus(cfg_model: DictConfig) -> Path:
    name = cfg_model.get("answers")
    path = shipped_answers(str(name)) if name else None
    if path is None:
        raise FileNotFoundError(
            f"ngram.corpus={SHIPPED}: no answers ship for model={cfg_model.get('name')} (only "
            f"for a model config with `answers`, e.g. model=smollm2-135m); give the answers "
            f"file a trainer wrote (train_data.cache_dir/chat-distill-*.jsonl) instead")
    return path


def lookup_settings(cfg_ngram: DictConfig) -> dict:
    """LookupCorpus's settings from cfg.ngram, checked (tree_nodes too: nulls or counts)."""
    settings = dict(max_ngram=cfg_ngram.max_ngram, length=cfg_ngram.corpus_length)
    nodes = [("tree_nodes", n) for n in tree_node_counts(cfg_ngram) if n is not None]
    for key, value in (*settings.items(), *nodes):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            name = "corpus_length" if key == "length" else key
            raise ValueError(f"ngram.{name} must be an integer >= 1, got {value!r}")
    return settings


def load_lookup_corpus(cfg_ngram: DictConfig, cfg_model: DictConfig, tokenizer,
                       target: Transformer) -> LookupCorpus:
    """The corpus of cfg_ngram.corpus: each answer as the target writes it (its tokens, then
    its end-of-turn token)."""
    end, path = list(target.config.eos_token_ids[:1]), corpus_path(cfg_ngram, cfg_model)
    answers = cached_answers(path)
    sequences = [tokenizer.encode(a, add_special_tokens=False) + end for a in answers]
    corpus = LookupCorpus(sequences, **lookup_settings(cfg_ngram))
    print(f"n-gram corpus {path}: {len(answers)} answers, {corpus.num_tokens} tokens, "
          f"{len(corpus)} n-grams")
    return corpus


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
        lora_settings(cfg)
        if not float(cfg.medusa.lm_weight) >= 0:
            raise ValueError(f"medusa.lm_weight must be >= 0, got {cfg.medusa.lm_weight}")
    return version


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
        heads.init_from_lm_head(target.lm_head.weight.detach())
    return heads, config


def check_medusa_tree(cfg: DictConfig, target: Transformer) -> None:
    """Refuse a cfg.tree the configured heads cannot fill, before any weights are built."""
    with torch.device("meta"):
        medusa_drafter(cfg.tree, MedusaHeads(medusa_config(cfg, target.config)))


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


def load_medusa(
    cfg: DictConfig, folder: str | Path, target: Transformer
) -> tuple[MedusaHeads, Transformer | None]:
    """The heads of a train/medusa.py export, and for a Medusa-2 export the target they draft
    for: a fresh copy of cfg's target with the export's LoRA adapter merged (None for
    Medusa-1, whose heads draft for `target` itself, which is never modified)."""
    heads = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    adapter = Path(folder) / ADAPTER_DIR
    return heads, merge_adapter(load_target(cfg), adapter) if adapter.is_dir() else None


# ---- EAGLE --------------------------------------------------------------------------------

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


def eagle_config(cfg: DictConfig, target_config: ModelConfig) -> EagleConfig:
    """The head's config for the target: EAGLE-1 (versions 1, 2) or EAGLE-3 (version 3, with
    eagle.draft_vocab_size and eagle.target_layers, null = the inputs of 2, L//2, L-3)."""
    e, version = cfg.eagle, eagle_version(cfg)
    layers, fc_bias = e.get("target_layers"), e.get("fc_bias")
    if fc_bias is not None and not isinstance(fc_bias, bool):
        raise ValueError(f"eagle.fc_bias must be null, true or false, got {fc_bias!r}")
    try:
        if version < 3:
            return EagleConfig.for_target(target_config, 1, fc_bias=fc_bias)
        return EagleConfig.for_target(
            target_config, 3, draft_vocab_size=e.draft_vocab_size, fc_bias=fc_bias,
            target_layers=None if layers is None else tuple(OmegaConf.to_container(layers)))
    except ValueError as exc:
        raise ValueError(str(exc).replace("EagleConfig: ", "eagle.", 1)) from None


def check_eagle_settings(cfg: DictConfig) -> int:
    """Every cfg.eagle setting checked from the config alone (a head on the meta device, no
    weights): the head's config, loss weights, and the drafter the report will use (tree
    sizes, total_tokens >= depth, top_k within the vocabulary). Returns the version."""
    version = eagle_version(cfg)
    with torch.device("meta"):
        head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    eagle_drafter(cfg, head)
    e = cfg.eagle
    for key in ("feature_weight", "token_weight", "feature_noise"):
        if not float(e[key]) >= 0:
            raise ValueError(f"eagle.{key} must be >= 0, got {e[key]}")
    if not float(e.ttt_decay) > 0:
        raise ValueError(f"eagle.ttt_decay must be > 0 (step j weighs decay**j), "
                         f"got {e.ttt_decay}")
    if isinstance(e.ttt_steps, bool) or not isinstance(e.ttt_steps, int) or e.ttt_steps < 1:
        raise ValueError(f"eagle.ttt_steps must be an integer >= 1, got {e.ttt_steps!r}")
    return version


def eagle_drafter(cfg: DictConfig, head: EagleHead) -> EagleDrafter:
    """train/eagle.py's drafter: version 1 a static tree (cfg.tree's `choices`), versions 2
    and 3 an EAGLE-2 dynamic tree (eagle.total_tokens, eagle.depth, eagle.top_k)."""
    e, sampled = cfg.eagle, bool(cfg.eagle.sampled_children)
    if eagle_version(cfg) == 1:
        if cfg.tree.get("choices") is None:
            raise ValueError(f"eagle.version=1 drafts a static tree: pick one with `choices` "
                             f"(tree=chain4|medusa_small|medusa_63), not tree={cfg.tree.name}; "
                             f"or draft dynamic trees with eagle.version=2")
        choices = OmegaConf.to_container(cfg.tree.choices)
        return EagleDrafter(head, Tree.from_paths(choices), sampled_children=sampled)
    return EagleDrafter(head, total_tokens=e.total_tokens, depth=e.depth, top_k=e.top_k,
                        sampled_children=sampled)


def eagle_head(cfg: DictConfig, target: Transformer) -> tuple[EagleHead, EagleConfig]:
    """A fresh head sized for the target (EAGLE-3: its draft vocabulary, and then its LM head
    rows, come from the training rows: `from_config.eagle_draft_vocab`)."""
    config = eagle_config(cfg, target.config)
    torch.manual_seed(int(cfg.seed))
    head = EagleHead(config).to(target.embed_tokens.weight.dtype)
    return head, config


def load_eagle(folder: str | Path, target: Transformer) -> EagleHead:
    """The head of a train/eagle.py export (refused when trained for another target)."""
    return load_head(folder, EagleHead, EagleConfig, target=target)


# ---- early exit ---------------------------------------------------------------------------


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


def check_early_exit_settings(cfg: DictConfig) -> tuple[int, ...]:
    """Every cfg.early_exit setting of train/early_exit.py checked from the config alone
    (no weights); returns the exit layers."""
    layers = early_exit_layers(cfg, model_config(cfg.model).num_layers)
    early_exit_thresholds(cfg)
    k = cfg.early_exit.num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
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


def norm_exit(target: Transformer, exit_layer: int) -> ExitHead:
    """The untrained baseline exit at layer E: the target's final norm and LM head."""
    return ExitHead(ExitConfig.for_target(target.config, exit_layer, "norm"))


def load_early_exit(folder: str | Path, target: Transformer,
                    exit_layer: int | None = None) -> ExitHead:
    """An exit head of a train/early_exit.py export (refused when trained for another target,
    or, with exit_layer, for another E)."""
    head = load_head(folder, ExitHead, ExitConfig, target=target)
    if exit_layer is not None and head.exit_layer != exit_layer:
        raise ValueError(f"{folder}: the exit head exits at layer E={head.exit_layer}, not "
                         f"E={exit_layer}; load the export of E={exit_layer} "
                         f"(<run>/checkpoints/step_N/export/E{exit_layer})")
    return head


def early_exit_drafter(cfg: DictConfig, head: ExitHead, k: int | None = None,
                       threshold: float | None = None) -> EarlyExitDrafter:
    """train/early_exit.py's drafter: up to early_exit.num_draft_tokens (or k) tokens, stopping
    below the (first) early_exit.confidence_threshold unless one is given."""
    k = int(cfg.early_exit.num_draft_tokens) if k is None else k
    threshold = early_exit_thresholds(cfg)[0] if threshold is None else threshold
    return EarlyExitDrafter(head, k, threshold)


# ---- draft models cut from the target (train/draft.py) ----------------------------------------


def check_draft_model_settings(cfg: DictConfig) -> int:
    """Every cfg.draft_model setting of train/draft.py checked from the config alone (no
    weights); returns the draft's layer count."""
    d, target = cfg.draft_model, model_config(cfg.model)
    for key in ("num_layers", "num_draft_tokens"):
        if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:
            raise ValueError(f"draft_model.{key} must be an integer >= 1, got {d[key]!r}")
    if d.num_layers >= target.num_layers:
        raise ValueError(f"draft_model.num_layers={d.num_layers}: a draft must be shallower than "
                         f"the target ({target.num_layers} layers)")
    if not float(d.hard_weight) >= 0:
        raise ValueError(f"draft_model.hard_weight must be >= 0, got {d.hard_weight}")
    size = d.get("draft_vocab")
    if size is not None and not (isinstance(size, int) and 1 <= size <= target.vocab_size):
        raise ValueError(f"draft_model.draft_vocab must be null or 1..vocab_size, got {size!r}")
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
