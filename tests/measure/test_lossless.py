"""Lossless checks (measure/lossless.py): mismatches name their prompt, top-2 gap, near ties."""

import pytest
import torch

from selfspec.decode import GenerationResult
from selfspec.measure.divergence import NEAR_TIE_ULPS, describe_difference, first_difference
from selfspec.measure.lossless import greedy_outputs, lossless_mismatches
from selfspec.measure.passes import Method
from selfspec.measure.peers import OurDecoder
from selfspec.metrics import GenerationStats
from selfspec.model import Transformer


def test_lossless_mismatches_names_the_prompt(quick_build):
    target = Transformer.from_pretrained(quick_build / "target")
    plain = OurDecoder(target)
    method = Method("ngram", 2, plain, plain)
    found = lossless_mismatches(method, [("p0", [1, 2, 3])], [[7, 7, 7, 7]], 4)
    assert [(m.prompt_id, m.position) for m in found] == [("p0", 0)]


def test_a_mismatch_carries_plain_decodings_top2_gap_there(quick_build):
    target = Transformer.from_pretrained(quick_build / "target")
    plain = OurDecoder(target)
    want = greedy_outputs(plain, [[1, 2, 3]], 4)[0]
    wrong = [*want[:2], (want[2] + 1) % 100, want[3]]
    [found] = lossless_mismatches(Method("ngram", 2, plain, plain), [("p0", [1, 2, 3])],
                                  [wrong], 4)
    with torch.no_grad():
        logits = target(torch.tensor([[1, 2, 3, *want[:2]]]), torch.arange(5)).logits[0, -1]
    best = logits.topk(2).values
    assert found.position == 2 and found.top2_gap == pytest.approx(float(best[0] - best[1]))
    assert found.tolerance == 0.0 and not found.near_tie  # fp32: every difference fails
    assert "top-2 logit gap" in found.describe() and "a real failure" in found.describe()


@pytest.mark.parametrize("dtype, gap, tie", [
    (torch.bfloat16, 0.01, True),  # 4 ulps of bf16 at |logit| 5: 4 * 2**-7 * 5 = 0.156
    (torch.bfloat16, 0.5, False),
    (torch.float16, 0.01, True),  # 4 * 2**-10 * 5 = 0.0195
    (torch.float16, 0.05, False),
    (torch.float32, 1e-6, False),  # no allowance in fp32
])
def test_low_precision_divergences_within_a_few_ulps_are_near_ties(dtype, gap, tie):
    class Stub:
        """A baseline whose plain decoding had logits 5 and 5 - gap at the divergence."""

        def __call__(self, prompt, sampling, max_new_tokens, seed, stop_ids):
            return GenerationResult([7, 7], GenerationStats())

        def next_token_logits(self, ids):
            return torch.tensor([5.0, 5.0 - gap, -1.0]).to(dtype), dtype

    class Other(Stub):
        def __call__(self, prompt, sampling, max_new_tokens, seed, stop_ids):
            return GenerationResult([7, 8], GenerationStats())

    [found] = lossless_mismatches(Method("m", 2, Other(), Stub()), [("p", [1])], [[7, 7]], 2)
    assert found.position == 1 and found.near_tie is tie
    assert found.tolerance == pytest.approx(
        0.0 if dtype == torch.float32 else NEAR_TIE_ULPS * torch.finfo(dtype).eps * 5.0)


def test_the_first_difference_names_its_prompt_its_token_and_whether_it_is_a_near_tie():
    """What bench rows carry when lossless is False (bench_decode, gpu_check's headlines)."""
    class Baseline:
        def next_token_logits(self, ids):  # bf16 logits 5 and 5 - 1/32 after any prefix
            return torch.tensor([5.0, 5.0 - 2 ** -5, -1.0]).to(torch.bfloat16), torch.bfloat16

    prompts, plain = [[1], [2]], [[7, 7, 7], [7, 7, 7]]
    assert first_difference(Baseline(), prompts, plain, plain) is None
    found = first_difference(Baseline(), prompts, plain, [[7, 7, 7], [7, 7, 9]])
    assert found == {"prompt": 1, "position": 2, "top2_gap": 2 ** -5,
                     "tolerance": pytest.approx(NEAR_TIE_ULPS * 2 ** -7 * 5), "near_tie": True}
    assert describe_difference(found) == "prompt 1, new token 2: top-2 gap 0.0312, a near-tie"
    assert describe_difference(None) == ""
