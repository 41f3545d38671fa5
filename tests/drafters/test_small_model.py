"""The small-model drafter (drafters/small_model.py): reduced vocabularies, first candidates."""

import pytest
import torch
from helpers import (
    SAMPLING_PROMPT,
    adam_fit,
    assert_drafted_sampling_is_exact,
    continuation_rows,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import SmallModelDrafter
from selfspec.heads.draft_vocab import draft_vocabulary

PROMPTS = [[2, 3, 4, 5], [9, 8, 7, 6, 5], [11, 12]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, layers=3))


@pytest.fixture(scope="module")
def plain_greedy(target) -> dict:
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


def test_greedy_is_lossless_with_a_draft_vocabulary_missing_half_the_output(target,
                                                                            plain_greedy):
    produced = sorted({t for tokens in plain_greedy.values() for t in tokens})
    vocab = draft_vocabulary(torch.tensor(produced[::2]), target.config.vocab_size,
                             len(produced[::2]))
    drafter = SmallModelDrafter(target.first_layers(2), num_draft_tokens=4, draft_vocab=vocab)
    proposed = []
    original = drafter.propose
    drafter.propose = lambda context: _recorded(original(context), proposed)
    for prompt, expected in plain_greedy.items():
        assert generate(target, list(prompt), drafter=drafter,
                        max_new_tokens=NEW_TOKENS).tokens == expected
    assert proposed and set(proposed) <= set(produced[::2])


def _recorded(draft, proposed: list[int]):
    proposed.extend(draft.tokens.tolist())
    return draft


