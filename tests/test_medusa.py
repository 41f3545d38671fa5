"""Medusa: heads, loss, drafter (lossless greedy, exact sampling), checkpoints, tree configs."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_drafted_sampling_is_exact,
    fit_medusa_heads,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, Tree, generate
from selfspec.drafters.base import DraftContext, TargetFeatures
from selfspec.drafters.medusa import MedusaDrafter, _ranked
from selfspec.heads import MedusaConfig, MedusaHeads, describe_target, load_head, save_head
from selfspec.losses import medusa_loss
from selfspec.model import Linear

TREE_DIR = Path(__file__).resolve().parents[1] / "conf" / "tree"
PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 5, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24


def tree_choices(name: str) -> list[list[int]]:
    return yaml.safe_load((TREE_DIR / f"{name}.yaml").read_text())["choices"]


def random_heads(config: MedusaConfig, seed: int, std: float = 0.2) -> MedusaHeads:
    """Heads with every weight random (blocks too, so the residual path is exercised)."""
    torch.manual_seed(seed)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, std)
    return heads.eval()


# ---- heads --------------------------------------------------------------------------------


def test_every_head_and_block_has_its_own_storage():
    config = MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3, num_layers=2)
    heads = MedusaHeads(config).init_from_lm_head(torch.randn(24, 16))
    params = [p for _, p in heads.named_parameters(remove_duplicate=False)]
    assert len(params) == 3 * (2 * 2 + 1)  # per head: 2 blocks of (weight, bias) + projection
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(params)
    # Training one head (one block) leaves every other head untouched.
    heads(torch.randn(5, 16))[:, 1].sum().backward()
    for k, head in enumerate(heads.heads):
        assert all(bool(p.grad.abs().sum() > 0) == (k == 1) for p in head.parameters())


def test_a_fresh_head_is_the_lm_head():
    config = MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3, num_layers=2)
    weight = torch.randn(24, 16)
    heads = MedusaHeads(config).init_from_lm_head(weight)
    hidden = torch.randn(2, 5, 16)  # [B, T, H]
    logits = heads(hidden)
    assert logits.shape == (2, 5, 3, 24)  # [B, T, K, V]
    lm_head = Linear(16, 24, bias=False)  # the target's LM head, as selfspec computes it
    lm_head.weight.data = weight
    for k in range(3):
        assert torch.equal(logits[:, :, k], lm_head(hidden))
    assert heads(torch.randn(16)).shape == (3, 24)  # a single state: [K, V]


@pytest.mark.parametrize("shared", [False, True])
def test_the_first_heads_alone_score_as_all_heads_do(shared):
    """A draft k deep runs only heads 0..k-1: the same logits as running every head."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=4,
                                     shared_lm_head=shared))
    for param in heads.parameters():
        param.data.normal_()  # heads that differ from each other
    lm_head = Linear(16, 24, bias=False)
    hidden = torch.randn(16)
    every = heads(hidden, lm_head)
    assert heads(hidden, lm_head, count=2).shape == (2, 24)
    torch.testing.assert_close(heads(hidden, lm_head, count=2), every[:2])


def test_bad_head_arguments_are_clear_errors():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    with pytest.raises(ValueError, match=r"shape \[24, 8\], expected .* \[24, 16\]"):
        heads.init_from_lm_head(torch.randn(24, 8))
    with pytest.raises(ValueError, match="hidden states have size 8, the heads expect 16"):
        heads(torch.randn(3, 8))
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        MedusaConfig(hidden_size=16, vocab_size=24, num_heads=0)


# ---- loss ---------------------------------------------------------------------------------

B, T, K, V = 2, 12, 3, 50


@pytest.fixture
def tokens() -> torch.Tensor:
    """[B, T] distinct tokens per row and no token 0 (the argmax of an all-zero row)."""
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(V - 1, generator=g)[:T] + 1 for _ in range(B)])


def pointed_logits(tokens: torch.Tensor, offset: int = 2) -> torch.Tensor:
    """[B, T, K, V]: head k at t puts (almost) all mass on tokens[t + k + offset]."""
    logits = torch.zeros(B, T, K, V)
    for k in range(K):
        for t in range(T - k - offset):
            logits[torch.arange(B), t, k, tokens[:, t + k + offset]] = 40.0
    return logits


