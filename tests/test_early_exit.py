"""Early-exit self-speculation: exit heads (norm, adapter), the exit loss and objective, the
drafter (lossless greedy, exact sampling, the confidence stop), verification that starts at
layer E (layer calls, logits, cache), checkpoints and errors before any generation."""

import json
from collections import Counter, defaultdict

import pytest
import torch
from helpers import (
    P_VALUE_FLOOR,
    assert_drafted_sampling_is_exact,
    exact_two_token_law,
    first_layers,
    fit_pvalue,
    tiny_llama,
)

from selfspec import SamplingParams, Transformer, generate
from selfspec.decode import _resume_after_early_layers
from selfspec.drafters import DecodeSetup, DraftContext, EarlyExitDrafter, SmallModelDrafter
from selfspec.heads import ExitConfig, ExitHead, describe_target, load_head, save_head
from selfspec.kv_cache import KVCache
from selfspec.losses import exit_loss
from selfspec.objectives import EarlyExitObjective
from selfspec.tree import Tree

LAYERS = 4
PROMPTS = [
    torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (1, 6, 17)
] + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> Transformer:
    """A 4-layer toy target, so that E can be 1, 2 or 3."""
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


def random_exit(target: Transformer, exit_layer: int, kind: str, seed: int = 1,
                std: float = 0.2) -> ExitHead:
    """An exit with every weight random (norms around 1); the norm exit has none."""
    torch.manual_seed(seed)
    head = ExitHead(ExitConfig.for_target(target.config, exit_layer, kind))
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    return head.eval()


def fit_exits(target: Transformer, continuations: dict, layers=(1, 2, 3), steps: int = 40):
    """Adapter exits at `layers` fit together (AdamW, full batch) to the target's own greedy
    continuations; returns ({E: head in eval mode}, the last step's metrics)."""
    rows = [list(prompt) + tokens for prompt, tokens in continuations.items()]
    length = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])  # [B, T]
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows]).bool()
    torch.manual_seed(0)
    heads = [ExitHead(ExitConfig.for_target(target.config, e)).init_from_target(target)
             for e in layers]
    objective = EarlyExitObjective(target, heads)
    optimizer = torch.optim.AdamW(objective.heads.parameters(), lr=1e-2)
    for _ in range(steps):
        out = objective(tokens, mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return {head.exit_layer: head.eval() for head in heads}, out.metrics


@pytest.fixture(scope="module")
def fitted_exits(target, plain_greedy):
    return fit_exits(target, plain_greedy)


# ---- heads, loss, objective -------------------------------------------------------------------


def test_the_norm_exit_is_the_targets_own_early_exit(target):
    head = ExitHead(ExitConfig.for_target(target.config, 2, "norm"))
    assert dict(head.named_parameters()) == {}
    tokens, positions = torch.tensor([[3, 9, 4, 7]]), torch.arange(4)
    with torch.no_grad():
        early = target(tokens, positions, exit_layer=2, return_hidden=(2,))
        logits = head.logits(early.hidden[0], positions, target)
    torch.testing.assert_close(logits, early.logits)


def test_an_adapter_starts_as_the_norm_exit_and_has_no_mlp(target):
    head = ExitHead(ExitConfig.for_target(target.config, 2)).init_from_target(target)
    names = {name.split(".")[0] for name, _ in head.named_parameters()}
    assert names == {"input_layernorm", "self_attn", "norm"}
    hidden = torch.randn(1, 5, 32)
    norm = ExitHead(ExitConfig.for_target(target.config, 2, "norm"))
    with torch.no_grad():
        torch.testing.assert_close(head.logits(hidden, torch.arange(5), target),
                                   norm.logits(hidden, torch.arange(5), target))


def test_exit_loss_is_the_kl_to_the_target_where_the_mask_says():
    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 7)
    same = exit_loss(teacher.clone(), teacher)
    assert abs(same.metrics["kl"]) < 1e-5 and same.metrics["top1"] == 1.0
    student = torch.randn(2, 5, 7)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # row 1 never counts
    masked = exit_loss(student, teacher, loss_mask=mask)
    alone = exit_loss(student[:1], teacher[:1])
    torch.testing.assert_close(masked.loss, alone.loss)
    tokens = torch.randint(0, 7, (2, 5))
    both = exit_loss(student, teacher, tokens, mask, hard_weight=0.5)
    hard = torch.nn.functional.cross_entropy(student[0, :-1], tokens[0, 1:])
    torch.testing.assert_close(both.loss, alone.loss + 0.5 * hard)
    with pytest.raises(ValueError, match="hard_weight > 0 needs the tokens"):
        exit_loss(student, teacher, hard_weight=1.0)


