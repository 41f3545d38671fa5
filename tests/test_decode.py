"""The decode loop: lossless greedy for every drafter, exact sampling end to end, bad input."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    FAST_LAW_SAMPLES,
    P_VALUE_FLOOR,
    TopRankTreeDrafter,
    first_layers,
    sampled_pvalue,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, decode, generate
from selfspec.devices import HostReads
from selfspec.drafters import Draft, NgramDrafter, SmallModelDrafter
from selfspec.metrics import OTHER, PHASES, GenerationStats

PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]


@pytest.fixture(scope="module")
def hf_target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def target(hf_target):
    return Transformer.from_hf(hf_target)


@pytest.fixture(scope="module")
def draft_model(hf_target):
    """The target's first layer alone (shared embeddings and head): it often agrees."""
    return Transformer.from_hf(first_layers(hf_target))


@pytest.fixture(scope="module")
def plain_greedy(target):
    return {tuple(p): generate(target, p, max_new_tokens=24).tokens for p in PROMPTS}


def test_plain_greedy_matches_transformers(hf_target, plain_greedy):
    for prompt, tokens in plain_greedy.items():
        ids = torch.tensor([prompt])
        out = hf_target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
            eos_token_id=None, pad_token_id=1,
        )
        assert out[0, len(prompt):].tolist() == tokens


@pytest.mark.parametrize("k", [1, 4, 8, *(pytest.param(k, marks=pytest.mark.slow)
                                          for k in (2, 3, 5, 6, 7))])
def test_greedy_is_lossless_with_every_drafter(target, draft_model, plain_greedy, k):
    accepted = 0
    for drafter in (SmallModelDrafter(draft_model, k), NgramDrafter(k),
                    SmallModelDrafter(draft_model, k, first_candidates=3)):
        for prompt, expected in plain_greedy.items():
            result = generate(target, list(prompt), drafter=drafter, max_new_tokens=24)
            assert result.tokens == expected, type(drafter).__name__
            assert result.stats.new_tokens == 24
            accepted += result.stats.accepted
    assert accepted > 0  # the drafts were really used, not all rejected


TREE_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def test_greedy_is_lossless_with_a_tree_drafter(target, draft_model, plain_greedy):
    drafter = TopRankTreeDrafter(draft_model, TREE_PATHS)
    prompts_with_accepted_drafts = 0
    for prompt, expected in plain_greedy.items():
        result = generate(target, list(prompt), drafter=drafter, max_new_tokens=24)
        assert result.tokens == expected
        prompts_with_accepted_drafts += result.stats.accept_histogram[0] < result.stats.steps
    assert prompts_with_accepted_drafts > 0


def test_eos_stops_generation_and_is_not_passed(target, plain_greedy):
    prompt, expected = next(iter(plain_greedy.items()))
    eos = expected[5]
    for drafter in (None, NgramDrafter(4)):
        out = generate(target, list(prompt), drafter=drafter, max_new_tokens=24, eos_token_id=eos)
        assert out.tokens == expected[: expected.index(eos) + 1]


def test_max_new_tokens_is_exact_even_when_a_step_accepts_many(target, draft_model):
    prompt = PROMPTS[-1]
    for n in (1, 2, 3, 7):
        out = generate(target, prompt, drafter=SmallModelDrafter(draft_model, 8), max_new_tokens=n)
        assert len(out.tokens) == n


def test_stats_count_what_happened(target, draft_model):
    out = generate(target, PROMPTS[2], drafter=SmallModelDrafter(draft_model, 3), max_new_tokens=30)
    stats = out.stats
    assert stats.target_forwards == stats.steps + 1  # one prefill
    assert stats.drafted == 3 * stats.steps
    assert sum(stats.accept_histogram) == stats.steps
    assert stats.tau == pytest.approx((stats.accepted + stats.steps) / stats.steps)
    assert stats.new_tokens == 30 <= stats.accepted + stats.steps
    assert stats.acceptance_by_position[0] >= stats.acceptance_by_position[-1]
    assert 0 < stats.draft_time_s < stats.wall_time_s