def test_heads_pointing_at_their_targets_have_zero_loss(tokens):
    out = medusa_loss(pointed_logits(tokens), tokens)
    assert out.loss.item() < 1e-6
    for k in range(K):
        assert out.metrics[f"medusa/head{k}_top1"] == 1.0
        assert out.metrics[f"medusa/head{k}_loss"] < 1e-6


@pytest.mark.parametrize("offset", [1, 3])  # one position early (the LM head's job) or late
def test_heads_off_by_one_position_are_never_right(tokens, offset):
    out = medusa_loss(pointed_logits(tokens, offset), tokens)
    assert out.loss.item() > 10
    assert all(out.metrics[f"medusa/head{k}_top1"] == 0.0 for k in range(K))


def test_the_mask_drops_predicted_tokens(tokens):
    logits = pointed_logits(tokens)
    j = 7  # corrupt every head's prediction of token j
    for k in range(K):
        logits[:, j - k - 2, k] = 0.0
        logits[:, j - k - 2, k, 0] = 40.0
    unmasked = medusa_loss(logits, tokens)
    assert all(unmasked.metrics[f"medusa/head{k}_top1"] < 1.0 for k in range(K))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, j] = False
    masked = medusa_loss(logits, tokens, mask)
    assert masked.loss.item() < 1e-6
    assert all(masked.metrics[f"medusa/head{k}_top1"] == 1.0 for k in range(K))


def test_a_head_without_valid_positions_counts_zero_and_keeps_gradients_finite(tokens):
    logits = torch.zeros(B, T, K, V, requires_grad=True)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 2:4] = True  # only head 0 (positions 0, 1) and head 1 (position 0) predict these
    out = medusa_loss(logits, tokens, mask, decay=0.5)
    assert out.loss.item() == pytest.approx(math.log(V) * (1 + 0.5))
    assert out.metrics["medusa/head2_loss"] == 0.0 == out.metrics["medusa/head2_top1"]
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("decay", [1.0, 0.8, 0.5])
def test_head_losses_are_weighted_by_decay(tokens, decay):
    logits = torch.zeros(B, T, K, V)
    logits[:, :, 1, 0] = 3.0  # head 1 is worse than uniform
    out = medusa_loss(logits, tokens, decay=decay)
    per_head = [out.metrics[f"medusa/head{k}_loss"] for k in range(K)]
    assert per_head[0] == pytest.approx(math.log(V)) == per_head[2]
    assert per_head[1] > per_head[0]
    expected = sum(decay**k * loss for k, loss in enumerate(per_head))
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "logits_shape, tokens_shape, mask_shape, message",
    [
        ((B, T, V), (B, T), None, r"head_logits must be \[B, T, K, V\]"),
        ((B, T, K, V), (B, T + 1), None, r"tokens must be integer ids of shape \[B, T\]"),
        ((B, T, K, V), (B, T), (B, T - 1), "loss_mask must have the tokens' shape"),
    ],
)
def test_bad_loss_inputs_are_clear_errors(logits_shape, tokens_shape, mask_shape, message):
    mask = None if mask_shape is None else torch.ones(mask_shape)
    with pytest.raises(ValueError, match=message):
        medusa_loss(torch.zeros(logits_shape), torch.zeros(tokens_shape, dtype=torch.long), mask)


# ---- drafter: what it proposes --------------------------------------------------------------


def test_each_node_gets_its_rank_from_the_head_of_its_depth():
    heads = random_heads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=3), seed=1)
    paths = [[0], [1], [2], [0, 0], [0, 3], [2, 1], [0, 3, 5]]
    drafter = MedusaDrafter(heads, paths)
    hidden = torch.randn(4, 16)  # [A, H]: only the last row (the root's producer) matters
    features = TargetFeatures(torch.arange(4), hidden)
    draft = drafter.propose(DraftContext(torch.arange(5), features))
    order = torch.sort(heads(hidden[-1]), dim=-1, descending=True, stable=True).indices  # [K, V]
    expected = [int(order[len(c) - 1, c[-1]]) for c in drafter.tree.choices]
    assert draft.tokens.tolist() == expected
    assert draft.q is None  # chosen, not sampled: exact under the shared verifier
    assert draft.tree.choices == tuple(sorted(map(tuple, paths), key=lambda p: (len(p), p)))