def test_a_full_draft_vocabulary_drafts_as_the_whole_head(target, plain_greedy):
    whole = draft_vocabulary(torch.arange(64), 64, 64)
    prompt = list(next(iter(plain_greedy)))
    runs = [generate(target, prompt, max_new_tokens=NEW_TOKENS,
                     drafter=SmallModelDrafter(target.first_layers(2), 3, draft_vocab=vocab))
            for vocab in (None, whole)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accept_histogram == runs[1].stats.accept_histogram


def test_first_candidates_are_the_drafts_top_tokens_and_stay_lossless(target, plain_greedy):
    """first_candidates=3: the draft model's three most likely first tokens, the chain under
    the first; greedy output stays plain greedy's, and the second and third candidates are
    the target's next token at some steps (they are in play, not decoration)."""
    draft = target.first_layers(2)
    drafter = SmallModelDrafter(draft, num_draft_tokens=3, first_candidates=3)
    seen = []
    original = drafter.propose
    drafter.propose = lambda context: _kept(original(context), context.tokens.tolist(), seen)
    for prompt, expected in plain_greedy.items():
        assert generate(target, list(prompt), drafter=drafter,
                        max_new_tokens=NEW_TOKENS).tokens == expected
    sibling_right = 0
    for context, proposal in seen:
        assert proposal.tree.parents == (-1, 0, 1, -1, -1)
        tokens = proposal.tokens.tolist()
        with torch.inference_mode():
            logits = draft(torch.tensor([context]), torch.arange(len(context))).logits[0, -1]
        assert [tokens[0], *tokens[3:]] == logits.topk(3).indices.tolist()
        prompt = next(p for p in plain_greedy if tuple(context[:len(p)]) == p)
        produced = context[len(prompt):]
        sibling_right += plain_greedy[prompt][len(produced)] in tokens[3:]
    assert sibling_right > 0


def _kept(draft, context: list[int], seen: list):
    seen.append((context, draft))
    return draft


@pytest.mark.slow  # a draft vocabulary's law runs quick through EAGLE (test_eagle.py)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9)])
def test_sampling_through_a_reduced_draft_is_exact(target, params):
    kept = torch.tensor(sorted(set(SAMPLING_PROMPT)) + [20, 30, 40])
    vocab = draft_vocabulary(kept, target.config.vocab_size, len(kept))
    drafter = SmallModelDrafter(target.first_layers(2), 2, draft_vocab=vocab)
    assert_drafted_sampling_is_exact(target, drafter, params)


def test_a_vocabulary_for_another_target_is_refused_before_generating(target):
    vocab = draft_vocabulary(torch.arange(10), 32, 8)
    drafter = SmallModelDrafter(target.first_layers(1), 2, draft_vocab=vocab)
    with pytest.raises(ValueError, match="maps into 32 token ids, the target has 64"):
        generate(target, PROMPTS[0], drafter=drafter, max_new_tokens=4)


# ---- PARD: a draft trained to fill masks drafts k tokens in one forward ------------------------

MASK = 63


@pytest.fixture(scope="module")
def pard_draft(target, plain_greedy):
    """The target's first two layers trained (PARD's replicated rows, 4 copies) on the target's
    own greedy continuations of PROMPTS."""
    from selfspec.from_config.methods.small_model import DraftModelObjective

    tokens, mask = continuation_rows(plain_greedy)
    torch.manual_seed(0)
    draft = target.first_layers(2)
    objective = DraftModelObjective(target, draft, parallel=4, mask_token_id=MASK)
    out = adam_fit(lambda: objective(tokens, mask), draft.parameters(), 40)
    assert out.metrics["draft/mask2_top1"] > 0.5, out.metrics
    return draft.eval()


@pytest.mark.parametrize("static", [False, True])
def test_a_parallel_draft_drafts_k_tokens_in_one_forward_losslessly(target, plain_greedy,
                                                                   pard_draft, static):
    calls = []
    hook = pard_draft.register_forward_hook(lambda *args: calls.append(1))
    try:
        for prompt, expected in plain_greedy.items():
            calls.clear()
            drafter = SmallModelDrafter(pard_draft, 4, mask_token_id=MASK)
            result = generate(target, list(prompt), drafter=drafter,
                              max_new_tokens=NEW_TOKENS, cuda_graphs=static)
            assert result.tokens == expected
            assert result.stats.tau > 2.0, result.stats.tau
            assert len(calls) == result.stats.steps  # one draft forward a step
            assert drafter._fed.cache.length == len(drafter._fed.tokens) <= len(prompt) + NEW_TOKENS
    finally:
        hook.remove()


def test_a_batch_of_parallel_drafts_decodes_each_row_as_alone_in_one_draft_forward_a_step(
        target, plain_greedy, pard_draft):
    calls = []
    hook = pard_draft.register_forward_hook(lambda *args: calls.append(1))
    try:
        prompts = [list(p) for p in plain_greedy]
        drafter = SmallModelDrafter(pard_draft, 4, mask_token_id=MASK)
        alone = [generate(target, p, drafter=drafter, max_new_tokens=NEW_TOKENS) for p in prompts]
        calls.clear()
        together = generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS)
    finally:
        hook.remove()
    assert [r.tokens for r in together] == list(plain_greedy.values())
    assert [r.stats.accept_histogram for r in together] == [
        r.stats.accept_histogram for r in alone]  # each row drafts as it does alone
    assert len(calls) == max(r.stats.steps for r in together)  # the rows share each forward


@pytest.mark.slow
def test_a_parallel_draft_keeps_the_target_law(target, pard_draft):
    drafter = SmallModelDrafter(pard_draft, 3, mask_token_id=MASK)
    assert_drafted_sampling_is_exact(target, drafter, SamplingParams(temperature=1.0))


def test_a_parallel_draft_refuses_what_it_cannot_draft(target):
    draft = target.first_layers(1)
    with pytest.raises(ValueError, match="leave first_candidates at 1"):
        SmallModelDrafter(draft, 3, first_candidates=2, mask_token_id=MASK)
    with pytest.raises(ValueError, match=r"mask_token_id must be a token id of the draft model "
                                         r"\(0\.\.63\)"):
        SmallModelDrafter(draft, 3, mask_token_id=64)
