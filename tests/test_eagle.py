"""EAGLE: heads (EAGLE-1, EAGLE-3), losses and objectives, the training-time test, the drafter
(static trees, EAGLE-2 dynamic trees: lossless greedy, exact sampling, its own KV cache),
checkpoints."""

import json
import math

import pytest
import torch
from helpers import (
    assert_drafted_sampling_is_exact,
    fit_eagle_head,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, Tree, generate
from selfspec.drafters import EagleDrafter
from selfspec.drafters.base import DraftContext, TargetFeatures
from selfspec.heads import (
    EagleConfig,
    EagleHead,
    describe_target,
    draft_vocabulary,
    load_head,
    save_head,
)
from selfspec.heads.eagle import default_target_layers, ttt_mask
from selfspec.kv_cache import KVCache
from selfspec.losses import eagle3_loss, eagle_loss, soft_cross_entropy
from selfspec.objectives import Eagle3Objective, EagleObjective

PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24
LAYERS3 = (0, 1, 2)  # EAGLE-3's fused streams on a 2-layer toy target
STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def head_config(target: Transformer, version: int, **overrides) -> EagleConfig:
    extra = {"draft_vocab_size": 48, "target_layers": LAYERS3} if version == 3 else {}
    return EagleConfig.for_target(target.config, version, **(extra | overrides))


def random_head(config: EagleConfig, seed: int, std: float = 0.2) -> EagleHead:
    """A head with every weight random (norms around 1) and, for EAGLE-3, a draft vocabulary
    of every other id first."""
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    if config.version == 3:
        vocab = config.vocab_size
        ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])
        head.set_draft_vocab(draft_vocabulary(ids[: config.draft_vocab_size], config.vocab_size,
                                              config.draft_vocab_size))
    return head.eval()


# ---- heads ------------------------------------------------------------------------------------


def test_parameter_names_are_the_published_checkpoints(target):
    v1 = EagleHead(head_config(target, 1)).state_dict()
    layer = {f"layers.0.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "post_attention_layernorm.weight")}
    assert set(v1) == {"fc.weight", "fc.bias"} | layer  # no input norm, final norm, LM head
    assert v1["fc.weight"].shape == (32, 64)
    v3 = EagleHead(head_config(target, 3)).state_dict()
    mid = {n.replace("layers.0.", "midlayer.") for n in layer} | {
        "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"}
    assert set(v3) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | mid
    assert v3["fc.weight"].shape == (32, 96) and v3["lm_head.weight"].shape == (48, 32)
    assert v3["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # reads 2h
    assert v3["d2t"].dtype == torch.long and v3["t2d"].dtype == torch.bool


def test_config_errors_are_clear():
    sizes = {"hidden_size": 8, "vocab_size": 20, "intermediate_size": 16, "num_heads": 2,
             "num_kv_heads": 1, "head_dim": 4}
    with pytest.raises(ValueError, match="version must be 1 or 3"):
        EagleConfig(version=2, **sizes)
    with pytest.raises(ValueError, match="EAGLE-1 drafts over the full vocabulary"):
        EagleConfig(version=1, draft_vocab_size=10, **sizes)
    with pytest.raises(ValueError, match="fuses three target layers"):
        EagleConfig(version=3, draft_vocab_size=10, target_layers=(1, 2), **sizes)
    with pytest.raises(ValueError, match="draft_vocab_size 30 exceeds"):
        EagleConfig(version=3, draft_vocab_size=30, target_layers=(1, 2, 3), **sizes)
    assert default_target_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="pass target_layers explicitly"):
        default_target_layers(2)


def test_the_draft_vocabulary_keeps_the_most_frequent_ids():
    tokens = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7], [3, 3, 1, 1, 1, 1, 1, 0, 0, 0]])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 2:7] = False  # the 1s do not count
    vocab = draft_vocabulary(tokens, vocab_size=12, draft_vocab_size=5, mask=mask)
    # counts: 7:4, 5:3, 0:3, 9:2, 3:2, then 2:1; ties by lower id first
    assert vocab.target_ids.tolist() == [0, 3, 5, 7, 9]
    assert (vocab.target_ids == torch.arange(5) + vocab.d2t).all()
    assert vocab.t2d.nonzero().flatten().tolist() == [0, 3, 5, 7, 9]
    wide = draft_vocabulary(tokens[:1], vocab_size=12, draft_vocab_size=7)
    assert wide.target_ids.tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill in, lowest first


