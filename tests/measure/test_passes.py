"""Methods against their baselines (measure/passes.py): report lines, shared baselines, batches."""

import pytest
from helpers import tiny_llama

from selfspec import SamplingParams
from selfspec.drafters.suffix import SuffixDrafter, SuffixSettings, SuffixStore
from selfspec.measure.grid import GridLine, GridPoint, SweepGrid, Variant
from selfspec.measure.oracle import OracleDrafter
from selfspec.measure.passes import (
    BenchSettings,
    Method,
    compare_with_plain,
    measure_row,
    run_passes,
)
from selfspec.measure.peers import OurDecoder
from selfspec.measure.sweep import run_sweep
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


def test_a_training_report_line_says_where_the_drafters_time_went(target):
    comparison = compare_with_plain(target, OracleDrafter(2), [[3, 17, 5, 9]], max_new_tokens=8)
    assert comparison.lossless is True
    shares = [phase["share"] for phase in comparison.time_split.values()]
    assert 0 < comparison.time_split["verify"]["share"] < 1 and sum(shares) == pytest.approx(1)
    line = comparison.describe("toy")
    assert "; time: prefill " in line and " forward " in line and " other " in line


def test_shared_baseline_measures_plain_once_per_sampling(quick_build):
    target = Transformer.from_pretrained(quick_build / "target")
    prompts, settings = [[1, 2, 3, 1, 2]], BenchSettings(max_new_tokens=6, warmup=0)
    greedy = GridPoint(Variant("ngram"), 2, "greedy", SamplingParams())
    plain = OurDecoder(target)
    first, base = measure_row(Method("ngram", 2, plain, plain), greedy, prompts, settings)
    again, same = measure_row(Method("ngram", 2, plain, plain), greedy, prompts, settings, base)
    assert same is base and again.baseline_tokens_per_s == first.baseline_tokens_per_s


def test_a_shared_baseline_is_measured_once_per_batch_size(quick_build):
    """Batch 2's rows compare with plain decoding of batches of 2, not with batch 1's."""
    target = Transformer.from_pretrained(quick_build / "target")
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 8, 9, 7]]
    grid = SweepGrid((GridLine(Variant("ngram"), (1, 2)),), (("greedy", SamplingParams()),),
                     batch_sizes=(1, 2))
    plain = OurDecoder(target)
    rows = run_sweep(grid.points(), lambda variant, k: Method("ngram", k, plain, plain),
                     prompts, BenchSettings(max_new_tokens=6, warmup=0), shared_baseline=True,
                     progress=False)
    assert [(r.batch_size, r.draft_length) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    by_batch = {b: {r.baseline_tokens_per_s for r in rows if r.batch_size == b} for b in (1, 2)}
    assert len(by_batch[1]) == len(by_batch[2]) == 1  # measured once per batch size
    assert by_batch[1] != by_batch[2]
    assert all(r.lossless for r in rows) and rows[2].prompts == 3


def test_a_learning_drafter_forgets_its_warmup_before_it_is_timed(target):
    """The warmup decodes a measured prompt: suffix decoding's store must not keep its
    answer, or the timed pass would draft it from memory."""
    store = SuffixStore(16)
    decoder = OurDecoder(target, SuffixDrafter(store, SuffixSettings(num_draft_tokens=4)))
    prompts = [[3, 17, 5, 9, 3, 17]]
    run_passes([decoder], prompts, SamplingParams(), BenchSettings(max_new_tokens=8, warmup=2))
    (answer,) = store.sequences  # the timed pass's answer alone, not the warmups'
    assert len(answer) == 8
    planted = OurDecoder(target, SuffixDrafter(store, SuffixSettings(num_draft_tokens=4)))
    planted.forget_learnt = lambda: None  # a decoder that keeps what its warmup taught it
    run_passes([planted], prompts, SamplingParams(), BenchSettings(max_new_tokens=8, warmup=1))
    assert len(store.sequences) == 3  # the last pass's, the warmup's and the timed pass's
