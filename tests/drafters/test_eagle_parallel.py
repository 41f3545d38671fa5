"""P-EAGLE (drafters/eagle_parallel.py; heads/eagle.py with parallel=K; the parallel rows of
training/objectives.py): K tokens from one forward of an EAGLE-3 head, lossless at greedy as
a chain and as a tree, exact when sampling (a planted bug caught), its cache holding the
committed context alone, and training rows that see what drafting sees."""

import dataclasses

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    committed_context,
    fit_eagle_head,
    host_reads_per_step,
    law_samples,
    random_eagle_head,
    sampled_pvalue,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import ParallelEagleDrafter
from selfspec.from_config.methods.eagle import Eagle3Objective, parallel_pairs
from selfspec.heads import EagleConfig, EagleHead
from selfspec.heads.export import export_head
from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.heads.layouts import ExportRefused

PROMPTS = [
    torch.randint(2, 63, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24
K = 4
MASK = 63
SHAPES = {"chain": {}, "tree": {"tree_nodes": 8}}


def config_of(target: Transformer, **overrides) -> EagleConfig:
    settings = {"parallel": K, "mask_token_id": MASK} | overrides
    return EagleConfig.for_target(target.config, 3, draft_vocab_size=48, target_layers=(0, 1, 2),
                                  **settings)


def greedy_with(target, head, plain_greedy, static=False, **kwargs) -> list[float]:
    """Assert P-EAGLE greedy decoding equals plain greedy on every prompt; returns each tau."""
    taus = []
    for prompt, expected in plain_greedy.items():
        result = generate(target, list(prompt), drafter=ParallelEagleDrafter(head, **kwargs),
                          max_new_tokens=NEW_TOKENS, cuda_graphs=static)
        assert result.tokens == expected, (prompt, kwargs)
        taus.append(result.stats.tau)
    return taus


@pytest.fixture(scope="module")
def fitted(target, plain_greedy):
    """A P-EAGLE head fit to the target's own greedy continuations of PROMPTS."""
    head, metrics = fit_eagle_head(target, plain_greedy, 3, steps=80, draft_vocab_size=48,
                                   target_layers=(0, 1, 2), parallel=K, mask_token_id=MASK)
    assert metrics["peagle/copy0_top1"] > 0.6 and metrics["peagle/copy1_top1"] > 0.3, metrics
    return head


# ---- lossless greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, K])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, k, shape):
    head = random_eagle_head(config_of(target), seed=k)
    greedy_with(target, head, plain_greedy, num_draft_tokens=k, **SHAPES[shape])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("static", [False, True])
def test_greedy_is_lossless_and_accepted_with_a_fitted_head(target, plain_greedy, fitted, shape,
                                                            static):
    taus = greedy_with(target, fitted, plain_greedy, static, **SHAPES[shape])
    assert sum(taus) / len(taus) > 2.0, taus  # mask positions' tokens are kept too


@pytest.mark.parametrize("shape, sampling", [("chain", None), ("tree", None),
                                             ("tree", SamplingParams(1.0))])
def test_a_static_step_reads_the_host_once(target, fitted, shape, sampling):
    """Drafted in static shapes, its chain or tree stays on the device for the step's one
    read."""
    assert host_reads_per_step(target, lambda: ParallelEagleDrafter(fitted, **SHAPES[shape]),
                               PROMPTS[3], sampling) == 1


def drafted_tokens(target, head, prompt, static: bool, **kwargs) -> list[list[int]]:
    """Every step's drafted tokens while decoding prompt greedily."""
    drafter, seen = ParallelEagleDrafter(head, **kwargs), []
    propose = drafter.propose

    def recording(context):
        draft = propose(context)
        seen.append(draft.tokens.tolist())
        return draft

    drafter.propose = recording
    generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, cuda_graphs=static)
    return seen


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_static_steps_draft_the_tokens_of_the_one_eager_forward(target, fitted, shape, k):
    """The static form (the committed pairs fed padded, then the mask pairs at positions held
    on the device) drafts, step after step, what the eager forward over both drafts."""
    for prompt in PROMPTS:
        eager = drafted_tokens(target, fitted, list(prompt), False, num_draft_tokens=k,
                               **SHAPES[shape])
        assert drafted_tokens(target, fitted, list(prompt), True, num_draft_tokens=k,
                              **SHAPES[shape]) == eager


def test_a_batch_decodes_each_row_as_it_decodes_alone(target, plain_greedy, fitted):
    prompts = [list(p) for p in plain_greedy]
    outs = generate(target, prompts, drafter=ParallelEagleDrafter(fitted, tree_nodes=6),
                    max_new_tokens=NEW_TOKENS)
    assert [o.tokens for o in outs] == list(plain_greedy.values())


# ---- one forward, and training that sees what drafting sees ------------------------------------


def training_logits(target, head, row: torch.Tensor, keep: float, seed: int = 0):
    """The parallel rows of `row` [T] and the head's logits on them over the target's
    vocabulary, as P-EAGLE's training computes them."""
    with torch.no_grad():
        out = target(row[None], torch.arange(len(row)), return_hidden=head.config.target_layers)
        feature = head.target_feature(out.last_hidden, out.hidden)[:, :-1]
        pairs = parallel_pairs(row[None, 1:], K, MASK, keep, torch.Generator().manual_seed(seed))
        masks = pairs.tokens.shape[1] - feature.shape[1]
        features = torch.cat([feature, head.mask_hidden.expand(1, masks, -1)], dim=1)
        hidden = head(target.embed_tokens(pairs.tokens), features, pairs.positions,
                      mask=pairs.mask)
        return pairs, head.target_logits(hidden[0])


def test_one_forward_drafts_what_the_training_rows_score(target):
    """Slot j of a draft after the real pair at position a is copy j's row at a + j."""
    head = random_eagle_head(config_of(target), seed=5, std=0.4)
    row = torch.tensor(PROMPTS[2])
    pairs, logits = training_logits(target, head, row, keep=1.0)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    for a in (0, 4, 9):
        drafter = ParallelEagleDrafter(head)
        generate(target, row[: a + 1].tolist(), drafter=drafter, max_new_tokens=1)  # begin()
        drafter._cache.reset()
        drafter._committed = 0
        calls.clear()
        draft = drafter.propose(committed_context(target, head, row[: a + 2].tolist()))
        assert len(calls) == 1  # the whole chain from one forward
        expected = [int(logits[((pairs.copies == j) & (pairs.positions == a + j)).nonzero()
                               .item()].argmax()) for j in range(K)]
        assert draft.tokens.tolist() == expected
        assert drafter._cache.length == a + 1  # the mask pairs' keys are dropped again


def test_the_conditional_drop_keeps_whole_prefixes_and_changes_no_kept_row(target):
    head = random_eagle_head(config_of(target), seed=6, std=0.4)
    row = torch.randint(2, 63, (200,), generator=torch.Generator().manual_seed(1))
    full, full_logits = training_logits(target, head, row, keep=1.0)
    thin, thin_logits = training_logits(target, head, row, keep=0.5, seed=3)
    anchors = {(int(c), int(p) - int(c)) for c, p in zip(thin.copies, thin.positions, strict=True)}
    assert all((c - 1, a) in anchors for c, a in anchors if c > 1)  # copy j implies copy j - 1
    for j in range(1, K):  # copy j of an anchor kept with probability 0.5 ** j
        share = sum(c == j for c, _ in anchors) / (len(row) - 1 - j)
        assert abs(share - 0.5**j) < 0.12, (j, share)
    index = {(int(c), int(p)): i for i, (c, p) in enumerate(zip(full.copies, full.positions,
                                                                 strict=True))}
    rows = [index[(int(c), int(p))] for c, p in zip(thin.copies, thin.positions, strict=True)]
    torch.testing.assert_close(thin_logits, full_logits[rows], atol=1e-5, rtol=1e-4)


def test_training_lowers_the_loss_of_every_copy(target, plain_greedy):
    _, before = fit_eagle_head(target, plain_greedy, 3, steps=1, draft_vocab_size=48,
                               target_layers=(0, 1, 2), parallel=K, mask_token_id=MASK)
    _, after = fit_eagle_head(target, plain_greedy, 3, steps=40, draft_vocab_size=48,
                              target_layers=(0, 1, 2), parallel=K, mask_token_id=MASK)
    for j in range(K):
        assert after[f"peagle/copy{j}_loss"] < 0.8 * before[f"peagle/copy{j}_loss"], j


# ---- exact sampling ----------------------------------------------------------------------------

N_SAMPLES = 1000
T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)