def test_target_logits_put_draft_scores_at_their_target_ids(target):
    head = random_head(head_config(target, 3), seed=1)
    hidden = torch.randn(3, 32)
    draft = head.logits(hidden)  # [3, 48]
    full = head.target_logits(hidden)  # [3, 64]
    ids = head.draft_vocab.target_ids
    assert torch.equal(full[:, ids], draft)
    assert torch.isinf(full[:, ~head.t2d]).all()


# ---- EAGLE-1 loss and objective ---------------------------------------------------------------


def test_eagle_loss_weighs_its_two_terms_and_respects_rows():
    g = torch.Generator().manual_seed(0)
    predicted, features = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    head_logits = torch.randn(2, 5, 11, generator=g)
    target_logits = torch.randn(2, 5, 11, generator=g)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    out = eagle_loss(predicted, head_logits, features, target_logits, valid, 1.0, 0.1)
    rows = valid.float()
    feature = torch.nn.functional.smooth_l1_loss(predicted, features, reduction="none").mean(-1)
    token = soft_cross_entropy(head_logits, target_logits)
    expected_f, expected_t = (feature * rows).sum() / 8, (token * rows).sum() / 8
    assert out.metrics["eagle/feature_loss"] == pytest.approx(float(expected_f), rel=1e-6)
    assert out.metrics["eagle/token_loss"] == pytest.approx(float(expected_t), rel=1e-6)
    assert float(out.loss) == pytest.approx(float(expected_f + 0.1 * expected_t), rel=1e-6)
    perfect = eagle_loss(features, target_logits, features, target_logits)
    assert perfect.metrics["eagle/feature_loss"] == 0.0 and perfect.metrics["eagle/top1"] == 1.0
    entropy = -(target_logits.softmax(-1) * target_logits.log_softmax(-1)).sum(-1).mean()
    assert perfect.metrics["eagle/token_loss"] == pytest.approx(float(entropy), rel=1e-5)
    predicted.requires_grad_(True)
    none = eagle_loss(predicted, head_logits, features, target_logits, torch.zeros_like(valid))
    none.loss.backward()
    assert float(none.loss.detach()) == 0.0 and torch.isfinite(predicted.grad).all()
    with pytest.raises(ValueError, match=r"valid must be \[B, T\]"):
        eagle_loss(predicted, head_logits, features, target_logits, valid[:, :3])


def test_the_eagle_objective_aligns_features_tokens_and_mask(target):
    """Row t reads (f_t, token t+1), learns f_{t+1} and the target's law at t+1, and counts
    when token t+2 does: checked against a row-by-row computation."""
    head = random_head(head_config(target, 1), seed=3)
    tokens = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, 5] = 0
    out = EagleObjective(target, head).eval()(tokens, mask)
    with torch.no_grad():
        full = target(tokens, torch.arange(9))
        features, predicted, logits, rows = [], [], [], []
        for b in range(2):
            for t in range(8):  # rows t = 0..T-2
                pairs = head(target.embed_tokens(tokens[b:b + 1, 1:t + 2]),
                             full.last_hidden[b:b + 1, :t + 1], torch.arange(t + 1))
                predicted.append(pairs[0, -1])
                features.append(full.last_hidden[b, t + 1])
                logits.append(full.logits[b, t + 1])
                rows.append(t + 2 < 9 and bool(mask[b, t + 2]))
        predicted, features, logits = (torch.stack(x)[None] for x in (predicted, features, logits))
        expected = eagle_loss(predicted, head.logits(predicted, target.lm_head), features, logits,
                              torch.tensor(rows)[None])
    assert float(out.loss.detach()) == pytest.approx(float(expected.loss), rel=1e-5)
    assert out.metrics["eagle/top1"] == expected.metrics["eagle/top1"]


