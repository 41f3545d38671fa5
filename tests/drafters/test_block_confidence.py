"""Confidence-sized block drafts (drafters/block.py's `confidence_threshold`; the heads'
`acceptance_logits`): a planted confidence cuts a chain, and a tree's depth, at a known
position; greedy decoding stays lossless and sampling exact in law with the cut active,
eagerly and in static steps, for DFlash and P-EAGLE; the head's confidence is saved and loaded
with it, a head without one loads as before, and engine exports leave it out."""

import json
import math

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    committed_context,
    dflash_head_config,
    host_reads_per_step,
    law_samples,
    random_dflash_head,
    random_eagle_head,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import DFlashDrafter, ParallelEagleDrafter
from selfspec.drafters.block import confident_length, cumulative_acceptance
from selfspec.heads import EagleConfig
from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.tree import DeviceTree, host_tree

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 40, 22, 17]]
NEW_TOKENS = 16


def planted(head, chance: float):
    """The head with a confidence that says `chance` at every position (weights 0, the bias
    its logit): position n's cumulative chance is chance**n."""
    with torch.no_grad():
        head.confidence.weight.zero_()
        head.confidence.bias.fill_(math.log(chance / (1 - chance)))
    return head


def noisy(head, chance: float, std: float = 0.1):
    """The head with a confidence around `chance` that moves with the drafted states."""
    planted(head, chance)
    with torch.no_grad():
        head.confidence.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(0))
    return head


def dflash_head(target, seed: int = 3, **overrides):
    config = dflash_head_config(target, confidence_head=True, **overrides)
    return random_dflash_head(config, seed=seed, std=0.4)


def peagle_head(target, seed: int = 3):
    config = EagleConfig.for_target(target.config, 3, draft_vocab_size=48,
                                    target_layers=(0, 1, 2), parallel=4, mask_token_id=63,
                                    confidence_head=True)
    return random_eagle_head(config, seed=seed, std=0.4)


def test_the_cut_keeps_the_positions_whose_cumulative_chance_reaches_the_threshold():
    cumulative = cumulative_acceptance(torch.tensor([2.0, 0.0, -1.0, 3.0]))
    expected = torch.sigmoid(torch.tensor([2.0, 0.0, -1.0, 3.0])).cumprod(0)
    torch.testing.assert_close(cumulative, expected)  # 0.881, 0.440, 0.119, 0.113
    assert confident_length(cumulative, 0.5) == 1
    assert confident_length(cumulative, 0.4) == 2
    assert confident_length(cumulative, 0.115) == 3
    assert confident_length(cumulative, 0.95) == 1  # at least one position


@pytest.mark.parametrize("chance, threshold, proposed", [(0.8, 0.5, 3), (0.8, 0.3, 4),
                                                         (0.6, 0.7, 1)])
def test_a_planted_confidence_cuts_the_chain_at_its_known_position(target, chance, threshold,
                                                                   proposed):
    head = planted(dflash_head(target), chance)  # blocks of 5: k = 4
    history = PROMPTS[0]
    drafts = []
    for cut in (None, threshold):
        drafter = DFlashDrafter(head, confidence_threshold=cut)
        generate(target, history[:-1], drafter=drafter, max_new_tokens=1)  # begin()
        drafter._cache.reset()
        drafter._committed = 0
        drafts.append(drafter.propose(committed_context(target, head, history)))
    whole, cut = drafts
    assert len(whole.tokens) == 4 and len(cut.tokens) == proposed  # 0.8**3 >= 0.5 > 0.8**4
    assert cut.tokens.tolist() == whole.tokens[:proposed].tolist()


def paths(draft) -> set[tuple[int, ...]]:
    tree, tokens = host_tree(draft.tree), draft.tokens.tolist()
    return {tuple(tokens[i] for i in tree.path_to(node)) for node in range(len(tokens))}


def test_a_planted_confidence_cuts_a_tree_at_its_known_depth(target):
    head = planted(dflash_head(target), 0.8)  # depth 3 at 0.5
    with torch.no_grad():
        head.norm.weight.mul_(8.0)  # peaked laws: a deep tree
    history = PROMPTS[0]
    drafts = []
    for cut in (None, 0.5):
        drafter = DFlashDrafter(head, tree_nodes=12, confidence_threshold=cut)
        generate(target, history[:-1], drafter=drafter, max_new_tokens=1)  # begin()
        drafter._cache.reset()
        drafter._committed = 0
        drafts.append(drafter.propose(committed_context(target, head, history)))
    whole, cut = paths(drafts[0]), paths(drafts[1])
    assert max(map(len, whole)) == 4 and cut == {p for p in whole if len(p) <= 3} != whole


def drafted_depths(drafter) -> list[int]:
    """Every draft's depth the drafter proposes from now on (its valid nodes')."""
    depths, propose = [], drafter.propose

    def recording(context):
        draft = propose(context)
        tree = draft.tree
        if isinstance(tree, DeviceTree):
            valid = [True] * len(tree) if tree.valid is None else tree.valid.tolist()
            tree = tree.nodes_on_host(tree.parents.tolist(), valid)[0]
        depths.append(max((len(tree.path_to(n)) for n in range(len(tree))), default=0))
        return draft
    drafter.propose = recording
    return depths