def test_one_run_trains_several_exits_towards_the_target(target, plain_greedy, fitted_exits):
    heads, metrics = fitted_exits
    assert set(heads) == {1, 2, 3}
    assert {f"exit/E{e}_kl" for e in heads} <= set(metrics)
    _, before = fit_exits(target, plain_greedy, steps=1)
    for e in heads:
        assert metrics[f"exit/E{e}_kl"] < before[f"exit/E{e}_kl"]


# ---- drafting: lossless greedy ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["norm", "adapter"])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("k, threshold", [(1, None), (3, None), (5, None), (5, 0.6)])
def test_greedy_is_lossless_with_random_exits(target, plain_greedy, kind, exit_layer, k,
                                              threshold):
    drafter = EarlyExitDrafter(random_exit(target, exit_layer, kind), k, threshold)
    for prompt in PROMPTS:
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
        assert out.tokens == plain_greedy[tuple(prompt)]


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("k, threshold", [(4, None), (6, 0.6)])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static_steps"])
def test_greedy_is_lossless_and_accepted_with_trained_exits(
    target, plain_greedy, fitted_exits, exit_layer, k, threshold, static
):
    """static: the target's other forwards run as static steps (CUDA graphs on CUDA) in the
    cache the exit's drafts write into."""
    drafter = EarlyExitDrafter(fitted_exits[0][exit_layer], k, threshold)
    accepted, drafted = 0, 0
    for prompt in PROMPTS:
        out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS,
                       cuda_graphs=static)
        assert out.tokens == plain_greedy[tuple(prompt)]
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert 0 < accepted < drafted  # both outcomes happened


def test_the_confidence_stop_shortens_drafts(target, fitted_exits):
    head = fitted_exits[0][2]
    sizes = {}
    for threshold in (None, 0.6, 0.999):
        out = generate(target, PROMPTS[2], drafter=EarlyExitDrafter(head, 6, threshold),
                       max_new_tokens=NEW_TOKENS)
        sizes[threshold] = out.stats.drafted / out.stats.steps
    assert sizes[None] == 6 and sizes[0.999] == 1  # stops after the first unsure token
    assert 1 <= sizes[0.6] <= 6


def test_the_target_cache_equals_a_fresh_forward_after_rejections(target, fitted_exits):
    drafter = EarlyExitDrafter(fitted_exits[0][2], 5)
    prompt = PROMPTS[3]
    out = generate(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert 0 < out.stats.accepted < out.stats.drafted
    cache, history = drafter._cache, prompt + out.tokens
    fresh = target.new_cache(max_slots=cache.length)
    with torch.no_grad():
        target(torch.tensor([history[: cache.length]]), torch.arange(cache.length), fresh)
    slots = slice(0, cache.length)
    torch.testing.assert_close(cache.k[:, :, :, slots], fresh.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :, slots], fresh.v, atol=1e-5, rtol=1e-4)
    # The adapter's own cache holds the committed context too (then the last draft's rows).
    own, committed = drafter._own_cache, drafter._committed
    assert own.length == committed + drafter._drafted and 0 < committed <= cache.length
    again = KVCache(1, 1, own.k.shape[2], committed, own.k.shape[4])
    with torch.no_grad():
        hidden = target(torch.tensor([history[:committed]]), torch.arange(committed),
                        return_hidden=(2,)).hidden[0]
        drafter.head(hidden, torch.arange(committed), again, target_norm=target.norm)
    torch.testing.assert_close(own.k[:, :, :, :committed], again.k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(own.v[:, :, :, :committed], again.v, atol=1e-5, rtol=1e-4)


# ---- verification starts at layer E -----------------------------------------------------------


def count_layer_calls(target: Transformer) -> tuple[dict, list]:
    """{layer: [tokens per call]} filled by hooks on every layer; returns it and the hooks."""
    calls, hooks = defaultdict(list), []
    for i, layer in enumerate(target.layers):
        hooks.append(layer.register_forward_hook(
            lambda module, args, out, i=i: calls[i].append(args[0].shape[1])))
    return calls, hooks


@pytest.mark.parametrize("exit_layer, k", [(1, 4), (2, 3), (3, 1)])
def test_verification_runs_layers_e_to_l_over_the_draft_and_early_layers_once(
    target, exit_layer, k
):
    drafter = EarlyExitDrafter(random_exit(target, exit_layer, "norm"), k)
    prompt = PROMPTS[2]
    cache = target.new_cache(max_slots=64)
    with torch.no_grad():
        prefill = target(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1), cache)
    drafter.begin(DecodeSetup(target, torch.tensor(prompt), SamplingParams(), None, 64, cache))
    calls, hooks = count_layer_calls(target)
    try:
        draft = drafter.propose(DraftContext(torch.tensor(prompt), None))
        assert {i: calls[i] for i in range(LAYERS)} == {
            i: [1] * k if i < exit_layer else [] for i in range(LAYERS)}  # drafting
        assert cache.length == len(prompt) - 1 and draft.early.hidden.shape == (k, 32)
        calls.clear()
        rows = torch.tensor([[prompt[-1], *draft.tokens.tolist()]])  # [1, k+1]
        positions = len(prompt) - 1 + torch.arange(k + 1)
        with torch.no_grad():
            out = _resume_after_early_layers(target, rows, positions, cache,
                                             Tree.chain(k).mask_with_root, (), draft.early)
    finally:
        for hook in hooks:
            hook.remove()
    # layers [0, E) for the one token not drafted through them, [E, L) over all k + 1 rows
    assert {i: calls[i] for i in range(LAYERS)} == {
        i: [1] if i < exit_layer else [k + 1] for i in range(LAYERS)}
    full = target(torch.tensor([prompt + draft.tokens.tolist()]), torch.arange(len(prompt) + k))
    torch.testing.assert_close(out.logits[0], full.logits[0, -(k + 1):], atol=1e-5, rtol=0)
    assert prefill.logits.shape[1] == len(prompt) - 1


