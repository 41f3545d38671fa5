"""Speculative decoding of a hybrid target (a tiny random Qwen3-Next of our config: three Gated
DeltaNet layers, then a gated full-attention layer) whose recurrent state verification must
restore after every rejection: greedy through chains (n-gram lookup, a draft model that is the
target's first layer, recurrent too, the target's own MTP module) and trees (random Medusa
heads, the oracle's tree) equals plain greedy, sampling at T = 1 keeps the target's law, and a
cache that leaves a rejected token in the state is caught; a batch decodes each row as alone."""

import pytest
import torch
from helpers import (
    FAMILY_PROMPTS,
    FAST_LAW_SAMPLES,
    assert_drafted_sampling_is_exact,
    lookup_of_its_answer,
    random_medusa_heads,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import MedusaDrafter, NgramDrafter, SmallModelDrafter
from selfspec.heads import MedusaConfig
from selfspec.measure.oracle import OracleDrafter
from selfspec.model.recurrent_cache import HybridCache

NEW_TOKENS = 12
# Qwen3-Next's layer kinds and linear-attention widths for a target built from our config
HYBRID_ARCH = {"layer_types": ("linear_attention",) * 3 + ("full_attention",),
               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 8, "linear_value_head_dim": 6}
MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def random_hybrid(modules: int = 0, seed: int = 1) -> Transformer:
    """A tiny Qwen3-Next of our config with random weights (std 0.2, norms near identity;
    `modules` MTP modules), its decays in a trained model's range (transformers' parity is
    tests/model/test_hybrid_target.py's)."""
    from mtp_reference import mtp_target

    target = mtp_target("mtp", seed=seed, family="qwen3_next", layers=4, modules=modules,
                        **HYBRID_ARCH)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in target.layers:
            if layer.linear:
                layer.linear_attn.A_log.copy_(0.5 * torch.randn(4, generator=generator))
                layer.linear_attn.dt_bias.fill_(1.0)
    return target


@pytest.fixture(scope="module")
def hybrid() -> Transformer:
    return random_hybrid()


def drafter_of(name: str, target: Transformer):
    c = target.config
    makers = {
        "ngram_chain": lambda: NgramDrafter(3),
        "medusa_tree": lambda: MedusaDrafter(random_medusa_heads(
            MedusaConfig(c.hidden_size, c.vocab_size, num_heads=3), seed=3), MEDUSA_TREE),
        "oracle_tree": lambda: OracleDrafter().with_tree([[0], [1], [1, 0], [0, 0], [0, 1]]),
        # the target's first layer, itself recurrent: its cache rolls back over its own
        # one-token forwards
        "draft_model": lambda: SmallModelDrafter(target.first_layers(1), 3),
    }
    return makers[name]()


@pytest.fixture(scope="module")
def plain(hybrid) -> dict:
    """Plain greedy decoding's tokens per prompt."""
    return {tuple(p): generate(hybrid, p, max_new_tokens=NEW_TOKENS).tokens
            for p in FAMILY_PROMPTS}


def rejected_and_lossless(target: Transformer, plain: dict, make) -> tuple[bool, int]:
    """Whether greedy decoding through make() equals plain greedy on every prompt, and how
    many drafted tokens were rejected."""
    rejected, same = 0, True
    for prompt, expected in plain.items():
        result = generate(target, list(prompt), drafter=make(), max_new_tokens=NEW_TOKENS)
        same &= result.tokens == expected
        rejected += result.stats.drafted - result.stats.accepted
    return same, rejected


@pytest.mark.parametrize("name", [
    "ngram_chain",
    pytest.param("medusa_tree", marks=pytest.mark.slow),
    pytest.param("draft_model", marks=pytest.mark.slow),
    pytest.param("oracle_tree", marks=pytest.mark.slow),
])
@torch.no_grad()
def test_greedy_speculation_equals_plain_greedy(hybrid, plain, name):
    same, rejected = rejected_and_lossless(hybrid, plain, lambda: drafter_of(name, hybrid))
    assert same
    assert rejected > 0  # rejections happened: the state had to be restored


@torch.no_grad()
def test_a_state_left_after_a_rejection_is_caught(hybrid, plain, monkeypatch):
    """A planted bug: commit rolls the K/V back but keeps the recurrent state after the
    forward's last row (the rejected tokens read)."""

    def commit_without_restoring(self, accepted_slots):
        self.kv.commit(accepted_slots)
        self._base = None

    monkeypatch.setattr(HybridCache, "commit", commit_without_restoring)
    same, rejected = rejected_and_lossless(hybrid, plain,
                                           lambda: drafter_of("ngram_chain", hybrid))
    assert rejected > 0 and not same


@pytest.mark.slow  # a second planted bug, of trees
@torch.no_grad()
def test_tree_nodes_read_as_a_chain_are_caught(hybrid, plain, monkeypatch):
    """A planted bug: the recurrent layers ignore the tree and read the forward's rows as one
    chain (a node continues the row before it, a cousin), so an accepted node's state is
    wrong."""
    import selfspec.model.transformer as transformer

    monkeypatch.setattr(transformer, "parents_of", lambda mask, t, device, columns=None: None)
    # the oracle's answer runs [0] -> [0, 0]: rows 1 and 4, with [1] and [1, 0] between
    same, rejected = rejected_and_lossless(hybrid, plain,
                                           lambda: drafter_of("oracle_tree", hybrid))
    assert rejected > 0 and not same


@pytest.mark.slow  # 500 two-token generations: ~8 s
def test_sampling_at_temperature_one_keeps_the_targets_law():
    """Lookup drafts a tree of the target's answer (its chains are the tree's paths): the
    two-token law of the output is the target's (chi-square). The LM head is scaled up so that
    the target's laws are peaked enough for the drafts to be in play at T = 1."""
    target = random_hybrid(seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    drafter = lookup_of_its_answer(target, num_draft_tokens=2, max_nodes=4)
    assert_drafted_sampling_is_exact(target, drafter, SamplingParams(temperature=1.0),
                                     samples=FAST_LAW_SAMPLES)


@pytest.mark.parametrize("name", [
    "ngram_chain",
    *(pytest.param(name, marks=pytest.mark.slow) for name in ("plain", "medusa_tree",
                                                              "draft_model")),
])
@torch.no_grad()
def test_a_batch_decodes_each_row_as_alone(hybrid, plain, name):
    """One forward verifies every row's draft; each row's state is its own (its row of the
    batch's snapshots, committed by its own view), and rows that finish are packed away."""
    make = None if name == "plain" else lambda: drafter_of(name, hybrid)
    first = [9, 1, 30]  # it stops first: the other rows move up
    alone = [generate(hybrid, first, max_new_tokens=NEW_TOKENS).tokens, *plain.values()]
    stop = next(token for i, token in enumerate(alone[0]) if alone[0].index(token) == i >= 2
                and all(len(_until(a, token)) > i + 1 for a in alone[1:]))
    results = generate(hybrid, [first, *FAMILY_PROMPTS], drafter=None if make is None
                       else make(), max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    assert [r.tokens for r in results] == [_until(a, stop) for a in alone]
    assert len(results[0].tokens) < min(len(r.tokens) for r in results[1:])
    if make is not None:
        assert sum(r.stats.drafted - r.stats.accepted for r in results) > 0


def _until(tokens: list[int], stop: int) -> list[int]:
    return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens


def test_a_forward_over_part_of_the_layers_is_refused(hybrid):
    cache = hybrid.new_cache(max_slots=16)
    with torch.no_grad(), pytest.raises(ValueError, match="part of a recurrent target's layers"):
        hybrid(torch.tensor([[3, 4]]), torch.arange(2), cache, exit_layer=2)


@pytest.mark.slow  # 0.5 s each
@pytest.mark.parametrize("shape", [{"tree": [[0], [0, 0], [0, 0, 0]]},
                                   {"total_tokens": 6, "depth": 3, "top_k": 2}],
                         ids=["chain", "eagle2_tree"])
@torch.no_grad()
def test_the_targets_own_mtp_module_drafts_losslessly(shape):
    """Qwen3-Next's native drafter: its `mtp` module (a full-attention block with a KV cache
    of its own) drafting for the hybrid target it belongs to, one prompt and a batch."""
    from selfspec.drafters.mtp import MtpDrafter

    target = random_hybrid(modules=1)
    expected = [generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in FAMILY_PROMPTS]
    alone = [generate(target, p, drafter=MtpDrafter(target, **shape),
                      max_new_tokens=NEW_TOKENS) for p in FAMILY_PROMPTS]
    assert [r.tokens for r in alone] == expected
    assert sum(r.stats.drafted - r.stats.accepted for r in alone) > 0
    batch = generate(target, FAMILY_PROMPTS, drafter=MtpDrafter(target, **shape),
                     max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in batch] == expected


@pytest.mark.parametrize("name", ["early_exit", "layer_skip"])
def test_drafters_that_run_part_of_the_targets_layers_are_refused_at_begin(hybrid, name):
    from helpers import random_exit

    from selfspec.drafters import EarlyExitDrafter
    from selfspec.drafters.layer_skip import LayerSkipDrafter

    drafter = (EarlyExitDrafter(random_exit(hybrid, 2, "norm"), 3) if name == "early_exit"
               else LayerSkipDrafter((1, 2), 3))
    with pytest.raises(ValueError, match="runs part of the target's layers .* recurrent "
                                         r"layers \(\[0, 1, 2\]\)"):
        generate(hybrid, FAMILY_PROMPTS[0], drafter=drafter, max_new_tokens=4)
