import math
from collections import Counter

import pytest
import torch
from helpers import P_VALUE_FLOOR, fit_pvalue

from selfspec.sampling import (
    SamplingParams,
    gumbel_top,
    logits_to_probs,
    sample,
    sample_rows,
)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_impossible_settings_are_clear_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))


def test_temperature_scales_logits():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_k_and_breaks_ties_towards_lower_index():
    logits = torch.tensor([1.0, 4.0, 2.0, 4.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs > 0).tolist() == [False, True, True, True, False, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs_in = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs_in.log()
    kept = lambda p: (logits_to_probs(logits, SamplingParams(1.0, top_p=p)) > 0).tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]
    assert kept(0.41) == [False, True, False, True]
    assert kept(0.7) == [False, True, False, True]
    assert kept(0.71) == [False, True, True, True]
    out = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))
    torch.testing.assert_close(out, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_matches_transformers_warpers_on_random_logits():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 3
    for t, k, p in [(1.0, 0, 0.9), (0.7, 10, 1.0), (1.3, 20, 0.8)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        ours = logits_to_probs(logits, SamplingParams(t, top_k=k, top_p=p))
        torch.testing.assert_close(ours, torch.softmax(scores, -1))


def test_top_p_on_a_real_vocabulary_matches_transformers_and_the_full_sort(monkeypatch):
    """Peaked rows take the candidate window, flat rows sort the whole vocabulary; both keep
    what transformers keeps, and the window keeps bit for bit what a full sort keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    import selfspec.sampling as sampling

    g = torch.Generator().manual_seed(2)
    scale = torch.tensor([[8.0], [6.0], [0.5], [8.0]])  # row 2's nucleus spans ~40k tokens
    logits = torch.randn(4, 49_152, generator=g) * scale
    params = SamplingParams(1.0, top_p=0.9)
    narrow = logits[[0, 1, 3]]
    probs, narrow_probs = logits_to_probs(logits, params), logits_to_probs(narrow, params)
    kept = (probs > 0).sum(-1)
    assert kept[[0, 1, 3]].max() < sampling.NUCLEUS_WINDOW < kept[2]
    reference = torch.softmax(TopPLogitsWarper(0.9)(None, logits.clone()), -1)
    torch.testing.assert_close(probs, reference)
    monkeypatch.setattr(sampling, "NUCLEUS_WINDOW", logits.shape[-1])
    assert torch.equal(narrow_probs, logits_to_probs(narrow, params))


def test_ties_across_the_candidate_window_keep_the_lower_token_ids(monkeypatch):
    import selfspec.sampling as sampling

    vocab, window = 4_000, sampling.NUCLEUS_WINDOW
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    logits = torch.full((vocab,), -20.0)
    logits[ids[: window - 10]] = 5.0
    tied = ids[window - 10 : window + 500]  # 510 equal logits across the window's edge
    logits[tied] = 3.0
    mass_of_fives = (window - 10) / ((window - 10) + 510 * math.exp(-2.0))
    params = SamplingParams(1.0, top_p=mass_of_fives + 0.001)  # and a few of the tied tokens
    probs = logits_to_probs(logits, params)
    kept_tied = (probs[tied] > 0).nonzero().flatten()
    assert 0 < kept_tied.numel() < 510
    assert torch.equal(tied[kept_tied].sort().values, tied.sort().values[: kept_tied.numel()])
    monkeypatch.setattr(sampling, "NUCLEUS_WINDOW", vocab)
    assert torch.equal(probs, logits_to_probs(logits, params))


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.8),
                                    SamplingParams(1.0, top_k=5, top_p=0.6),
                                    SamplingParams(1.0, top_k=40)],
                         ids=["top_k", "top_p", "both", "top_k_past_vocab"])
@pytest.mark.parametrize("levels", [2, 4, 1000])  # many ties ... few
def test_static_warping_keeps_the_same_law_and_reads_nothing(params, levels):
    """`logits_to_probs(static=True)`, for captured steps: bit for bit the law of the host
    path, ties at a cut included, with no read of the device."""
    from selfspec.devices import HostReads

    g = torch.Generator().manual_seed(levels)
    logits = torch.randint(levels, (6, 32), generator=g).float()
    logits[0, ::2] = -float("inf")  # a row with fewer tokens than top_k can keep
    with HostReads() as reads:
        static = logits_to_probs(logits, params, static=True)
    assert reads.count == 0
    assert torch.equal(static, logits_to_probs(logits, params))
    assert torch.equal(logits_to_probs(logits[1], params, static=True), static[1])


def test_sample_follows_the_distribution_and_never_draws_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(probs, g) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=6).float() / len(draws)
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)


def test_sample_one_hot_needs_no_generator_but_random_draws_do():
    assert sample(torch.tensor([0.0, 0.0, 1.0]), None) == 2
    with pytest.raises(ValueError, match="Generator"):
        sample(torch.tensor([0.5, 0.5]), None)


def test_gumbel_top_draws_without_replacement_in_order():
    """The ordered pair of two draws follows p(a) p(b) / (1 - p(a)), as one-after-another
    draws without replacement do (chi-square over every pair)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    samples = 20_000
    tokens, drawn = gumbel_top(p.expand(samples, 4), 2, torch.Generator().manual_seed(0))
    assert drawn.all()
    counts = Counter(map(tuple, tokens.tolist()))
    law = {(a, b): float(p[a] * p[b] / (1 - p[a])) for a in range(4) for b in range(4) if a != b}
    assert fit_pvalue(counts, law, samples) > P_VALUE_FLOOR


def test_gumbel_top_marks_what_a_law_cannot_supply():
    p = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25]])
    tokens, drawn = gumbel_top(p, 3, torch.Generator().manual_seed(1))
    assert drawn.tolist() == [[True, True, False], [True, True, True]]
    assert set(tokens[0, :2].tolist()) == {1, 3} and len(set(tokens[1].tolist())) == 3
    with pytest.raises(ValueError, match="sampling needs a torch.Generator"):
        gumbel_top(p, 1, None)


def test_sample_rows_draws_each_row_from_its_law():
    laws = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 1.0, 0.0], [0.1, 0.6, 0.0, 0.3]])
    samples = 20_000
    drawn = sample_rows(laws.repeat(samples, 1), torch.Generator().manual_seed(0))
    drawn = drawn.view(samples, 3)
    for row in range(3):
        counts = Counter(drawn[:, row].tolist())
        law = {t: float(p) for t, p in enumerate(laws[row]) if p > 0}
        assert fit_pvalue(counts, law, samples) > P_VALUE_FLOOR  # never a zero-probability id
    with pytest.raises(ValueError, match="sampling needs a torch.Generator"):
        sample_rows(laws, None)
