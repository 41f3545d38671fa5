"""The DFlash drafter (drafters/dflash.py): chains and DDTree trees from one block forward,
lossless at greedy, exact when sampling (a planted bug caught), its context cache, and
drafting in static steps with one host read a step."""

import dataclasses
import heapq
from importlib import resources

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    committed_context,
    covering,
    dflash_head_config,
    fit_dflash_head,
    host_reads_per_step,
    law_samples,
    random_dflash_head,
    sampled_pvalue,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import DFlashDrafter, DraftContext
from selfspec.drafters.block import BlockShape
from selfspec.drafters.dflash import block_tokens
from selfspec.model.kv_cache import KVCache
from selfspec.tree import host_tree

PROMPTS = [
    torch.randint(2, 63, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24
SHAPES = {"chain": {}, "tree": {"tree_nodes": 10}}


def greedy_with_dflash(target, head, plain_greedy, static=False, **kwargs) -> list[float]:
    """Assert DFlash greedy decoding equals plain greedy on every prompt; returns each tau."""
    taus = []
    for prompt, expected in plain_greedy.items():
        result = generate(target, list(prompt), drafter=DFlashDrafter(head, **kwargs),
                          max_new_tokens=NEW_TOKENS, cuda_graphs=static)
        assert result.tokens == expected, (prompt, kwargs)
        taus.append(result.stats.tau)
    return taus


@pytest.fixture(scope="module")
def fitted(target, plain_greedy):
    """Heads fit to the target's own greedy continuations of PROMPTS, by block size."""
    heads = {}
    for block in (2, 5, 16):
        heads[block], metrics = fit_dflash_head(target, plain_greedy, block_size=block)
        assert metrics["dflash/slot1_top1"] > 0.6, (block, metrics)
    return heads


# ---- lossless greedy -------------------------------------------------------------------------


@pytest.mark.parametrize("block, shape", covering([2, 3, 5, 9, 16], list(SHAPES)))
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, block, shape):
    head = random_dflash_head(dflash_head_config(target, block_size=block), seed=block)
    greedy_with_dflash(target, head, plain_greedy, **SHAPES[shape])


@pytest.mark.parametrize("block", [2, 5, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("static", [False, True])
def test_greedy_is_lossless_and_accepted_with_fitted_heads(target, plain_greedy, fitted, block,
                                                           shape, static):
    taus = greedy_with_dflash(target, fitted[block], plain_greedy, static, **SHAPES[shape])
    assert all(tau > 1.0 for tau in taus), taus
    assert sum(taus) / len(taus) > min(block, 3) * 0.6, taus


def test_a_draft_vocabulary_and_shorter_drafts_stay_lossless(target, plain_greedy):
    head = random_dflash_head(dflash_head_config(target, block_size=6, draft_vocab_size=40,
                                                 qk_norm=False), seed=3)
    for kwargs in ({"num_draft_tokens": 2}, {"num_draft_tokens": 3, "tree_nodes": 40}):
        greedy_with_dflash(target, head, plain_greedy, **kwargs)


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_pretrained(resources.files("selfspec") / "assets/tiny/target")


@pytest.mark.parametrize("block, shape", [(2, "chain"), (16, "tree")])
def test_greedy_is_lossless_on_the_shipped_tiny_target(tiny, block, shape):
    config = dflash_head_config(tiny, block_size=block, target_layers=None, num_layers=2)
    head = random_dflash_head(config, seed=1, std=0.05)
    assert head.config.target_layers == (2, 4, 6)  # the outputs of layers 1, 3, 5 of 8
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    expected = generate(tiny, prompt, max_new_tokens=20).tokens
    for static in (False, True):
        out = generate(tiny, prompt, drafter=DFlashDrafter(head, **SHAPES[shape]),
                       max_new_tokens=20, cuda_graphs=static)
        assert out.tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("block", range(2, 17))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_is_lossless_on_the_shipped_tiny_target_at_every_block_size(tiny, block, shape):
    head = random_dflash_head(dflash_head_config(tiny, block_size=block, target_layers=None),
                              seed=block, std=0.05)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(40, 60))]
    for prompt in prompts:
        expected = generate(tiny, prompt, max_new_tokens=24).tokens
        out = generate(tiny, prompt, drafter=DFlashDrafter(head, **SHAPES[shape]),
                       max_new_tokens=24)
        assert out.tokens == expected


# ---- what it proposes --------------------------------------------------------------------------


def scratch_logits(target, head, context: DraftContext, k: int) -> torch.Tensor:
    """[k, V] the block's logits recomputed without a cache: the committed context's keys held
    ahead of the block (`PrefixKeys`), the whole block attending to all of them and itself."""
    from selfspec.heads.dflash import PrefixKeys

    streams = context.features.hidden
    length = len(context.tokens) - 1
    with torch.no_grad():
        keys = PrefixKeys(head.context_keys(head.context(streams)[None], torch.arange(length)))
        block = block_tokens(int(context.tokens[-1]), head.config, "cpu")
        hidden = head(target.embed_tokens(block)[None], length + torch.arange(len(block)), keys)
        return head.target_logits(hidden[0, 1:k + 1], target.lm_head)


def ddtree(log_probs: torch.Tensor, nodes: int) -> set[tuple[int, ...]]:
    """DDTree's tree written plainly: pop the best rank tuple from a heap, push its first
    child and its next sibling, until `nodes` are popped; as token paths."""
    order = torch.sort(log_probs, dim=-1, descending=True, stable=True).indices.tolist()
    lp = log_probs.tolist()

    def score(ranks):
        return sum(lp[d][order[d][r]] for d, r in enumerate(ranks))

    heap, popped = [(-score((0,)), (0,))], []
    while heap and len(popped) < nodes:
        _, ranks = heapq.heappop(heap)
        popped.append(ranks)
        if len(ranks) < len(lp):
            heapq.heappush(heap, (-score((*ranks, 0)), (*ranks, 0)))
        if ranks[-1] + 1 < len(lp[0]):
            sibling = (*ranks[:-1], ranks[-1] + 1)
            heapq.heappush(heap, (-score(sibling), sibling))
    return {tuple(order[d][r] for d, r in enumerate(ranks)) for ranks in popped}


def draft_paths(tree, tokens) -> set[tuple[int, ...]]:
    tokens = tokens.tolist()
    return {tuple(tokens[i] for i in tree.path_to(n)) for n in range(tree.num_nodes)}


@pytest.mark.parametrize("k, nodes, vocab", [(3, 10, 64), (5, 4, 64), (7, 30, 8), (2, 60, 8),
                                            (1, 5, 64)])
def test_the_tree_is_ddtrees_best_first_tree(k, nodes, vocab):
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(k + nodes)) * 2
    drafted = BlockShape(k, nodes, vocab).draft(logits, None, None)
    tree = host_tree(dataclasses.replace(_device_tree(drafted, k)))
    assert all(parent < node for node, parent in enumerate(tree.parents))  # topological
    width = min(nodes, vocab)
    assert tree.num_nodes == min(nodes, sum(width**d for d in range(1, k + 1)))
    assert draft_paths(tree, drafted.tokens) == ddtree(torch.log_softmax(logits.double(), -1),
                                                      nodes)