def test_feature_noise_is_for_training_only_and_from_the_generator(target):
    head = random_head(head_config(target, 1), seed=3)
    tokens = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)

    def loss(noise: float, train: bool, seed: int) -> float:
        objective = EagleObjective(target, head, feature_noise=noise,
                                   generator=torch.Generator().manual_seed(seed))
        return float(objective.train(train)(tokens, mask).loss.detach())

    clean = loss(0.0, True, 0)
    assert loss(0.5, False, 0) == clean  # evaluation never adds noise
    assert loss(0.5, True, 0) != clean
    assert loss(0.5, True, 0) == loss(0.5, True, 0) != loss(0.5, True, 1)


# ---- EAGLE-3 training-time test ---------------------------------------------------------------


def test_the_ttt_mask_is_causal_on_step_zero_and_diagonal_after():
    mask = ttt_mask(4, 2)
    assert mask.shape == (4, 12)
    assert torch.equal(mask[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(mask[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[:, 8:], torch.eye(4, dtype=torch.bool))


def step_by_step(head, target, tokens, steps):
    """Each row t of each step j computed as drafting does, alone with a fresh cache: the
    pairs (f_s, token s+1) for s <= t, then j pairs (own output, token t+1+i) at t+i."""
    with torch.no_grad():
        out = target(tokens, torch.arange(tokens.shape[1]), return_hidden=head.config.target_layers)
    feature = head.target_feature(out.last_hidden, out.hidden)  # [B, T, h]
    length = tokens.shape[1]
    hidden = torch.zeros(steps, tokens.shape[0], length - 1, head.config.hidden_size)
    for b in range(tokens.shape[0]):
        for t in range(length - 1):
            cache = KVCache(1, 1, head.config.num_kv_heads, t + steps + 1, head.config.head_dim)
            embeds = target.embed_tokens(tokens[b:b + 1, 1:t + 2])
            last = head(embeds, feature[b:b + 1, :t + 1], torch.arange(t + 1), cache)[:, -1:]
            hidden[0, b, t] = last[0, 0]
            for j in range(1, steps):
                token = tokens[b, t + 1 + j] if t + 1 + j < length else torch.tensor(0)
                embed = target.embed_tokens(token.view(1, 1))
                if t + 1 + j >= length:
                    embed = torch.zeros_like(embed)  # past the row's end, as unroll pads
                last = head(embed, last, torch.tensor([t + j]), cache)
                hidden[j, b, t] = last[0, 0]
    return hidden, out.logits


def test_the_training_time_test_equals_drafting_step_by_step(target):
    head = random_head(head_config(target, 3), seed=5).init_from_target(target)
    tokens = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, 4] = 0
    steps = 4
    with torch.no_grad():
        out = target(tokens, torch.arange(8), return_hidden=LAYERS3)
        feature = head.target_feature(out.last_hidden, out.hidden)[:, :-1]
        unrolled = head.unroll(target.embed_tokens(tokens), feature, steps)
        expected, target_logits = step_by_step(head, target, tokens, steps)
        for j in range(steps):
            torch.testing.assert_close(unrolled[j], expected[j], atol=1e-5, rtol=1e-5)
        loss = Eagle3Objective(target, head, steps=steps)(tokens, mask)
    # The loss, summed by hand: step j row t scores token t+2+j against the target's law at
    # t+1+j restricted to the draft vocabulary, when that token counts and the target's
    # argmax is a draft token.
    t2d, total = head.t2d, 0.0
    for j in range(steps):
        terms = []
        for b in range(2):
            for t in range(8 - 2 - j):
                teacher = target_logits[b, t + 1 + j]
                if mask[b, t + 2 + j] and t2d[teacher.argmax()]:
                    terms.append(float(soft_cross_entropy(head.logits(expected[j, b, t]).detach(),
                                                          teacher[t2d])))
        step = sum(terms) / max(len(terms), 1)
        assert loss.metrics[f"eagle3/step{j}_loss"] == pytest.approx(step, rel=1e-4)
        total += 0.8**j * step
    assert float(loss.loss) == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("version", [1, 3])
def test_cached_target_states_give_the_same_loss_and_run_the_target_once(target, version):
    head = random_head(head_config(target, version), seed=3).init_from_target(target)
    tokens = torch.randint(2, 64, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(tokens)
    make = EagleObjective if version == 1 else Eagle3Objective
    plain, cached = (make(target, head, cache_features=c).eval() for c in (False, True))
    forwards = []
    hook = target.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            expected = plain(tokens, mask)
            runs = len(forwards)
            first, second = cached(tokens, mask), cached(tokens[[2, 0]], mask[[2, 0]])
    finally:
        hook.remove()
    assert runs == 1 and len(forwards) == 2  # the cache ran the target once, for all rows
    torch.testing.assert_close(first.loss, expected.loss)
    with torch.no_grad():
        reordered = plain(tokens[[2, 0]], mask[[2, 0]])
    torch.testing.assert_close(second.loss, reordered.loss)


def test_eagle3_loss_skips_rows_whose_target_token_is_not_a_draft_token():
    target_logits = torch.zeros(1, 5, 6)
    target_logits[0, :, 5] = 9.0  # the target's argmax is id 5 everywhere
    t2d = torch.tensor([True, True, True, True, False, True])
    step = torch.zeros(1, 4, 5, requires_grad=True)
    assert eagle3_loss([step], target_logits, t2d).metrics["eagle3/step0_top1"] == 0.0
    t2d[5] = False
    t2d[4] = True
    out = eagle3_loss([step], target_logits, t2d)
    assert float(out.loss) == 0.0  # no row counts
    out.loss.backward()
    assert torch.isfinite(step.grad).all()


# ---- drafter: lossless greedy -----------------------------------------------------------------


DRAFTERS = {
    "chain": {"tree": Tree.chain(4)},
    "static_tree": {"tree": STATIC_TREE},
    "dynamic": {"total_tokens": 12, "depth": 4, "top_k": 3},
    "dynamic_narrow": {"total_tokens": 4, "depth": 4, "top_k": 1},
}


def greedy_with_eagle(target, head, kwargs, plain_greedy, static=False) -> list[float]:
    """Assert EAGLE greedy decoding equals plain greedy on every prompt; returns each tau.
    static: the target's forwards as static steps (CUDA graphs on CUDA), features included."""
    taus = []
    for prompt, expected in plain_greedy.items():
        result = generate(target, list(prompt), drafter=EagleDrafter(head, **kwargs),
                          max_new_tokens=NEW_TOKENS, cuda_graphs=static)
        assert result.tokens == expected, (prompt, kwargs)
        taus.append(result.stats.tau)
    return taus


@pytest.fixture(scope="module")
def fitted_heads(target, plain_greedy):
    """EAGLE-1 and EAGLE-3 heads fit to the target's own greedy continuations of PROMPTS."""
    v1, metrics = fit_eagle_head(target, plain_greedy, version=1, steps=60)
    assert metrics["eagle/top1"] > 0.5, metrics
    v3, metrics = fit_eagle_head(target, plain_greedy, version=3, steps=60, draft_vocab_size=48,
                                 target_layers=LAYERS3)
    assert metrics["eagle3/step0_top1"] > 0.5, metrics
    return {1: v1, 3: v3}


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("mode", list(DRAFTERS))
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, version, mode):
    head = random_head(head_config(target, version), seed=2)
    greedy_with_eagle(target, head, DRAFTERS[mode], plain_greedy)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("mode, static", [("chain", False), ("static_tree", False),
                                          ("dynamic", False), ("dynamic", True)])
def test_greedy_is_lossless_and_accepted_with_fitted_heads(
    target, plain_greedy, fitted_heads, version, mode, static
):
    taus = greedy_with_eagle(target, fitted_heads[version], DRAFTERS[mode], plain_greedy,
                             static)
    assert all(tau > 1.0 for tau in taus), taus
    assert sum(taus) / len(taus) > 2.0, taus


# ---- drafter: what it proposes ----------------------------------------------------------------


def committed_context(target, head, history: list[int]) -> DraftContext:
    """The context after a plain forward over history[:-1] (the root history[-1] not fed)."""
    tokens = torch.tensor(history)
    with torch.no_grad():
        out = target(tokens[None, :-1], torch.arange(len(history) - 1),
                     return_hidden=head.config.target_layers)
    features = TargetFeatures(tokens[:-1], out.last_hidden[0], tuple(h[0] for h in out.hidden))
    return DraftContext(tokens, features)


def scratch_logits(target, head, context: DraftContext, path: tuple[int, ...]) -> torch.Tensor:
    """[V] the head's logits after the root and then `path`, recomputed from scratch: no cache,
    no tree mask, the path fed one pair at a time after the committed pairs."""
    f = context.features
    feature = head.target_feature(f.last_hidden, f.hidden)[None]  # [1, C, h]
    tokens = context.tokens[1:].tolist()
    with torch.no_grad():
        for i in range(len(path) + 1):
            ids = torch.tensor([tokens + list(path[:i])])
            out = head(target.embed_tokens(ids), feature, torch.arange(ids.shape[1]))
            feature = torch.cat([feature, out[:, -1:]], dim=1)
        return head.target_logits(out[0, -1], target.lm_head)


def reference_eagle2(logits_after, top_k: int, depth: int, total: int) -> list[tuple[int, ...]]:
    """EAGLE-2's tree written plainly: expand the top_k frontier by cumulative log-probability
    for `depth` levels, pool every node, keep the best `total` (ties: the earlier made)."""
    made, frontier = [], [((), 0.0)]
    for _ in range(depth):
        level = []
        for path, score in frontier:
            logits = logits_after(path)
            log_probs = torch.log_softmax(logits, dim=-1)
            order = torch.sort(logits, descending=True, stable=True).indices[:top_k]
            level += [(path + (t,), score + float(log_probs[t])) for t in order.tolist()]
        made += level
        frontier = sorted(level, key=lambda node: -node[1])[:top_k]
    return [path for path, _ in sorted(made, key=lambda node: -node[1])[:total]]


def draft_paths(draft) -> list[tuple[int, ...]]:
    tokens = draft.tokens.tolist()
    return [tuple(tokens[i] for i in draft.tree.path_to(n)) for n in range(draft.tree.num_nodes)]


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("total, depth, top_k", [(10, 4, 3), (4, 4, 2), (30, 3, 4), (7, 5, 1)])
def test_the_dynamic_tree_is_eagle2s(target, version, total, depth, top_k):
    head = random_head(head_config(target, version), seed=7, std=0.4)
    drafter = EagleDrafter(head, total_tokens=total, depth=depth, top_k=top_k)
    history = PROMPTS[2]
    generate(target, history, drafter=drafter, max_new_tokens=1)  # begin(): a fresh cache
    drafter._cache.reset()
    drafter._committed = 0
    context = committed_context(target, head, history)
    draft = drafter.propose(context)
    expected = reference_eagle2(lambda p: scratch_logits(target, head, context, p),
                                top_k, depth, total)
    assert sorted(draft_paths(draft)) == sorted(expected)
    assert draft.tree.num_nodes == min(total, drafter.max_nodes)
    assert draft.tree.max_depth <= depth
    assert all(parent < node for node, parent in enumerate(draft.tree.parents))  # topological
    assert draft.q is None
    assert drafter._cache.length == len(history) - 1  # the draft's own slots are dropped


@pytest.mark.parametrize("version", [1, 3])
def test_a_static_tree_gets_each_rank_from_its_parents_head_output(target, version):
    head = random_head(head_config(target, version), seed=8, std=0.4)
    drafter = EagleDrafter(head, STATIC_TREE)
    generate(target, PROMPTS[1], drafter=drafter, max_new_tokens=1)
    drafter._cache.reset()
    drafter._committed = 0
    context = committed_context(target, head, PROMPTS[1])
    draft = drafter.propose(context)
    tokens = draft.tokens.tolist()
    for node, choice in enumerate(draft.tree.choices):
        parent_path = tuple(tokens[i] for i in draft.tree.path_to(node)[:-1])
        logits = scratch_logits(target, head, context, parent_path)
        ranking = torch.sort(logits, descending=True, stable=True).indices
        assert tokens[node] == int(ranking[choice[-1]])
    assert draft.tree.parents == Tree.from_paths(STATIC_TREE).parents


@pytest.mark.parametrize("version", [1, 3])
def test_the_heads_cache_equals_a_recomputation_over_the_committed_context(
    target, plain_greedy, fitted_heads, version
):
    head = fitted_heads[version]
    drafter = EagleDrafter(head, total_tokens=8, depth=4, top_k=2)
    prompt = PROMPTS[3]
    out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert out.stats.steps >= 4 and 0 < out.stats.accepted < out.stats.drafted  # both outcomes
    committed = drafter._committed
    history = (prompt + out.tokens)[: committed + 1]
    context = committed_context(target, head, history)
    fresh = KVCache(1, 1, head.config.num_kv_heads, committed, head.config.head_dim)
    f = context.features
    with torch.no_grad():
        head(target.embed_tokens(context.tokens[None, 1:]),
             head.target_feature(f.last_hidden, f.hidden)[None], torch.arange(committed), fresh)
    assert drafter._cache.length == committed == fresh.length
    torch.testing.assert_close(drafter._cache.k[:, :, :, :committed], fresh.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter._cache.v[:, :, :, :committed], fresh.v, atol=1e-5, rtol=1e-4)


def test_no_features_yet_means_an_empty_draft(target):
    drafter = EagleDrafter(random_head(head_config(target, 1), 1), total_tokens=4, depth=2,
                           top_k=2)
    result = generate(target, [3], drafter=drafter, max_new_tokens=6)
    assert result.tokens == generate(target, [3], max_new_tokens=6).tokens
    assert result.stats.accept_histogram[0] >= 1  # the first step had nothing to verify


# ---- drafter: exact sampling ------------------------------------------------------------------

SMALL_VOCAB = 8
N_SAMPLES = 1000


T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)
DYNAMIC = {"total_tokens": 6, "depth": 3, "top_k": 2, "sampled_children": False}
# A budget of 3 nodes for up to 2 + 4 + 4 drawn: keeping the best-scored drawn tokens instead
# (pool and cut, as with chosen children) fails this test at p ~ 1e-9.
SAMPLED = {"total_tokens": 3, "depth": 3, "top_k": 2, "sampled_children": True}
STATIC_SAMPLED = {"tree": [[0], [1], [0, 0], [0, 1], [1, 0]], "sampled_children": True}


@pytest.mark.parametrize("params, kwargs", [
    (T1, DYNAMIC), (TOP_P, DYNAMIC), (T1, SAMPLED), (TOP_P, SAMPLED), (T1, STATIC_SAMPLED),
], ids=["dynamic-t1", "dynamic-top_p", "dynamic_sampled-t1", "dynamic_sampled-top_p",
        "static_sampled-t1"])
def test_sampling_through_eagle_follows_the_target_law(params, kwargs):
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    head = random_head(EagleConfig.for_target(target.config, 1), seed=4, std=0.1)
    drafter = EagleDrafter(head, **kwargs)
    assert_drafted_sampling_is_exact(target, drafter, params, N_SAMPLES)


def test_sampled_children_come_with_their_laws(target):
    head = random_head(head_config(target, 3), seed=9, std=0.4)
    drafter = EagleDrafter(head, total_tokens=7, depth=3, top_k=3, sampled_children=True)
    generate(target, PROMPTS[1], drafter=drafter, max_new_tokens=1,
             sampling=SamplingParams(1.0), generator=torch.Generator().manual_seed(0))
    drafter._cache.reset()
    drafter._committed = 0
    draft = drafter.propose(committed_context(target, head, PROMPTS[1]))
    assert draft.tree.num_nodes == 7 and draft.without_replacement
    assert draft.q.shape == (7, 64)
    assert (draft.q[torch.arange(7), draft.tokens] > 0).all()
    assert (draft.q[:, ~head.t2d] == 0).all()  # EAGLE-3 draws from its draft vocabulary only
    for parent in range(-1, 7):  # siblings share their parent's law and never repeat a token
        kids = draft.tree.children_of(parent)
        assert len({draft.tokens[k].item() for k in kids}) == len(kids)
        assert all(torch.equal(draft.q[k], draft.q[kids[0]]) for k in kids)


# ---- errors before any generation ------------------------------------------------------------


def test_bad_drafter_arguments_are_clear_errors(target):
    head = random_head(head_config(target, 3), seed=1)  # scores 48 draft tokens
    with pytest.raises(ValueError, match=r"total_tokens \(3\) < depth \(4\)"):
        EagleDrafter(head, total_tokens=3, depth=4, top_k=2)
    with pytest.raises(ValueError, match=r"top_k \(50\) exceeds the 48 tokens the head scores"):
        EagleDrafter(head, total_tokens=60, depth=2, top_k=50)
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        EagleDrafter(head, total_tokens=6, depth=0, top_k=2)
    with pytest.raises(ValueError, match="pass either tree"):
        EagleDrafter(head, Tree.chain(2), total_tokens=6)
    with pytest.raises(ValueError, match="candidate rank 48"):
        EagleDrafter(head, [[48]])


@pytest.mark.parametrize("hidden, layers, message", [
    (48, 2, "the head has hidden_size 32, the target 48"),
    (32, 1, r"fuses target layers \[0, 1, 2\], but the target has 1 layers \(no \[2\]\)"),
])
def test_a_head_for_another_target_is_refused_before_generating(hidden, layers, message):
    head = random_head(EagleConfig.for_target(Transformer.from_hf(tiny_llama(0)).config, 3,
                                              draft_vocab_size=48, target_layers=LAYERS3), 1)
    other = Transformer.from_hf(tiny_llama(6, hidden=hidden, layers=layers))
    with pytest.raises(ValueError, match=message):
        generate(other, [3, 4], drafter=EagleDrafter(head, total_tokens=4, depth=2, top_k=2),
                 max_new_tokens=2)


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 3])
def test_a_checkpoint_round_trips(tmp_path, target, version):
    head = random_head(head_config(target, version), seed=5)
    save_head(tmp_path / "eagle", head, head.config, describe_target(target))
    meta = json.loads((tmp_path / "eagle" / "head_config.json").read_text())
    assert meta["head_type"] == "EagleHead" and meta["config"]["version"] == version
    if version == 3:
        assert meta["config"]["draft_vocab_size"] == 48
        assert meta["config"]["target_hidden_size"] == 32
        assert meta["config"]["target_layers"] == list(LAYERS3)
    loaded = load_head(tmp_path / "eagle", EagleHead, EagleConfig, target=target)
    assert loaded.config == head.config
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    embeds, feature = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    positions = torch.arange(4)
    assert torch.equal(loaded(embeds, feature, positions), head(embeds, feature, positions))


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 48}, r"hidden_size 32 \(checkpoint target\) vs 48 \(this target\)"),
    ({"layers": 1}, r"need layers \[2\], which a 1-layer target does not have"),
])
def test_a_checkpoint_for_another_target_is_refused(tmp_path, target, kwargs, message):
    head = random_head(head_config(target, 3), seed=5)
    info = describe_target(target)
    info.pop("num_layers")  # so that the fused layers alone tell the targets apart
    save_head(tmp_path / "eagle", head, head.config, info)
    other = Transformer.from_hf(tiny_llama(6, **kwargs))
    with pytest.raises(ValueError, match=f"trained for another target.*{message}"):
        load_head(tmp_path / "eagle", EagleHead, EagleConfig, target=other)


def test_head_logits_need_the_targets_lm_head_for_eagle1(target):
    head = EagleHead(head_config(target, 1))
    with pytest.raises(ValueError, match="pass lm_head=target.lm_head"):
        head.logits(torch.randn(2, 32))
    assert math.isclose(float(head.logits(torch.zeros(1, 32), target.lm_head).abs().sum()), 0.0)
