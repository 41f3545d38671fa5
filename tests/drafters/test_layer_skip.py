"""Layer-skip drafting: the draft's use of the target's cache (written, rolled back, overwritten
by verification), lossless greedy decoding over draft lengths and skip sets (fixed and
adaptive, eager and static steps, a random target and the shipped tiny one), the exact
two-token law when sampling, planted bugs those checks catch, the adaptive search on made-up
acceptance, and the registry entry."""

from collections import Counter
from importlib import resources

import pytest
import torch
from helpers import assert_drafted_sampling_is_exact, law_samples, tiny_llama
from hydra import compose, initialize_config_dir

from selfspec import SamplingParams, Transformer, generate
from selfspec.drafters import DecodeSetup, DraftContext
from selfspec.drafters.layer_skip import LayerSkipDrafter, SkipSearch
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import drafter_and_target, drafter_choice
from selfspec.from_config.sweeps import plan_sweep

LAYERS = 4
PROMPTS = [[3], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
           torch.randint(2, 64, (13,), generator=torch.Generator().manual_seed(13)).tolist()]
NEW_TOKENS = 24
SKIP_SETS = [(), (1,), (2,), (1, 2), (0, 3), (0, 1, 2, 3)]
T1, TOP_P = SamplingParams(1.0), SamplingParams(0.8, top_p=0.9)


@pytest.fixture(scope="module")
def target() -> Transformer:
    """A 4-layer random target: layers 1 and 2 are its middle."""
    return Transformer.from_hf(tiny_llama(0, layers=LAYERS))


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    """The shipped tiny target (8 layers)."""
    return Transformer.from_pretrained(resources.files("selfspec") / "assets/tiny/target")


def greedy_mismatches(model: Transformer, drafter, prompts, plain: dict, **options) -> list:
    """The prompts whose greedy continuation through the drafter differs from plain decoding's
    (plain: {prompt tuple: tokens}); also checks that some drafts were accepted."""
    wrong, accepted = [], 0
    for prompt in prompts:
        out = generate(model, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, **options)
        wrong += [prompt] if out.tokens != plain[tuple(prompt)] else []
        accepted += out.stats.accepted
    assert accepted > 0
    return wrong


def plain_greedy_of(model: Transformer, prompts) -> dict:
    return {tuple(p): generate(model, p, max_new_tokens=NEW_TOKENS).tokens for p in prompts}


@pytest.fixture(scope="module")
def plain(target) -> dict:
    return plain_greedy_of(target, PROMPTS)


# ---- the cache -----------------------------------------------------------------------------


def test_the_draft_writes_its_running_layers_then_verification_overwrites_every_layer(target):
    prompt, k, skip = PROMPTS[1], 3, (1, 2)
    cache = target.new_cache(max_slots=32)
    with torch.inference_mode():
        target(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1), cache)
    base, before = cache.length, (cache.k.clone(), cache.v.clone())
    drafter = LayerSkipDrafter(skip, k)
    drafter.begin(DecodeSetup(target, torch.tensor(prompt), SamplingParams(), None, 32, cache))
    draft = drafter.propose(DraftContext(torch.tensor(prompt), None))
    assert cache.length == base  # the length is set back
    rows = torch.tensor([[prompt[-1], *draft.tokens[:-1].tolist()]])  # what the draft fed
    reference = target.new_cache(max_slots=32)
    with torch.inference_mode():
        reference.k.copy_(before[0]), reference.v.copy_(before[1])
        reference.length = base
        for i in range(k):  # one token at a time, as drafting runs (the same products)
            target(rows[:, i:i + 1], base + torch.arange(i, i + 1), reference, skip_layers=skip)
    assert torch.equal(cache.k, reference.k) and torch.equal(cache.v, reference.v)
    for layer in skip:  # skipped layers: nothing written at the drafted slots
        assert torch.equal(cache.k[layer], before[0][layer])
    full = target.new_cache(max_slots=32)  # verification over [root, draft] on a clean cache
    verify_rows = torch.cat([torch.tensor([prompt[-1]]), draft.tokens])[None]
    with torch.inference_mode():
        target(torch.tensor([prompt[:-1]]), torch.arange(base), full)
        target(verify_rows, base + torch.arange(k + 1), full)
        target(verify_rows, base + torch.arange(k + 1), cache)
    end = base + k + 1
    assert torch.equal(cache.k[:, :, :, :end], full.k[:, :, :, :end])
    assert torch.equal(cache.v[:, :, :, :end], full.v[:, :, :, :end])


# ---- lossless at greedy ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, *(pytest.param(k, marks=pytest.mark.slow)
                                          for k in (2, 3, 5, 6))])
def test_lossless_at_greedy_over_lengths_and_skip_sets(target, plain, k):
    for skip in SKIP_SETS:
        assert greedy_mismatches(target, LayerSkipDrafter(skip, k), PROMPTS, plain) == [], skip
    adaptive = LayerSkipDrafter((1,), k, adaptive=True, window=1)
    assert greedy_mismatches(target, adaptive, PROMPTS, plain) == []