def _device_tree(drafted, k):
    from selfspec.tree import DeviceTree

    return DeviceTree(drafted.parents, k)


def test_the_chain_and_the_tree_come_from_the_block_over_the_committed_context(target):
    head = random_dflash_head(dflash_head_config(target, block_size=6), seed=8, std=0.4)
    history = PROMPTS[2]
    for kwargs in ({"num_draft_tokens": 4}, {"num_draft_tokens": 4, "tree_nodes": 9}):
        drafter = DFlashDrafter(head, **kwargs)
        generate(target, history[:-1], drafter=drafter, max_new_tokens=1)  # begin()
        drafter._cache.reset()
        drafter._committed = 0
        context = committed_context(target, head, history)
        draft = drafter.propose(context)
        logits = scratch_logits(target, head, context, 4)
        if "tree_nodes" in kwargs:
            expected = ddtree(torch.log_softmax(logits.double(), -1), 9)
            assert draft_paths(draft.tree, draft.tokens) == expected
        else:
            assert draft.tokens.tolist() == logits.argmax(-1).tolist()
        assert draft.q is None
        assert drafter._cache.length == len(history) - 1  # the block's own keys are dropped


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("static", [False, True])
def test_the_context_cache_equals_a_recomputation_after_accepts_and_rejections(
        target, plain_greedy, fitted, shape, static):
    head = fitted[5]
    drafter = DFlashDrafter(head, **SHAPES[shape])
    prompt = PROMPTS[0]  # the fitted head drafts some of its tokens wrong
    out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS,
                   cuda_graphs=static)
    assert out.stats.steps >= 4 and 0 < out.stats.accepted < out.stats.drafted  # both outcomes
    committed = drafter._committed
    cache = drafter._static.cache if static else drafter._cache
    history = (prompt + out.tokens)[: committed + 1]
    context = committed_context(target, head, history)
    config = head.config
    fresh = KVCache(config.num_layers, 1, config.num_kv_heads, committed, config.head_dim)
    with torch.no_grad():
        head.write_context(head.context(context.features.hidden)[None], torch.arange(committed),
                           fresh)
    assert fresh.length == committed and (static or cache.length == committed)
    torch.testing.assert_close(cache.k[:, :, :, :committed], fresh.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :, :committed], fresh.v, atol=1e-5, rtol=1e-4)


