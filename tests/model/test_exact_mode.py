"""The exact mode's attention and activations (`selfspec.model.exact_mode`), and the whole
target in the mode (`batch_invariant=true`): a row's logits are the same bits whatever rows
verify beside it, wherever a tree puts its ancestors and however long the cache is, in fp32
and bf16; without the mode the same comparisons part (where this CPU parts them)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILIES, MOE_FAMILIES, family_model, random_preset

from selfspec.decode import generate
from selfspec.from_config.sweeps import oracle_trees
from selfspec.measure.oracle import OracleDrafter
from selfspec.model import Transformer, loading
from selfspec.model.cpu_linear import INVARIANT_BLOCK_ROWS, use_invariant_products
from selfspec.model.exact_mode import invariant_attention, whole_vectors
from selfspec.model.kv_cache import RowSlots
from selfspec.model.transformer import _written_out_attention

DTYPES = [torch.float32, torch.bfloat16]


def qkv(rows: int, slots: int, dtype=torch.float32, batch: int = 1, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 6, rows, 16, generator=generator)
    k, v = (torch.randn(batch, 2, slots, 16, generator=generator) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def causal_after(past: int, rows: int) -> torch.Tensor:
    mask = torch.ones(rows, past + rows, dtype=torch.bool)
    mask[:, past:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    return mask


def attend(q, k, v, mask, **extra):
    return invariant_attention(q, k, v, mask, scale=None, block_rows=INVARIANT_BLOCK_ROWS,
                               **extra)


@pytest.mark.parametrize("mask", ["causal", "past", "batch"])
def test_the_attention_is_sdpas(mask):
    q, k, v = qkv(70, 150, batch=2)
    if mask == "causal":
        q, attn_mask = torch.cat((q, q, q), dim=2)[:, :, :150], None
    else:
        attn_mask = causal_after(80, 70)
        if mask == "batch":  # row 1 sees 20 fewer of the past's slots
            attn_mask = attn_mask.repeat(2, 1, 1, 1)
            attn_mask[1, :, :, :20] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              is_causal=attn_mask is None, enable_gqa=True)
    assert torch.allclose(attend(q, k, v, attn_mask), expected, atol=1e-5)
    if attn_mask is None:  # a prefill's blocks stop at their rows' last keys: the same bits
        causal = torch.ones(150, 150, dtype=torch.bool).tril()
        assert torch.equal(attend(q, k, v, None), attend(q, k, v, causal))


def test_soft_capping_and_sinks_are_the_written_out_attentions():
    q, k, v = qkv(5, 90)
    mask, sinks = causal_after(85, 5), torch.linspace(-1, 2, 6)
    expected = _written_out_attention(q, k, v, mask, 0.3, 2.0, sinks)
    out = invariant_attention(q, k, v, mask, scale=0.3, block_rows=8, softcap=2.0, sinks=sinks)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_bits_it_has_alone_and_a_longer_cache_changes_none(dtype):
    rows, past = 70, 470  # past one block of rows, several chunks and a group of keys
    q, k, v = qkv(rows, past + rows + 40, dtype)
    together = attend(q, k[:, :, :past + rows], v[:, :, :past + rows], causal_after(past, rows))
    longer = causal_after(past, rows + 40)[:rows]  # 40 more slots after, hidden from every row
    assert torch.equal(attend(q, k, v, longer), together)
    for r in (0, 1, 63, 64, 69):
        seen = past + r + 1
        alone = attend(q[:, :, r:r + 1], k[:, :, :seen], v[:, :, :seen],
                       torch.ones(1, seen, dtype=torch.bool))
        assert torch.equal(alone[:, :, 0], together[:, :, r]), r


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_node_is_the_bits_of_its_path_laid_out_as_a_chain(dtype):
    past = 100
    q, k, v = qkv(4, past + 4, dtype)
    chain = attend(q[:, :, :3], k[:, :, :past + 3], v[:, :, :past + 3], causal_after(past, 3))
    # the same path (slots 0, 1, 2 of the chain) at tree slots 0, 2, 3, a sibling at slot 1
    spread = [0, 3, 1, 2]  # the tree's slot s holds the chain's row / key spread[s]
    tree_q, tree_k, tree_v = q[:, :, spread], k.clone(), v.clone()
    tree_k[:, :, past:], tree_v[:, :, past:] = k[:, :, past:][:, :, spread], v[:, :, past:][
        :, :, spread]
    among = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    mask = torch.cat((torch.ones(4, past, dtype=torch.bool), among), dim=1)
    tree = attend(tree_q, tree_k, tree_v, mask)
    assert torch.equal(tree[:, :, [0, 2, 3]], chain)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_activation_over_whole_vectors_keeps_each_rows_bits(dtype):
    x = torch.randn(40, 688, generator=torch.Generator().manual_seed(0)).to(dtype)
    together = whole_vectors(F.silu, x)
    assert torch.allclose(together.float(), F.silu(x).float(), atol=1e-6)
    assert all(torch.equal(whole_vectors(F.silu, x[r:r + 1])[0], together[r])
               for r in range(len(x)))


# ---- the whole target in the mode ---------------------------------------------------------


# Every family: dense, soft-capped, windowed, mixtures of experts, and the random presets of
# MLA with MoE (DeepSeek-V3), Gemma 4, Llama 4's chunked layers and a recurrent hybrid
TARGETS = FAMILIES + ("gemma2",) + MOE_FAMILIES + (
    "random-deepseek-v3", "random-gemma4", "random-llama4", "random-hybrid")


def target(family: str, dtype: torch.dtype, exact: bool) -> Transformer:
    if family.startswith("random-"):
        model, _ = loading.random_models(random_preset(family, weights=True))
    else:
        model = copy.deepcopy(family_model(family))
    model = model.to(dtype).eval()
    use_invariant_products(model, INVARIANT_BLOCK_ROWS if exact else None)
    return model


PROMPT = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 9, 10, 11, 12]])
CHAIN = torch.tensor([[20, 21, 22, 23]])


@torch.inference_mode()
def logits_of(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    device = model.embed_tokens.weight.device
    cache = model.new_cache(1, 64)
    model(PROMPT.to(device), torch.arange(PROMPT.shape[1], device=device), cache)
    return model(tokens.to(device), positions.to(device), cache,
                 mask=None if mask is None else mask.to(device)).logits[0]


def chain_and_tree(model: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's logits, and the same chain's rows verified as the path of a 7-node tree
    whose siblings sit between its nodes."""
    start = PROMPT.shape[1]
    chain = logits_of(model, CHAIN, start + torch.arange(4))
    # the path 0 -> 2 -> 4 -> 6 (20, 21, 22, 23); 1, 3 and 5 are siblings off it
    tokens = torch.tensor([[20, 30, 21, 31, 22, 32, 23]])
    parents = [-1, -1, 0, 0, 2, 4, 4]
    mask = torch.eye(7, dtype=torch.bool)
    depth = []
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    tree = logits_of(model, tokens, start + torch.tensor(depth), mask)
    return chain, tree[[0, 2, 4, 6]]