def test_every_step_is_split_into_phases_that_the_wall_time_holds(target, draft_model):
    out = generate(target, PROMPTS[2], drafter=SmallModelDrafter(draft_model, 3), max_new_tokens=30)
    stats, split = out.stats, out.stats.time_split
    assert stats.split_steps == stats.steps > 1  # on the CPU the split is always recorded
    assert list(split) == [*PHASES, OTHER]
    timed = {phase: getattr(stats, f"{phase}_time_s") for phase in PHASES}
    assert all(seconds > 0 for seconds in timed.values()), timed
    assert sum(timed.values()) <= stats.wall_time_s
    # what no phase covers is the wall time left over, not a figure forced to add up
    assert split[OTHER]["s_per_step"] * stats.steps == pytest.approx(
        stats.wall_time_s - sum(timed.values()), abs=1e-12)
    assert 0 <= split[OTHER]["share"] < 0.5  # inside generate only the last loop check is left
    assert sum(p["share"] for p in split.values()) == pytest.approx(1.0)
    for phase, seconds in timed.items():
        assert split[phase]["s_per_step"] == pytest.approx(seconds / stats.steps)


def test_the_split_can_be_turned_off_and_never_changes_the_tokens(target, draft_model,
                                                                  plain_greedy):
    prompt = PROMPTS[2]
    drafter = SmallModelDrafter(draft_model, 3)
    off = generate(target, prompt, drafter=drafter, max_new_tokens=24, split_time=False)
    on = generate(target, prompt, drafter=drafter, max_new_tokens=24, split_time=True)
    assert off.tokens == on.tokens == plain_greedy[tuple(prompt)]
    assert off.stats.time_split is None and off.stats.split_steps == 0
    assert off.stats.forward_time_s == off.stats.commit_time_s == 0.0
    assert off.stats.draft_time_s > 0  # the draft is timed in any case
    plain = generate(target, prompt, max_new_tokens=24)  # plain decoding is split too
    assert plain.tokens == plain_greedy[tuple(prompt)]
    assert plain.stats.time_split is not None and plain.stats.drafted == 0