@pytest.fixture(scope="module")
def small_vocab():
    """A target of 8 tokens with peaky laws, and a random P-EAGLE head whose laws differ from
    its (drafts kept often enough to be in play, rejected often enough to be tested)."""
    small = Transformer.from_hf(tiny_llama(3, vocab=8, layers=2, hidden=16, std=0.5))
    config = EagleConfig.for_target(small.config, 3, draft_vocab_size=8, target_layers=(0, 1, 2),
                                    parallel=3, mask_token_id=7)
    return small, random_eagle_head(config, seed=4, std=0.1)


LAW_CASES = [(T1, "tree"), (TOP_P, "chain"),
             pytest.param(T1, "chain", marks=pytest.mark.slow),
             pytest.param(TOP_P, "tree", marks=pytest.mark.slow)]


LAW_SHAPES = {"chain": {}, "tree": {"tree_nodes": 6}}


@pytest.mark.parametrize("params, shape", LAW_CASES)
def test_sampling_through_p_eagle_follows_the_target_law(small_vocab, params, shape, request):
    small, head = small_vocab
    assert_drafted_sampling_is_exact(small, ParallelEagleDrafter(head, **LAW_SHAPES[shape]),
                                     params, law_samples(request, N_SAMPLES))


class ForgetsItDrewWithoutReplacement(ParallelEagleDrafter):
    """A planted bug: siblings drawn without replacement, verified as independent draws."""

    def propose(self, context):
        return dataclasses.replace(super().propose(context), without_replacement=False)


