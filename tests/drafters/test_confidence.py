"""The confidence stop (drafters/confidence.py): drafts stop below it, stay exact; bad ones fail."""

from collections import Counter

import pytest
import torch
from helpers import (
    P_VALUE_FLOOR,
    exact_two_token_law,
    first_layers,
    fit_pvalue,
    random_exit,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import EarlyExitDrafter, SmallModelDrafter

LAYERS = 4
PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 6, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24
N_SAMPLES = 1000
T1 = SamplingParams(1.0)


@pytest.fixture(scope="module")
def target() -> Transformer:
    """A 4-layer toy target, so that E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


def test_a_small_draft_model_stops_below_its_confidence_threshold(target, plain_greedy):
    draft = Transformer.from_hf(first_layers(tiny_llama(0, layers=LAYERS), 1))
    lengths = {}
    for threshold in (None, 0.999):
        drafter = SmallModelDrafter(draft, 5, confidence_threshold=threshold)
        for prompt in PROMPTS:
            out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
            assert out.tokens == plain_greedy[tuple(prompt)]
        lengths[threshold] = out.stats.drafted / out.stats.steps
    assert lengths == {None: 5, 0.999: 1}


@pytest.mark.slow  # the default run's confidence stop: an early exit's law test
def test_sampling_through_a_small_draft_model_with_the_stop_follows_the_target_law():
    hf = tiny_llama(3, vocab=8, layers=2, hidden=16, std=0.5)
    target, draft = Transformer.from_hf(hf), Transformer.from_hf(first_layers(hf, 1))
    drafter = SmallModelDrafter(draft, 3, confidence_threshold=0.5)
    prompt, g = [2, 3, 4, 2, 3, 4, 2, 3], torch.Generator().manual_seed(0)
    counts, short = Counter(), 0
    for _ in range(N_SAMPLES):
        out = generate(target, prompt, drafter=drafter, sampling=T1, max_new_tokens=2,
                       generator=g)
        counts[tuple(out.tokens)] += 1
        short += out.stats.drafted < 3 * out.stats.steps
    assert short > N_SAMPLES / 10  # the stop really fired
    assert fit_pvalue(counts, exact_two_token_law(target, prompt, T1), N_SAMPLES) > P_VALUE_FLOOR


@pytest.mark.parametrize("threshold", [0, 1, 1.5, -0.2, "high"])
def test_a_confidence_threshold_outside_0_1_is_refused(target, threshold):
    head = random_exit(target, 2, "norm")
    with pytest.raises(ValueError, match=r"confidence_threshold must lie in \(0, 1\)"):
        EarlyExitDrafter(head, 3, threshold)
    with pytest.raises(ValueError, match=r"confidence_threshold must lie in \(0, 1\)"):
        SmallModelDrafter(target, 3, confidence_threshold=threshold)
