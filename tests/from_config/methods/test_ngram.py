"""The n-gram entry (from_config/methods/ngram.py): corpora of answers, the shipped corpus."""

import json

import pytest
from omegaconf import OmegaConf

from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import build_drafter, generation_settings
from selfspec.from_config.methods.ngram import context_match, corpus_path, ngram_drafter
from selfspec.from_config.models import load_target, load_tokenizer


def test_the_ngram_drafter_reads_a_corpus_of_answers(cfg_of, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"prompt": "p", "answer": "return self.name"}) + "\n")
    cfg = cfg_of("generate", "drafter=ngram", f"ngram.corpus={answers}", "ngram.max_ngram=2")
    target = load_target(cfg)  # the shipped tiny target, with its tokenizer
    drafter = build_drafter(cfg, target)
    end = target.config.eos_token_ids[:1]  # each answer ends as the target ends a turn
    ids = load_tokenizer(target.source).encode("return self.name") + list(end)
    assert drafter.max_ngram == 2 and drafter.corpus.sequences == [ids]
    assert drafter.corpus.get(ids[:1]) == tuple(ids[1:])
    tree = build_drafter(cfg_of("generate", "drafter=ngram", f"ngram.corpus={answers}",
                                "ngram.tree_nodes=6", "num_draft_tokens=3"), target)
    assert tree.max_nodes == 6 and tree.num_draft_tokens == 3
    with pytest.raises(ValueError, match="ngram.tree_nodes: give one node count"):
        generation_settings(cfg_of("generate", "drafter=ngram",
                                   "ngram.tree_nodes=[2,4]"))
    with pytest.raises(FileNotFoundError, match="ngram.corpus: no file at"):
        generation_settings(cfg_of("generate", "drafter=ngram",
                                   "ngram.corpus=/no/file.jsonl"))


def test_the_shipped_corpus_is_the_models_own_answers_file(cfg_of):
    cfg = cfg_of("generate", "drafter=ngram", "ngram.corpus=shipped", "model=smollm2-135m")
    path = corpus_path(cfg.ngram, cfg.model)
    assert path.name == f"{cfg.model.answers}.gz" and path.stat().st_size > 100_000
    with pytest.raises(FileNotFoundError, match="no answers ship for model=tiny"):
        generation_settings(cfg_of("generate", "drafter=ngram", "ngram.corpus=shipped"))



def test_ngram_match_picks_the_drafters_rule():
    cfg_ngram = OmegaConf.load(CONF_DIR / "ngram" / "lookup.yaml")
    assert ngram_drafter(cfg_ngram, 3, None).match == "latest"  # the default
    cfg_ngram.match = "earliest"
    assert ngram_drafter(cfg_ngram, 3, None).match == "earliest"
    cfg_ngram.match = "first"
    with pytest.raises(ValueError, match="ngram.match must be latest or earliest"):
        context_match(cfg_ngram)
