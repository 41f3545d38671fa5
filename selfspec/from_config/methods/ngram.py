"""N-gram lookup (`NgramDrafter`): copy what followed the last n-gram earlier in the context
and, with ngram.corpus, in answers the target wrote before (REST-style retrieval). No weights.

Rows: ngram (the context alone); with a corpus, ngram/corpus (chains of k tokens) or
ngram/corpus/tree{N} (trees of N nodes, k deep) for each of ngram.tree_nodes, beside which a
sweep keeps the context-only row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from selfspec.checks import is_count
from selfspec.drafters import LookupCorpus, NgramDrafter
from selfspec.drafters.ngram import MATCHES
from selfspec.from_config.common import as_list
from selfspec.from_config.methods.entry import SHIPPED, Loaded, MethodEntry, always
from selfspec.from_config.models import load_tokenizer
from selfspec.measure.grid import Variant
from selfspec.training.instructions import cached_answers, shipped_answers

CORPUS = "corpus"


@dataclass(frozen=True)
class NgramVariant(Variant):
    method: str = "ngram"
    corpus: bool = False  # look up in ngram.corpus too, not in the context alone
    tree_nodes: int | None = None  # with the corpus: a tree of this many nodes (None: a chain)

    def label(self) -> str:
        if not self.corpus:
            return self.method
        tree = "" if self.tree_nodes is None else f"/tree{self.tree_nodes}"
        return f"{self.method}/{CORPUS}{tree}"


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[NgramVariant, ...]:
    """The context-only row, and with a corpus one row per ngram.tree_nodes entry (a single
    generation takes the corpus row, and one node count)."""
    counts = check_ngram_settings(cfg.ngram, cfg.model)
    if not for_sweep and len(counts) > 1:
        raise ValueError(f"ngram.tree_nodes: give one node count (or null) here, got {counts}; "
                         f"a list is for eval/sweep.py")
    if not cfg.ngram.get("corpus"):
        return (NgramVariant(),)
    with_corpus = tuple(NgramVariant(corpus=True, tree_nodes=n) for n in counts)
    return ((NgramVariant(),) if for_sweep else ()) + with_corpus


def ngram_drafter(cfg_ngram: DictConfig, k: int, corpus: LookupCorpus | None,
                  tree_nodes: int | None = None) -> NgramDrafter:
    """N-gram lookup drafting k tokens deep: in the context, and in `corpus` when given (then
    a tree of max(k, tree_nodes) nodes when tree_nodes is set)."""
    nodes = k if corpus is None or tree_nodes is None else max(k, tree_nodes)
    return NgramDrafter(num_draft_tokens=k, max_ngram=int(cfg_ngram.max_ngram), corpus=corpus,
                        max_nodes=nodes, match=context_match(cfg_ngram))


def context_match(cfg_ngram: DictConfig) -> str:
    """ngram.match, checked: which earlier occurrence of the context's n-gram is continued."""
    match = str(cfg_ngram.get("match", MATCHES[0]))
    if match not in MATCHES:
        raise ValueError(f"ngram.match must be {' or '.join(MATCHES)} (the most recent earlier "
                         f"occurrence of the last n-gram, or the first: vLLM's rule), got "
                         f"{match!r}")
    return match


def tree_node_counts(cfg_ngram: DictConfig) -> list[int | None]:
    """ngram.tree_nodes as a list (one entry: null or a count; a sweep may give several)."""
    return as_list(cfg_ngram.get("tree_nodes")) or [None]


def check_ngram_settings(cfg_ngram: DictConfig, cfg_model: DictConfig) -> list[int | None]:
    """The n-gram settings, checked before any model loads (the corpus file must exist);
    returns the tree node counts."""
    if cfg_ngram.get("corpus"):
        corpus_path(cfg_ngram, cfg_model)
    lookup_settings(cfg_ngram)
    context_match(cfg_ngram)
    return tree_node_counts(cfg_ngram)


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
        if not is_count(value):
            name = "corpus_length" if key == "length" else key
            raise ValueError(f"ngram.{name} must be an integer >= 1, got {value!r}")
    return settings


def load_lookup_corpus(cfg_ngram: DictConfig, cfg_model: DictConfig, tokenizer,
                       end: list[int]) -> LookupCorpus:
    """The corpus of cfg_ngram.corpus: each answer as the target writes it (its tokens, then
    `end`, its end-of-turn token)."""
    path = corpus_path(cfg_ngram, cfg_model)
    answers = cached_answers(path)
    sequences = [tokenizer.encode(a, add_special_tokens=False) + end for a in answers]
    corpus = LookupCorpus(sequences, **lookup_settings(cfg_ngram))
    print(f"n-gram corpus {path}: {len(answers)} answers, {corpus.num_tokens} tokens, "
          f"{len(corpus)} n-grams")
    return corpus


def lookup_corpus(loaded: Loaded) -> LookupCorpus:
    """ngram.corpus, loaded once (ngram+medusa reads the same one)."""
    cfg, target = loaded.cfg, loaded.target
    return loaded.once("lookup_corpus", lambda: load_lookup_corpus(
        cfg.ngram, cfg.model, load_tokenizer(target.source), list(target.config.eos_token_ids[:1])))


def load(loaded: Loaded, chosen: tuple[NgramVariant, ...]) -> None:
    if any(v.corpus for v in chosen):
        lookup_corpus(loaded)


def drafter(loaded: Loaded, variant: NgramVariant, k: int) -> NgramDrafter:
    corpus = lookup_corpus(loaded) if variant.corpus else None
    return ngram_drafter(loaded.cfg.ngram, k, corpus, variant.tree_nodes)


ENTRIES = (MethodEntry(
    name="ngram", summary="n-gram lookup in the context (and in the target's earlier answers)",
    variants=variants, load=load, drafter=drafter, default_when=always, color="tab:orange",
    order=10),)