def test_a_batch_decodes_each_row_as_it_decodes_alone(target, plain_greedy, fitted):
    prompts = [list(p) for p in plain_greedy]
    outs = generate(target, prompts, drafter=DFlashDrafter(fitted[5], tree_nodes=6),
                    max_new_tokens=NEW_TOKENS)
    assert [o.tokens for o in outs] == list(plain_greedy.values())
    assert all(o.stats.tau > 1.5 for o in outs)


def test_no_features_yet_means_an_empty_draft(target):
    head = random_dflash_head(dflash_head_config(target), 1)
    result = generate(target, [3], drafter=DFlashDrafter(head), max_new_tokens=6)
    assert result.tokens == generate(target, [3], max_new_tokens=6).tokens
    assert result.stats.accept_histogram[0] >= 1  # the first step had nothing to verify


# ---- static steps ------------------------------------------------------------------------------


def recorded(drafter) -> list:
    """Every draft the drafter proposes from now on, as (parents, tokens)."""
    records, propose = [], drafter.propose

    def recording(context):
        draft = propose(context)
        records.append((host_tree(draft.tree).parents, draft.tokens.tolist()))
        return draft
    drafter.propose = recording
    return records


class HostSide(DFlashDrafter):
    """Drafting eagerly while the target runs static steps: the reference of static drafts."""

    def begin(self, setup):
        super().begin(dataclasses.replace(setup, static_steps=False))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_static_drafting_proposes_the_eager_drafts(target, plain_greedy, fitted, shape):
    for prompt, expected in plain_greedy.items():
        drafts = []
        for cls in (DFlashDrafter, HostSide):
            drafter = cls(fitted[5], **SHAPES[shape])
            drafts.append(recorded(drafter))
            out = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS,
                           cuda_graphs=True)
            assert out.tokens == expected
        assert drafts[0] == drafts[1] and drafts[0], prompt


@pytest.mark.parametrize("shape, sampling", [("chain", None), ("tree", None),
                                             ("tree", SamplingParams(1.0))])
def test_a_static_step_reads_the_host_once(target, fitted, shape, sampling):
    reads = host_reads_per_step(target, lambda: DFlashDrafter(fitted[5], **SHAPES[shape]),
                                PROMPTS[3], sampling)
    assert reads == 1


# ---- exact sampling ----------------------------------------------------------------------------

N_SAMPLES = 1000
T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)


@pytest.fixture(scope="module")
def small_vocab():
    """A target of 8 tokens with peaky laws, and a head whose laws differ from its (a random
    head, its final norm scaled down so that its laws overlap the target's: drafts are kept
    often enough to be in play, rejected often enough to be tested)."""
    small = Transformer.from_hf(tiny_llama(3, vocab=8, layers=1, hidden=16, std=0.5))
    config = dflash_head_config(small, block_size=4, target_layers=(0, 1))
    head = random_dflash_head(config, seed=4, std=0.1)
    with torch.no_grad():
        head.norm.weight.mul_(0.3)
    return small, head