@pytest.mark.slow  # the planted bug of the law test; the verifier-level twin runs quick
def test_the_law_test_catches_siblings_verified_as_independent_draws(small_vocab):
    small, head = small_vocab
    # The correct drafter passes this very test (above, p ~ 0.4); the planted one: p ~ 4e-8.
    assert sampled_pvalue(small, ForgetsItDrewWithoutReplacement(head, tree_nodes=6), T1,
                          2 * N_SAMPLES) < 1e-4


# ---- its settings, saved and refused -----------------------------------------------------------


def test_a_saved_head_loads_with_its_mask(target, tmp_path):
    head = random_eagle_head(config_of(target), seed=7)
    save_head(tmp_path / "head", head, head.config, describe_target(target))
    loaded = load_head(tmp_path / "head", EagleHead, EagleConfig, target=target)
    assert loaded.config == head.config
    assert torch.equal(loaded.mask_hidden, head.mask_hidden)


def test_bad_settings_are_clear_errors(target, tmp_path):
    with pytest.raises(ValueError, match="EAGLE-3 heads"):
        EagleConfig.for_target(target.config, 1, parallel=2, mask_token_id=MASK)
    with pytest.raises(ValueError, match="mask_token_id must be a token id"):
        config_of(target, mask_token_id=64)
    head = random_eagle_head(config_of(target), seed=1)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in 1\.\.4"):
        ParallelEagleDrafter(head, 5)
    with pytest.raises(ValueError, match="EagleDrafter"):
        ParallelEagleDrafter(random_eagle_head(config_of(target, parallel=1, mask_token_id=None),
                                               seed=1))
    with pytest.raises(ExportRefused, match="P-EAGLE"):
        export_head(head, "eagle", tmp_path / "out")
    with pytest.raises(ValueError, match="keep must be in"):
        Eagle3Objective(target, head, keep=0.0)