@pytest.mark.parametrize("levels", [3, 40, 10_000])  # many ties ... almost none
@pytest.mark.parametrize("count", [1, 4, 10, 24])
def test_ranking_takes_the_top_candidates_with_ties_in_token_id_order(levels, count):
    g = torch.Generator().manual_seed(levels + count)
    logits = torch.randint(levels, (4, 24), generator=g).float()  # [heads, V]
    full = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :count]
    assert torch.equal(_ranked(logits, count), full)


def test_no_hidden_state_yet_means_an_empty_draft():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24))
    draft = MedusaDrafter(heads, [[0], [0, 0]]).propose(DraftContext(torch.tensor([3]), None))
    assert draft.tree.num_nodes == 0 and draft.tokens.numel() == 0


def test_bad_drafter_arguments_are_clear_errors():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=24, num_heads=2))
    with pytest.raises(ValueError, match="3 deep but there are only 2 Medusa heads"):
        MedusaDrafter(heads, Tree.chain(3))
    with pytest.raises(ValueError, match="candidate rank 30, but the vocabulary has only 24"):
        MedusaDrafter(heads, [[30]])
    target = Transformer.from_hf(tiny_llama(5, vocab=24, layers=1, hidden=32))
    with pytest.raises(ValueError, match="heads have hidden_size 16, the target 32"):
        generate(target, [3, 4], drafter=MedusaDrafter(heads, [[0]]), max_new_tokens=2)


@pytest.mark.parametrize(
    "name, num_nodes", [("chain4", 4), ("medusa_small", 15), ("medusa_63", 63)]
)
def test_tree_configs_are_valid_medusa_choices(name, num_nodes):
    spec = yaml.safe_load((TREE_DIR / f"{name}.yaml").read_text())
    tree = Tree.from_paths(spec["choices"])
    assert spec["name"] == name
    assert tree.num_nodes == len(spec["choices"]) == num_nodes  # no duplicates
    assert tree.max_depth <= 4
    assert tree.is_chain == (name == "chain4")


# ---- drafter: lossless greedy ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted_heads(target, plain_greedy):
    """Heads fit for 30 AdamW steps to the target's own greedy continuations of PROMPTS."""
    heads, metrics = fit_medusa_heads(target, plain_greedy)
    assert metrics["medusa/head3_top1"] > 0.5
    return heads


def greedy_with_medusa(target, heads, choices, plain_greedy) -> list[float]:
    """Assert Medusa greedy decoding equals plain greedy on every prompt; returns each tau."""
    taus = []
    for prompt, expected in plain_greedy.items():
        drafter = MedusaDrafter(heads, choices)
        result = generate(target, list(prompt), drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected
        taus.append(result.stats.tau)
    return taus


@pytest.mark.parametrize("tree", ["chain4", "medusa_small", "medusa_63"])
def test_greedy_is_lossless_with_random_heads(target, plain_greedy, tree):
    heads = random_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4), seed=2)
    greedy_with_medusa(target, heads, tree_choices(tree), plain_greedy)


@pytest.mark.parametrize("tree", ["chain4", "medusa_small"])
def test_greedy_is_lossless_and_accepted_with_fitted_heads(
    target, plain_greedy, fitted_heads, tree
):
    taus = greedy_with_medusa(target, fitted_heads, tree_choices(tree), plain_greedy)
    assert all(tau > 1.0 for tau in taus), taus
    assert sum(taus) / len(taus) > 2.0, taus


# ---- heads sharing the target's LM head -----------------------------------------------------


def test_shared_lm_head_heads_score_like_own_heads_holding_a_copy_of_it(target):
    own = random_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2), 7)
    own.init_from_lm_head(target.lm_head.weight.detach())
    shared = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2,
                                      shared_lm_head=True))
    state = {k: v for k, v in own.state_dict().items() if "lm_head" not in k}
    assert set(state) == set(shared.state_dict())  # no projection weights of their own
    shared.load_state_dict(state)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(shared(hidden, target.lm_head), own(hidden), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="share the target's LM head: pass lm_head"):
        shared(hidden)