# ---- drafting: exact sampling -----------------------------------------------------------------

N_SAMPLES = 1000
T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)


@pytest.mark.parametrize("params", [T1, TOP_P], ids=["t1", "top_p"])
@pytest.mark.parametrize("kind, threshold", [("norm", None), ("adapter", None),
                                             ("adapter", 0.5)])
def test_sampling_through_an_early_exit_follows_the_target_law(params, kind, threshold):
    target = Transformer.from_hf(tiny_llama(3, vocab=8, layers=2, hidden=16, std=0.5))
    drafter = EarlyExitDrafter(random_exit(target, 1, kind, seed=4, std=0.1), 2, threshold)
    assert_drafted_sampling_is_exact(target, drafter, params, N_SAMPLES)


# ---- the confidence stop on a small draft model -----------------------------------------------


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


# ---- errors before any generation, checkpoints ------------------------------------------------


@pytest.mark.parametrize("exit_layer", [0, LAYERS, -1, 2.5])
def test_an_exit_layer_outside_1_to_l_is_refused(target, exit_layer):
    with pytest.raises(ValueError, match=r"exit layer E must be an integer in \[1, 4\)"):
        ExitConfig.for_target(target.config, exit_layer)


@pytest.mark.parametrize("threshold", [0, 1, 1.5, -0.2, "high"])
def test_a_confidence_threshold_outside_0_1_is_refused(target, threshold):
    head = random_exit(target, 2, "norm")
    with pytest.raises(ValueError, match=r"confidence_threshold must lie in \(0, 1\)"):
        EarlyExitDrafter(head, 3, threshold)
    with pytest.raises(ValueError, match=r"confidence_threshold must lie in \(0, 1\)"):
        SmallModelDrafter(target, 3, confidence_threshold=threshold)


@pytest.mark.parametrize("hidden, layers, message", [
    (48, LAYERS, "the exit head has hidden_size 32, the target 48"),
    (32, 2, r"E must be an integer in \[1, 2\).*got 3 for this 2-layer target"),
])
def test_an_exit_for_another_target_is_refused_before_generating(target, hidden, layers,
                                                                  message):
    drafter = EarlyExitDrafter(random_exit(target, 3, "adapter"), 3)
    other = Transformer.from_hf(tiny_llama(6, hidden=hidden, layers=layers))
    with pytest.raises(ValueError, match=message):
        generate(other, [3, 4], drafter=drafter, max_new_tokens=2)


@pytest.mark.parametrize("kind", ["norm", "adapter"])
def test_a_checkpoint_round_trips(tmp_path, target, kind):
    head = random_exit(target, 2, kind)
    save_head(tmp_path / "exit", head, head.config, describe_target(target))
    meta = json.loads((tmp_path / "exit" / "head_config.json").read_text())
    assert meta["head_type"] == "ExitHead" and meta["config"]["exit_layer"] == 2
    loaded = load_head(tmp_path / "exit", ExitHead, ExitConfig, target=target)
    assert loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(1, 3, 32)
    with torch.no_grad():
        assert torch.equal(loaded.logits(hidden, torch.arange(3), target),
                           head.logits(hidden, torch.arange(3), target))


def test_a_checkpoint_for_another_target_or_another_e_is_refused(tmp_path, target):
    from selfspec.from_config import load_early_exit

    head = random_exit(target, 2, "adapter")
    save_head(tmp_path / "exit", head, head.config, describe_target(target))
    other = Transformer.from_hf(tiny_llama(6, layers=2))
    with pytest.raises(ValueError, match=r"trained for another target.*num_layers 4"):
        load_head(tmp_path / "exit", ExitHead, ExitConfig, target=other)
    assert load_early_exit(tmp_path / "exit", target, exit_layer=2).exit_layer == 2
    with pytest.raises(ValueError, match=r"exits at layer E=2, not E=3"):
        load_early_exit(tmp_path / "exit", target, exit_layer=3)