SLOW = pytest.mark.slow
LAW_CASES = [  # (sampling, shape, static steps); the default run checks two, the rest are slow
    (T1, "tree", False), (TOP_P, "chain", True),
    pytest.param(T1, "chain", False, marks=SLOW), pytest.param(TOP_P, "chain", False, marks=SLOW),
    pytest.param(TOP_P, "tree", False, marks=SLOW), pytest.param(T1, "tree", True, marks=SLOW),
    pytest.param(TOP_P, "tree", True, marks=SLOW),
    pytest.param(T1, "chosen_tree", False, marks=SLOW),
    pytest.param(TOP_P, "chosen_tree", True, marks=SLOW)]
KWARGS = {"chain": {}, "tree": {"tree_nodes": 6},
          "chosen_tree": {"tree_nodes": 6, "sampled_children": False}}


@pytest.mark.parametrize("params, shape, static", LAW_CASES)
def test_sampling_through_dflash_follows_the_target_law(small_vocab, params, shape, static,
                                                        request):
    small, head = small_vocab
    assert_drafted_sampling_is_exact(small, DFlashDrafter(head, **KWARGS[shape]), params,
                                     law_samples(request, N_SAMPLES), cuda_graphs=static)


class ForgetsItDrewWithoutReplacement(DFlashDrafter):
    """A planted bug: siblings drawn without replacement, verified as independent draws."""

    def propose(self, context):
        return dataclasses.replace(super().propose(context), without_replacement=False)


@SLOW  # the planted bug of the law test; the verifier-level twin runs quick
def test_the_law_test_catches_siblings_verified_as_independent_draws(small_vocab):
    small, head = small_vocab
    drafter = ForgetsItDrewWithoutReplacement(head, tree_nodes=6)
    # The correct drafter passes this very test (above, p ~ 0.7); the planted one: p ~ 4e-9.
    assert sampled_pvalue(small, drafter, T1, N_SAMPLES) < 1e-4


def test_sampled_trees_come_with_their_laws(target):
    head = random_dflash_head(dflash_head_config(target, block_size=4), seed=9, std=0.4)
    drafter = DFlashDrafter(head, tree_nodes=7)
    g = torch.Generator().manual_seed(0)
    generate(target, PROMPTS[1][:-1], drafter=drafter, max_new_tokens=1,
             sampling=SamplingParams(1.0), generator=g)
    drafter._cache.reset()
    drafter._committed = 0
    draft = drafter.propose(committed_context(target, head, PROMPTS[1]))
    assert draft.without_replacement and draft.tree.num_nodes == 7
    assert (draft.q[torch.arange(7), draft.tokens] > 0).all()
    depth = [len(c) for c in draft.tree.choices]
    for parent in range(-1, 7):  # siblings share their position's law and never repeat a token
        kids = draft.tree.children_of(parent)
        assert len({draft.tokens[k].item() for k in kids}) == len(kids)
    for a in range(7):  # one law per depth, whatever the path
        for b in range(7):
            if depth[a] == depth[b]:
                assert torch.equal(draft.q[a], draft.q[b])


# ---- errors before any generation ----------------------------------------------------------------


def test_bad_drafter_arguments_and_other_targets_are_clear_errors(target):
    head = random_dflash_head(dflash_head_config(target, block_size=5), seed=1)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in 1\.\.4"):
        DFlashDrafter(head, 5)
    with pytest.raises(ValueError, match="tree_nodes must be null"):
        DFlashDrafter(head, tree_nodes=0)
    other = Transformer.from_hf(tiny_llama(6, hidden=48))
    with pytest.raises(ValueError, match="the head has hidden_size 32, the target 48"):
        generate(other, [3, 4], drafter=DFlashDrafter(head), max_new_tokens=2)
    shallow = Transformer.from_hf(tiny_llama(6, layers=1))
    with pytest.raises(ValueError, match=r"fuses target layers \[0, 1, 2\], but the target "
                                         r"has 1 layers \(no \[2\]\)"):
        generate(shallow, [3, 4], drafter=DFlashDrafter(head), max_new_tokens=2)