@pytest.mark.parametrize("tree", ["chain4", "medusa_small"])
def test_greedy_is_lossless_with_shared_lm_head_heads(target, plain_greedy, tree):
    config = MedusaConfig(hidden_size=32, vocab_size=64, num_heads=4, shared_lm_head=True)
    greedy_with_medusa(target, random_heads(config, seed=3), tree_choices(tree), plain_greedy)


def test_shared_lm_head_heads_train_their_blocks_and_leave_the_target_frozen(target):
    from selfspec.objectives import MedusaObjective

    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2,
                                     shared_lm_head=True))
    objective = MedusaObjective(target, heads)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    objective(tokens, torch.ones_like(tokens)).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())
    assert target.lm_head.weight.grad is None and not target.lm_head.weight.requires_grad


def test_a_shared_lm_head_with_a_draft_vocabulary_is_refused():
    with pytest.raises(ValueError, match="shared LM head is the target's.*draft_vocab_size"):
        MedusaConfig(hidden_size=8, vocab_size=16, draft_vocab_size=4, shared_lm_head=True)


# ---- drafter: exact sampling ----------------------------------------------------------------

SMALL_VOCAB = 8
N_SAMPLES = 1000  # ~5 s per sampling mode on one core
SAMPLING_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)])
def test_sampling_through_medusa_follows_the_target_law(params):
    target = Transformer.from_hf(tiny_llama(3, vocab=SMALL_VOCAB, layers=1, hidden=16, std=0.5))
    heads = random_heads(MedusaConfig(hidden_size=16, vocab_size=SMALL_VOCAB, num_heads=2), 4)
    drafter = MedusaDrafter(heads, SAMPLING_TREE)
    assert_drafted_sampling_is_exact(target, drafter, params, N_SAMPLES)


# ---- checkpoints ----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, target):
    heads = random_heads(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, num_layers=2), 5)
    save_head(tmp_path / "medusa", heads, heads.config, describe_target(target))
    return tmp_path / "medusa", heads


def test_a_checkpoint_round_trips(saved, target):
    folder, heads = saved
    meta = json.loads((folder / "head_config.json").read_text())
    assert meta["head_type"] == "MedusaHeads"
    assert meta["config"] == {"hidden_size": 32, "vocab_size": 64, "num_heads": 3, "num_layers": 2,
                              "draft_vocab_size": None, "shared_lm_head": False}
    assert meta["target"]["hidden_size"] == 32 and meta["target"]["num_layers"] == 2
    loaded = load_head(folder, MedusaHeads, MedusaConfig, target=target)
    assert loaded.config == heads.config
    assert loaded.state_dict().keys() == heads.state_dict().keys()
    for name, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(3, 32)
    assert torch.equal(loaded(hidden), heads(hidden))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden": 48}, r"hidden_size 32 \(checkpoint target\) vs 48 \(this target\)"),
        ({"vocab": 80}, r"vocab_size 64 \(checkpoint target\) vs 80 \(this target\)"),
    ],
)
def test_a_checkpoint_for_another_target_is_refused(saved, kwargs, message):
    other = Transformer.from_hf(tiny_llama(6, layers=2, **kwargs))
    with pytest.raises(ValueError, match=f"trained for another target.*{message}.*Load the head"):
        load_head(saved[0], MedusaHeads, MedusaConfig, target=other)


def test_missing_checkpoint_files_are_clear_errors(saved, tmp_path, target):
    with pytest.raises(FileNotFoundError, match="head checkpoint folder not found"):
        load_head(tmp_path / "nowhere", MedusaHeads, MedusaConfig, target=target)
    (saved[0] / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_head(saved[0], MedusaHeads, MedusaConfig, target=target)


def test_a_checkpoint_of_another_head_type_is_refused(saved, target):
    class OtherHeads(MedusaHeads):
        pass

    with pytest.raises(ValueError, match="holds a 'MedusaHeads' head, not 'OtherHeads'"):
        load_head(saved[0], OtherHeads, MedusaConfig, target=target)