@pytest.mark.parametrize("family", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_the_mode_a_trees_path_and_single_rows_are_the_chains_bits(family, dtype):
    model = target(family, dtype, exact=True)
    chain, tree = chain_and_tree(model)
    assert torch.equal(tree, chain)
    start = PROMPT.shape[1]
    for r in range(CHAIN.shape[1]):  # each row alone, after the chain's rows before it
        alone = logits_of(model, CHAIN[:, :r + 1], start + torch.arange(r + 1))[-1]
        assert torch.equal(alone, chain[r]), r


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_the_mode_a_batch_row_is_the_bits_it_has_alone(dtype):
    model = target("llama", dtype, exact=True)
    prompts = [PROMPT[0], PROMPT[0, 3:]]  # rows of different lengths
    with torch.inference_mode():
        cache = model.new_cache(2, 64)
        alone = []
        for b, prompt in enumerate(prompts):
            row = cache.row(b)
            model(prompt[None], torch.arange(len(prompt)), row)
            alone.append(model(CHAIN, len(prompt) + torch.arange(4), row).logits[0])
            row.truncate(len(prompt))
        lengths = [len(p) for p in prompts]
        slots = RowSlots(cache, lengths, 4)
        masks = torch.ones(4, 4, dtype=torch.bool).tril().expand(2, 4, 4)
        positions = torch.tensor(lengths)[:, None] + torch.arange(4)
        together = model(CHAIN.expand(2, 4), positions, slots, mask=slots.mask(masks)).logits
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


def test_without_the_mode_the_same_tree_parts_from_its_chain_somewhere():
    """The planted bug: the default kernels. Where this CPU keeps every family's bits anyway
    there is nothing for the mode to fix, and the test says so."""
    parted = [family for family in TARGETS for dtype in DTYPES
              if not torch.equal(*chain_and_tree(target(family, dtype, exact=False)))]
    if not parted:
        pytest.skip("this CPU's default kernels keep a tree's path equal to its chain")
    assert parted


# ---- greedy speculation in the mode: the oracle accepts its whole answer ------------------


ORACLE_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42], [9, 8, 7, 6, 5]]
ANSWER = 40  # new tokens