def test_a_gpu_synchronizes_at_phase_boundaries_only_when_asked(monkeypatch):
    """No GPU needed: the clock of a CUDA generation, with synchronize recorded."""
    calls, ticks = [], iter(range(100))  # a clock that moves one second a read
    monkeypatch.setattr(decode, "synchronize", calls.append)
    monkeypatch.setattr(decode, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    cuda = torch.device("cuda")
    fast = decode._PhaseClock(GenerationStats(), cuda, None)  # generate's default
    for phase in ("prefill", "draft", "forward", "probs", "verify", "commit"):
        fast.lap(phase)
    assert not fast.split and calls == []
    assert fast.stats.draft_time_s == 1.0 and fast.stats.forward_time_s == 0.0  # the draft alone
    split = decode._PhaseClock(GenerationStats(), cuda, True)
    for phase in ("prefill", "draft", "forward"):
        split.lap(phase)
    assert calls == [cuda] * 4  # once on starting, once per boundary
    assert decode._PhaseClock(GenerationStats(), torch.device("cpu"), None).split


# ---- sampling exactness end to end -----------------------------------------------------------

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_pair():
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    draft = Transformer.from_hf(tiny_llama(4, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    return target, draft


@pytest.mark.parametrize("params, samples", [(SamplingParams(1.0), FAST_LAW_SAMPLES), pytest.param(
    SamplingParams(1.0, top_p=0.8), 1500, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["small_model", "ngram"])
def test_sampling_through_a_drafter_follows_the_target_law(small_pair, params, samples, kind):
    target, draft = small_pair
    drafter = SmallModelDrafter(draft, 3) if kind == "small_model" else NgramDrafter(3)
    assert sampled_pvalue(target, drafter, params, samples) > P_VALUE_FLOOR


def test_sampling_through_a_tree_drafter_follows_the_target_law(small_pair):
    target, draft = small_pair
    drafter = TopRankTreeDrafter(draft, [[0], [1], [0, 0]])
    assert sampled_pvalue(target, drafter, SamplingParams(1.0), FAST_LAW_SAMPLES) > P_VALUE_FLOOR


@pytest.mark.parametrize("params, samples", [(SamplingParams(1.0), FAST_LAW_SAMPLES), pytest.param(
    SamplingParams(1.0, top_p=0.8), 1500, marks=pytest.mark.slow)])
def test_sampling_through_a_draft_models_first_candidates_follows_the_target_law(small_pair,
                                                                              params, samples):
    """Three first tokens drawn without replacement, a chain under the first."""
    target, draft = small_pair
    drafter = SmallModelDrafter(draft, 2, first_candidates=3)
    assert sampled_pvalue(target, drafter, params, samples) > P_VALUE_FLOOR


@pytest.mark.slow  # the verifier-level twin (test_verify_exactness) runs quick
def test_the_end_to_end_check_catches_first_candidates_verified_as_independent_draws(
        small_pair, monkeypatch):
    """The same draws verified as if each sibling were an independent draw from q (the
    without-replacement correction dropped) leave the target's law."""
    import selfspec.drafters.small_model as small_model

    monkeypatch.setattr(small_model, "Draft", _WithReplacementDraft)
    drafter = SmallModelDrafter(small_pair[1], 2, first_candidates=3)
    assert sampled_pvalue(small_pair[0], drafter, SamplingParams(1.0)) < P_VALUE_FLOOR


class _WithReplacementDraft(Draft):
    def __init__(self, tree, tokens, q=None, without_replacement=False, early=None):
        super().__init__(tree, tokens, q, False, early)


def test_the_end_to_end_check_catches_a_verifier_without_residual(small_pair, monkeypatch):
    import selfspec.verify

    monkeypatch.setattr(selfspec.verify, "_residual", lambda residual, proposal, x: residual)
    assert sampled_pvalue(small_pair[0], NgramDrafter(3), SamplingParams(1.0)) < P_VALUE_FLOOR


# ---- bad input -------------------------------------------------------------------------------


def test_a_draft_model_with_another_vocabulary_is_refused(target):
    other = Transformer.from_hf(tiny_llama(5, vocab=80, layers=1))
    with pytest.raises(ValueError, match="vocab size 80 differs from the target's 64"):
        generate(target, [3, 4], drafter=SmallModelDrafter(other, 2), max_new_tokens=4)


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, hf_target):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folders = []
    for name, words in [("target", "abcdefgh"), ("draft", "hgfedcba")]:
        vocab = {w: i for i, w in enumerate(words)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        hf_target.save_pretrained(tmp_path / name)
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
        folders.append(Transformer.from_pretrained(tmp_path / name))
    with pytest.raises(ValueError, match="tokenizer .* differs from the target's"):
        generate(folders[0], [3, 4], drafter=SmallModelDrafter(folders[1], 2), max_new_tokens=4)


def test_a_draft_sharing_the_tokenizer_with_a_smaller_embedding_table_is_lossless(
    tmp_path, hf_target, plain_greedy
):
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    padded_less = copy.deepcopy(hf_target)
    padded_less.resize_token_embeddings(60)  # ids 60..63 exist only in the target's table
    padded_less.config.vocab_size = 60
    for name, model in [("target", hf_target), ("draft", padded_less)]:
        model.save_pretrained(tmp_path / name)
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
    target, draft = (Transformer.from_pretrained(tmp_path / n) for n in ("target", "draft"))
    checked = 0
    for prompt, expected in plain_greedy.items():
        if max([*prompt, *expected]) < 60:  # ids the draft model can embed
            out = generate(target, list(prompt), drafter=SmallModelDrafter(draft, 3),
                           max_new_tokens=24)
            assert out.tokens == expected
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [1] * 250, "max_new_tokens": 10}, "exceeds the model's 256 positions"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"prompt_ids": [64]}, r"prompt ids must lie in \[0, 64\)"),
        ({"sampling": 0.7}, "sampling must be a SamplingParams"),
    ],
)
def test_bad_generate_arguments_are_clear_errors(target, kwargs, message):
    args = {"prompt_ids": [3, 4], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(target, args.pop("prompt_ids"), **args)


def test_a_step_reads_its_named_tensors_back_at_once():
    parts = {"draws": torch.tensor([2, -1, 7]), "tokens": torch.tensor([5]),
             "valid": torch.tensor([True, False])}
    with HostReads() as reads:
        read = decode._read_once(**parts)
    assert reads.count == 1
    assert read == {"draws": [2, -1, 7], "tokens": [5], "valid": [1, 0]}


def test_a_long_answer_counts_tau_by_the_span_each_step_started_in(target, draft_model):
    plain = generate(target, PROMPTS[1], max_new_tokens=200).stats
    assert plain.steps_by_span == [128, 72] and plain.tau_by_position == [1.0, 1.0]
    drafted = generate(target, PROMPTS[1], drafter=SmallModelDrafter(draft_model, 3),
                       max_new_tokens=200).stats
    assert sum(drafted.steps_by_span) == drafted.steps
    assert sum(drafted.tokens_by_span) == drafted.steps + drafted.accepted
    assert len(drafted.steps_by_span) == 2 and drafted.steps_by_span[0] < 128
