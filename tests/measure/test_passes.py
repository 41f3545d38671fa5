"""Methods against their baselines (measure/passes.py): report lines, shared baselines."""

import pytest
from helpers import tiny_llama

from selfspec import SamplingParams
from selfspec.measure.grid import GridPoint, Variant
from selfspec.measure.oracle import OracleDrafter
from selfspec.measure.passes import BenchSettings, Method, compare_with_plain, measure_row
from selfspec.measure.peers import OurDecoder
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


def test_a_training_report_line_says_where_the_drafters_time_went(target):
    comparison = compare_with_plain(target, OracleDrafter(2), [[3, 17, 5, 9]], max_new_tokens=8)
    assert comparison.lossless is True
    assert comparison.time_split["verify"]["share"] >= 0
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