def oracle_runs(model: Transformer) -> dict[str, tuple[bool, float]]:
    """Whether the tokens equal plain greedy decoding's, and tau, for the oracle's chain of 8,
    its answer along EAGLE-2's 60-node tree and Medusa's 63-node tree, and its chain of 4
    over three prompts as one batch (the least tau of its rows)."""
    oracle, found = OracleDrafter(8), {}
    prompt = ORACLE_PROMPTS[0]
    plain = generate(model, prompt, max_new_tokens=ANSWER).tokens
    drafters = {"chain_8": oracle} | {name: oracle.with_tree(choices) for name, choices
                                      in oracle_trees(["eagle2", "medusa_63"])}
    for name, drafter in drafters.items():
        result = generate(model, prompt, drafter=drafter, max_new_tokens=ANSWER)
        found[name] = (result.tokens == plain, result.stats.tau)
    # its rows' answers: plain decoding of each prompt alone (not of the same batch)
    alone = [generate(model, p, max_new_tokens=ANSWER).tokens for p in ORACLE_PROMPTS]
    for p, tokens in zip(ORACLE_PROMPTS, alone, strict=True):
        oracle._answers[(id(model), ("rows", len(ORACLE_PROMPTS)), tuple(p))] = tokens
    results = generate(model, ORACLE_PROMPTS, drafter=oracle.with_draft_tokens(4),
                       max_new_tokens=ANSWER)
    found["batch_3"] = ([r.tokens for r in results] == alone,
                        min(r.stats.tau for r in results))
    return found


ORACLE_TARGETS = ("llama", "gemma3", "qwen3_moe") + tuple(
    pytest.param(preset, marks=pytest.mark.slow)
    for preset in ("random-gemma4", "random-llama4", "random-deepseek-v3", "random-hybrid"))


@pytest.fixture(scope="module")
def never_refused() -> dict[str, float]:
    """Each oracle's tau where none of its tokens is refused: the fp32 Llama in the mode (the
    same for every target: it depends on the answer's length and the draft's shape alone)."""
    runs = oracle_runs(target("llama", torch.float32, exact=True))
    assert all(lossless for lossless, _ in runs.values())
    return {name: tau for name, (_, tau) in runs.items()}


@pytest.mark.parametrize("family", ORACLE_TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_the_mode_the_oracle_is_never_refused_and_decoding_is_lossless(
        family, dtype, never_refused):
    runs = oracle_runs(target(family, dtype, exact=True))
    assert {name: lossless for name, (lossless, _) in runs.items()} == dict.fromkeys(runs, True)
    assert {name: tau for name, (_, tau) in runs.items()} == never_refused


def test_without_the_mode_bf16_refuses_the_oracle_or_parts_from_plain_decoding(never_refused):
    """The planted bug, as the H200 showed it: bf16's default kernels sum a verification's
    rows in another order than plain decoding's, a near-tie falls the other way, the oracle's
    answer is refused there and speculation parts from plain greedy decoding."""
    parted = [(family, name) for family in ("llama", "random-gemma4")
              for name, (lossless, tau) in oracle_runs(
                  target(family, torch.bfloat16, exact=False)).items()
              if not lossless or tau < never_refused[name]]
    if not parted:
        pytest.skip("this CPU's bf16 kernels keep verification rows equal to plain decoding's")
    assert parted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "random-hybrid"])
def test_on_cuda_in_bf16_the_mode_keeps_every_rows_bits_and_the_oracle(family, never_refused):
    """The GPU half (the check's cuda_tests part): CUDA's kernels in bf16, static steps and
    graphs as `generate` takes them there."""
    model = target(family, torch.bfloat16, exact=True).cuda()
    chain, tree = chain_and_tree(model)
    assert torch.equal(tree, chain)
    runs = oracle_runs(model)
    assert {name: lossless for name, (lossless, _) in runs.items()} == dict.fromkeys(runs, True)
    assert {name: tau for name, (_, tau) in runs.items()} == never_refused
