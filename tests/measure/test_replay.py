"""Replaying a drafter over a recorded greedy answer gives the counters greedy speculative
decoding records, step for step, for drafters that read tokens (lookup), the target's states
(Medusa) or keep state of their own (a draft model)."""

import pytest
import torch
from helpers import first_layers, fit_medusa_heads, tiny_llama

from selfspec import Transformer, generate
from selfspec.drafters import (
    EarlyExitDrafter,
    LookupCorpus,
    MedusaDrafter,
    NgramDrafter,
    SmallModelDrafter,
    UnionDrafter,
)
from selfspec.from_config.methods.early_exit import norm_exit
from selfspec.measure.replay import record_greedy, replay

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9, 27, 17, 51, 25, 11], [40, 2, 33]]
NEW_TOKENS = 24
STOP = 1  # the tiny Llama's end-of-sequence id


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def target(hf_target):
    return Transformer.from_hf(hf_target)


@pytest.fixture(scope="module")
def make_drafter(hf_target, target):
    continuations = {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens
                     for p in PROMPTS}
    heads = fit_medusa_heads(target, continuations)[0]
    corpus = LookupCorpus([generate(target, [p, p + 1], max_new_tokens=NEW_TOKENS).tokens
                           for p in range(2, 60, 3)])
    draft_model = Transformer.from_hf(first_layers(hf_target))
    makers = {
        "ngram": lambda: NgramDrafter(3),
        "ngram_corpus_tree": lambda: NgramDrafter(3, corpus=corpus, max_nodes=6),
        "medusa": lambda: MedusaDrafter(heads, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
        "small_model": lambda: SmallModelDrafter(draft_model, 3),
        "medusa_and_lookup": lambda: UnionDrafter(
            [MedusaDrafter(heads, [[0], [1]]), NgramDrafter(3, corpus=corpus, max_nodes=4)],
            max_nodes=5),
    }
    return lambda kind: makers[kind]()


COUNTERS = ("new_tokens", "steps", "drafted", "accepted", "accept_histogram",
            "nodes_histogram", "position_drafted", "position_accepted")


@pytest.mark.parametrize("kind", ["ngram", "ngram_corpus_tree", "medusa", "small_model",
                                  "medusa_and_lookup"])
@pytest.mark.parametrize("stop_ids", [(), (STOP,)])
def test_a_replay_counts_what_decoding_counts(target, make_drafter, kind, stop_ids):
    accepted = 0
    for prompt in PROMPTS:
        live = generate(target, prompt, drafter=make_drafter(kind), max_new_tokens=NEW_TOKENS,
                        eos_token_id=list(stop_ids)).stats
        record = record_greedy(target, prompt, NEW_TOKENS, stop_ids)
        replayed = replay(target, make_drafter(kind), record)
        assert {c: getattr(replayed, c) for c in COUNTERS} == {c: getattr(live, c)
                                                                for c in COUNTERS}
        accepted += live.accepted
    assert accepted > 0  # drafts were accepted, so the replay had something to match


def test_a_replay_of_a_learning_drafter_learns_what_decoding_learns(target):
    """Suffix decoding's store carries each answer into the next prompt's drafts: replayed in
    order over one store, the counters are decoding's over another, prompt by prompt."""
    from selfspec.drafters.suffix import SuffixDrafter, SuffixSettings, SuffixStore

    live, replayed = (SuffixDrafter(SuffixStore(12), SuffixSettings(3)) for _ in range(2))
    for prompt in PROMPTS[:2] * 2:
        stats = generate(target, prompt, drafter=live, max_new_tokens=NEW_TOKENS).stats
        again = replay(target, replayed, record_greedy(target, prompt, NEW_TOKENS))
        assert {c: getattr(again, c) for c in COUNTERS} == {c: getattr(stats, c)
                                                             for c in COUNTERS}
    assert replayed.store.sequences == live.store.sequences


def test_the_record_runs_past_the_answer(target):
    plain = generate(target, PROMPTS[0], max_new_tokens=NEW_TOKENS).tokens
    record = record_greedy(target, PROMPTS[0], NEW_TOKENS, lookahead=5)
    assert record.answer == plain and record.tokens[:NEW_TOKENS] == plain
    assert len(record.tokens) == NEW_TOKENS + 5
    stopped = record_greedy(target, PROMPTS[0], NEW_TOKENS, stop_ids=(plain[3],))
    assert stopped.answer == plain[: plain.index(plain[3]) + 1]


def test_a_draft_of_early_layers_is_refused(target):
    drafter = EarlyExitDrafter(norm_exit(target, 1), 2)
    record = record_greedy(target, PROMPTS[0], 4)
    with pytest.raises(ValueError, match="only the decode loop .* passes"):
        replay(target, drafter, record)


def test_replay_reads_no_more_than_one_forward(target, make_drafter, monkeypatch):
    calls = []
    original = Transformer.forward

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape)
        return original(self, *args, **kwargs)

    record = record_greedy(target, PROMPTS[1], NEW_TOKENS)
    monkeypatch.setattr(Transformer, "forward", counted)
    replay(target, make_drafter("medusa"), record)
    assert calls == [torch.Size([1, len(PROMPTS[1]) + len(record.tokens) - 1])]


def test_recorded_answers_are_cached_and_a_new_target_records_anew(tmp_path, monkeypatch):
    from selfspec.measure import replay as replay_module

    target = Transformer.from_hf(tiny_llama(0))
    first = replay_module.cached_records(target, PROMPTS, NEW_TOKENS, [STOP], tmp_path)
    assert first == [record_greedy(target, p, NEW_TOKENS, [STOP]) for p in PROMPTS]

    def no_recording(*args, **kwargs):
        raise AssertionError("recorded again")

    monkeypatch.setattr(replay_module, "record_greedy", no_recording)
    assert replay_module.cached_records(target, PROMPTS, NEW_TOKENS, [STOP], tmp_path) == first
    with torch.no_grad():
        target.norm.weight.mul_(1.01)  # other weights: another key
    with pytest.raises(AssertionError, match="recorded again"):
        replay_module.cached_records(target, PROMPTS, NEW_TOKENS, [STOP], tmp_path)