@pytest.mark.parametrize("adaptive", [False, True])
def test_lossless_in_static_steps(target, plain, adaptive):
    """cuda_graphs=True on the CPU: the static step over the persistent cache, eagerly."""
    drafter = LayerSkipDrafter((2,), 3, adaptive=adaptive, window=1)
    assert greedy_mismatches(target, drafter, PROMPTS, plain, cuda_graphs=True) == []


@pytest.mark.slow
def test_lossless_on_the_shipped_tiny_target(tiny):
    prompts = [[0, 412, 95, 1021, 33, 7], [0, 88, 88, 301, 12, 2048, 5, 88, 301]]
    plain = plain_greedy_of(tiny, prompts)
    for k in range(1, 7):
        for skip in [(2, 4, 6), (1, 2, 3)]:
            assert greedy_mismatches(tiny, LayerSkipDrafter(skip, k), prompts, plain) == []
        adaptive = LayerSkipDrafter(None, k, adaptive=True, window=2)
        assert greedy_mismatches(tiny, adaptive, prompts, plain) == []


class NoRollback(LayerSkipDrafter):
    """Planted bug: the draft's K/V stay inside the cache's length. It declares room for what
    it leaks (a larger max_nodes sizes the cache), so only the token check can catch it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_nodes = self.num_draft_tokens * (NEW_TOKENS + 1)

    def _roll_back(self, base: int) -> None:
        pass


def test_a_draft_left_in_the_cache_is_caught(target, plain):
    assert greedy_mismatches(target, LayerSkipDrafter((1,), 3), PROMPTS, plain) == []
    assert greedy_mismatches(target, NoRollback((1,), 3), PROMPTS, plain) != []


# ---- the law when sampling -------------------------------------------------------------------


@pytest.mark.parametrize("params", [T1, pytest.param(TOP_P, marks=pytest.mark.slow)],
                         ids=["t1", "top_p"])
def test_sampled_drafts_keep_the_targets_two_token_law(target, params, request):
    assert_drafted_sampling_is_exact(target, LayerSkipDrafter((1,), 2), params,
                                     law_samples(request))


class ArgmaxWithQ(LayerSkipDrafter):
    """Planted bug: drafts the argmax whatever the sampling, yet reports the laws as q (as
    if the tokens had been drawn from them)."""

    def _draw(self, probs: torch.Tensor) -> int:
        return int(probs.argmax())


def test_a_q_the_tokens_were_not_drawn_from_is_caught(target):
    # The correct drafter passes this very test (above); the planted one's p-value is ~1e-74.
    with pytest.raises(AssertionError) as info:
        assert_drafted_sampling_is_exact(target, ArgmaxWithQ((1,), 2), TOP_P, samples=300)
    assert not str(info.value).isdigit()  # the chi-square failed, not the drafts-in-play count


# ---- the adaptive search -------------------------------------------------------------------


def run_search(search: SkipSearch, accepted_of, steps: int) -> list[frozenset[int]]:
    """Feed the search `steps` made-up accepted counts (accepted_of(active set)); the active
    set at each step."""
    active = []
    for _ in range(steps):
        active.append(search.active)
        search.record(accepted_of(search.active))
    return active


def test_the_search_moves_to_a_set_that_accepts_more():
    # 8 layers; skipping layer 6 is what drafts well: 3 accepted instead of 1.
    def accepted_of(skip: frozenset[int]) -> int:
        return 3 if 6 in skip else 1

    search = SkipSearch(frozenset({1, 2}), num_layers=8, num_draft_tokens=4, window=2, seed=0)
    active = run_search(search, accepted_of, 80)
    assert 6 in search.current and len(search.current) == 2
    assert search.adopted and all(6 in s for s in search.adopted)  # never a worse set
    assert active[:2] == [frozenset({1, 2})] * 2  # the first window measures the start set
    assert all(s <= set(range(1, 7)) for s in active)  # never the first or last layer
    again = SkipSearch(frozenset({1, 2}), num_layers=8, num_draft_tokens=4, window=2, seed=0)
    assert run_search(again, accepted_of, 80) == active  # deterministic given the seed


def test_the_search_keeps_its_set_when_no_neighbour_is_better():
    search = SkipSearch(frozenset({2, 4}), num_layers=8, num_draft_tokens=4, window=3, seed=1)
    active = run_search(search, lambda skip: 2 if skip == {2, 4} else 1, 60)
    assert search.current == {2, 4} and search.adopted == []
    assert len(set(active)) > 2  # neighbours were tried
    flat = SkipSearch(frozenset({2, 4}), num_layers=8, num_draft_tokens=4, window=3, seed=1)
    run_search(flat, lambda skip: 1, 60)
    assert flat.current == {2, 4}  # a tie keeps the current set


def test_the_drafter_hands_each_steps_accepted_count_to_the_search(target):
    recorded = []

    class Recording(LayerSkipDrafter):
        def begin(self, setup: DecodeSetup) -> None:
            super().begin(setup)
            record = self.search.record
            self.search.record = lambda n: (recorded.append(n), record(n))

    out = generate(target, PROMPTS[1], drafter=Recording((1,), 3, adaptive=True, window=1),
                   max_new_tokens=NEW_TOKENS)
    histogram = Counter(dict(enumerate(out.stats.accept_histogram)))
    assert len(recorded) == out.stats.steps - 1  # every step but the last
    assert sum((histogram - Counter(recorded)).values()) == 1


def test_bad_settings_are_refused(target):
    for kwargs, message in [({"num_draft_tokens": 0}, "num_draft_tokens"),
                            ({"window": 0}, "window"), ({"adaptive": 1}, "adaptive")]:
        with pytest.raises(ValueError, match=message):
            LayerSkipDrafter((1,), **kwargs)
    setup = DecodeSetup(target, torch.tensor([3]), SamplingParams(), None, 16,
                        target.new_cache(max_slots=16))
    with pytest.raises(ValueError, match=r"layer ids in 1..2 \(the middle layers"):
        LayerSkipDrafter((0,), adaptive=True).begin(setup)
    with pytest.raises(ValueError, match=r"layer ids in 0..3"):
        LayerSkipDrafter((4,)).begin(setup)
    with pytest.raises(ValueError, match="target's own KV cache"):
        LayerSkipDrafter((1,)).begin(DecodeSetup(target, torch.tensor([3]), SamplingParams(),
                                                 None, 16))


# ---- the registry entry --------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_cfg():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda config, *overrides: compose(config, overrides=list(overrides))


def sweep_labels(cfg) -> list[str]:
    return [line.variant.label() for line in plan_sweep(cfg, 1).grid.lines]


def test_variants_and_labels_from_the_config(compose_cfg):
    cfg = compose_cfg("sweep", "methods=[layer_skip]")
    assert sweep_labels(cfg) == ["layer_skip/skip{2,4,6}"]  # null: every other middle layer
    cfg = compose_cfg("sweep", "methods=[layer_skip]", "layer_skip.skip_layers=[[1,2,3,5],null]",
                      "layer_skip.adaptive=[false,true]")
    assert sweep_labels(cfg) == ["layer_skip/skip{1-3,5}", "layer_skip/adaptive{4}/from{1-3,5}",
                                 "layer_skip/skip{2,4,6}", "layer_skip/adaptive{3}"]
    cfg = compose_cfg("sweep", "methods=[layer_skip]", "layer_skip.skip_layers=[3,4]")
    assert sweep_labels(cfg) == ["layer_skip/skip{3,4}"]  # a flat list is one set
    method, variant, k = drafter_choice(compose_cfg("generate", "drafter=layer_skip"))
    assert (method.name, variant.skip_layers, variant.adaptive, k) == (
        "layer_skip", (2, 4, 6), False, 4)  # for_sweep=False: exactly one


def test_the_registry_builds_a_lossless_drafter(compose_cfg, tiny):
    cfg = compose_cfg("generate", "drafter=layer_skip", "num_draft_tokens=3",
                      "layer_skip.skip_layers=[4]", "layer_skip.adaptive=true")
    drafter, verified_on = drafter_and_target(cfg, tiny)
    assert verified_on is tiny
    assert (drafter.start, drafter.adaptive, drafter.num_draft_tokens) == ((4,), True, 3)
    prompt = [0, 88, 88, 301, 12]
    assert greedy_mismatches(tiny, drafter, [prompt], plain_greedy_of(tiny, [prompt])) == []


@pytest.mark.parametrize("overrides, message", [
    (["layer_skip.skip_layers=[[2,8]]"],
     r"layer_skip.skip_layers: give distinct layer ids in 0..7 \(the layers of the 8-layer "
     r"target\), got \[2, 8\]"),
    (["layer_skip.skip_layers=[[0,3]]", "layer_skip.adaptive=true"],
     r"layer_skip.skip_layers: give distinct layer ids in 1..6 \(the middle layers"),
    (["layer_skip.skip_layers=[[2,2]]"], "layer_skip.skip_layers: give distinct"),
    (["layer_skip.skip_layers=[two]"], "layer_skip.skip_layers: give null"),
    (["layer_skip.adaptive=[maybe]"], "layer_skip.adaptive: give true or false"),
    (["layer_skip.window=0"], "layer_skip.window must be an integer >= 1"),
])
def test_bad_settings_are_refused_before_loading(compose_cfg, overrides, message):
    for config, method in (("sweep", "methods=[layer_skip]"), ("generate", "drafter=layer_skip")):
        cfg = compose_cfg(config, method, *overrides)
        with pytest.raises(ValueError, match=message) as info:
            if config == "sweep":
                plan_sweep(cfg, 1)
            else:
                drafter_choice(cfg)
        assert "\n" not in str(info.value)
