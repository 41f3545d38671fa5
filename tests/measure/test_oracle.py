"""The oracle drafter (measure/oracle.py): a perfect draft, accepted in full: the ceiling."""

import pytest
import torch
from helpers import tiny_llama

from selfspec import SamplingParams, decode, generate
from selfspec.measure.oracle import OracleDrafter
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_oracle_is_accepted_in_full_and_lossless(target, k):
    prompt = [3, 17, 5, 9]
    plain = generate(target, prompt, max_new_tokens=20)
    oracle = generate(target, prompt, drafter=OracleDrafter(k), max_new_tokens=20)
    assert oracle.tokens == plain.tokens
    assert oracle.stats.accepted == oracle.stats.drafted  # every proposed token is kept
    # each step yields k + 1 tokens until the last, which may be cut by max_new_tokens
    assert oracle.stats.steps == -(-20 // (k + 1))


def test_a_prepared_oracle_replays_its_answers_without_generating_again(target, monkeypatch):
    """The answers are computed by prepare, ahead of any timing: the timed generation that
    replays them runs no second greedy generation inside begin."""
    prompt, oracle = [3, 17, 5, 9], OracleDrafter(1)
    oracle.prepare(target, [prompt], 20)
    plain = generate(target, prompt, max_new_tokens=20).tokens

    def no_second_generation(*args, **kwargs):
        raise AssertionError("the oracle generated again inside a timed generation")

    monkeypatch.setattr(decode, "generate", no_second_generation)
    for k in (1, 4):
        replay = generate(target, prompt, drafter=oracle.with_draft_tokens(k),
                           max_new_tokens=20)
        assert replay.tokens == plain and replay.stats.accepted == replay.stats.drafted


def test_the_oracle_refuses_sampling_and_bad_lengths(target):
    with pytest.raises(ValueError, match="replays greedy decoding"):
        generate(target, [3, 4], drafter=OracleDrafter(2), sampling=SamplingParams(1.0),
                 max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        OracleDrafter(0)