SLOW = pytest.mark.slow


@pytest.mark.parametrize("method, static, shape", [
    ("dflash", False, {}), ("peagle", False, {}), ("dflash", False, {"tree_nodes": 8}),
    pytest.param("dflash", True, {}, marks=SLOW), pytest.param("peagle", True, {}, marks=SLOW),
    pytest.param("dflash", True, {"tree_nodes": 8}, marks=SLOW),
    pytest.param("peagle", False, {"tree_nodes": 8}, marks=SLOW),
    pytest.param("peagle", True, {"tree_nodes": 8}, marks=SLOW)])
def test_greedy_stays_lossless_with_the_confidence_cut(target, method, static, shape):
    make = dflash_head if method == "dflash" else peagle_head
    cls = DFlashDrafter if method == "dflash" else ParallelEagleDrafter
    head = noisy(make(target), 0.8)  # the cut moves with the context
    lengths = set()
    for prompt in PROMPTS:
        expected = generate(target, prompt, max_new_tokens=NEW_TOKENS).tokens
        drafter = cls(head, confidence_threshold=0.5, **shape)
        seen = drafted_depths(drafter)
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS,
                       cuda_graphs=static)
        assert out.tokens == expected, prompt
        lengths |= set(seen) - {0}
    assert len(lengths) > 1 and max(lengths) <= 4, lengths  # cut at more than one depth


@SLOW
@pytest.mark.parametrize("shape", [{"tree_nodes": 8}, {}])
def test_in_static_steps_a_confidence_cut_reads_the_host_once_a_step(target, shape):
    head = noisy(dflash_head(target), 0.8)
    drafter = lambda: DFlashDrafter(head, confidence_threshold=0.5, **shape)  # noqa: E731
    assert host_reads_per_step(target, drafter, PROMPTS[0]) == 1


@pytest.mark.parametrize("static, shape", [
    (False, {"tree_nodes": 6}), pytest.param(False, {}, marks=SLOW),
    pytest.param(True, {}, marks=SLOW), pytest.param(True, {"tree_nodes": 6}, marks=SLOW)])
def test_sampling_with_the_confidence_cut_follows_the_target_law(request, static, shape):
    small = Transformer.from_hf(tiny_llama(3, vocab=8, layers=1, hidden=16, std=0.5))
    config = dflash_head_config(small, block_size=4, target_layers=(0, 1), confidence_head=True)
    head = random_dflash_head(config, seed=4, std=0.1)
    with torch.no_grad():
        head.norm.weight.mul_(0.3)  # laws that overlap the target's (drafts kept and rejected)
    planted(head, 0.7)  # 0.7, 0.49, 0.343: two of the k = 3 positions at 0.45
    drafter = DFlashDrafter(head, confidence_threshold=0.45, **shape)
    assert_drafted_sampling_is_exact(small, drafter, SamplingParams(1.0),
                                     law_samples(request, 1000), cuda_graphs=static)


def test_bad_thresholds_and_heads_without_a_confidence_are_clear_errors(target):
    head = dflash_head(target)
    for bad in (0.0, 1.0, "half", True):
        with pytest.raises(ValueError, match="confidence_threshold must lie in"):
            DFlashDrafter(head, confidence_threshold=bad)
    plain = random_dflash_head(dflash_head_config(target), seed=3)
    with pytest.raises(ValueError, match="trained with a confidence head"):
        DFlashDrafter(plain, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="confidence_head sizes a P-EAGLE block"):
        EagleConfig.for_target(target.config, 3, draft_vocab_size=48, target_layers=(0, 1, 2),
                               confidence_head=True)


def test_the_confidence_is_saved_with_the_head_and_heads_without_one_load_as_before(
        target, tmp_path):
    head = planted(dflash_head(target), 0.8)
    folder = save_head(tmp_path / "with", head, head.config, describe_target(target))
    loaded = load_head(folder, target=target)
    torch.testing.assert_close(loaded.confidence.bias, head.confidence.bias)
    states = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(loaded.acceptance_logits(states), head.acceptance_logits(states))

    plain = random_dflash_head(dflash_head_config(target), seed=3)
    folder = save_head(tmp_path / "without", plain, plain.config, describe_target(target))
    meta = json.loads((folder / "head_config.json").read_text())
    del meta["config"]["confidence_head"]  # a head saved before confidence heads existed
    (folder / "head_config.json").write_text(json.dumps(meta))
    old = load_head(folder, target=target)
    assert not old.config.confidence_head and not hasattr(old, "confidence")


def test_engine_exports_leave_the_confidence_out_and_say_so(target, tmp_path):
    from safetensors.torch import load_file

    from selfspec.heads.export import export_head

    head = planted(dflash_head(target, target_layers=(1, 2)), 0.8)  # the engines: no stream 0
    exported = export_head(head, "dflash", tmp_path / "dflash", base_model="org/toy")
    weights = load_file(str(tmp_path / "dflash" / "model.safetensors"))
    assert "fc.weight" in weights and not any(k.startswith("confidence.") for k in weights)
    assert any("confidence head is left out" in note for note in exported.notes)
