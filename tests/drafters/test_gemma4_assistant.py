"""Gemma 4's assistant: its forward against transformers' `Gemma4AssistantForCausalLM` (the same
backbone states in, the same logits out), its folders, and its drafts: lossless at greedy,
exact in law at T = 1 (a misstated draft law caught), refused for a target of another shape."""

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from gemma4_models import gemma4_assistant, gemma4_model
from helpers import (
    P_VALUE_FLOOR,
    adam_fit,
    assert_drafted_sampling_is_exact,
    continuation_rows,
    law_samples,
    sampled_pvalue,
)

from selfspec import SamplingParams, generate
from selfspec.drafters.base import DecodeSetup, DraftContext, TargetFeatures
from selfspec.drafters.gemma4_assistant import (
    Gemma4AssistantDrafter,
    shared_kv,
    shared_layers,
)
from selfspec.heads.base import LossOutput
from selfspec.heads.gemma4_assistant import Gemma4Assistant, teacher_forced_masks
from selfspec.model import Transformer
from selfspec.sampling import logits_to_probs
from selfspec.tree import Tree

T1 = SamplingParams(temperature=1.0)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [40, 41, 42, 3, 9, 12, 30]]
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
SHAPES = {"chain": {"num_draft_tokens": 3}, "tree": {"tree": TREE}}


def read_back(hf_assistant, folder) -> Gemma4Assistant:
    hf_assistant.save_pretrained(folder)
    return Gemma4Assistant.from_pretrained(folder)


def hf_backbone(hf_target, tokens: torch.Tensor):
    """What transformers' assistant reads of its target after a forward over tokens [1, n]:
    the K/V its last layer of each kind stores, and the normed last hidden state."""
    out = hf_target(input_ids=tokens, output_hidden_states=True, return_shared_kv_states=True)
    return out.shared_kv_states, out.hidden_states[-1][:, -1:]


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "centroids"])
@torch.no_grad()
def test_the_assistant_gives_transformers_logits_from_the_same_backbone_states(tmp_path,
                                                                               ordered):
    """Read from the folder transformers wrote; keys beyond the sliding window; with ordered
    embeddings only the chosen clusters' tokens are scored, the rest one below the lowest."""
    hf_target, hf = gemma4_model(), gemma4_assistant(ordered=ordered)
    ours = read_back(hf, tmp_path)
    tokens = torch.randint(64, (1, 11), generator=torch.Generator().manual_seed(1))
    shared, hidden = hf_backbone(hf_target, tokens[:, :-1])
    embeds = hf_target.model.embed_tokens(tokens[:, -1:])
    theirs = hf(inputs_embeds=torch.cat([embeds, hidden], -1), position_ids=torch.tensor([[10]]),
                shared_kv_states=shared, attention_mask=torch.ones(1, 10, dtype=torch.long))
    got = ours(embeds, hidden, torch.tensor([10]),
               {"full": shared["full_attention"], "sliding": shared["sliding_attention"]})
    assert theirs.logits.abs().max() > 1.0
    assert (got.logits - theirs.logits).abs().max() < 1e-4
    assert (got.hidden - theirs.last_hidden_state).abs().max() < 1e-4
    if ordered:  # 3 of 8 clusters of 8 tokens scored
        assert (got.logits > got.logits.min()).sum() == 24


@pytest.mark.slow  # ~1 s: transformers reads the folder back
@torch.no_grad()
def test_transformers_reads_the_folder_it_writes(tmp_path):
    from transformers import AutoModelForCausalLM

    ours = read_back(gemma4_assistant(ordered=True), tmp_path / "theirs")
    ours.save_pretrained(tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back).__name__ == "Gemma4AssistantForCausalLM"
    for name, tensor in back.state_dict().items():
        key = "lm_head.weight" if name == "model.embed_tokens.weight" else \
            name.removeprefix("model.")
        assert torch.equal(ours.state_dict()[key], tensor), name


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' target, ours converted, transformers' assistant, ours read back)."""
    hf_target, hf = gemma4_model(), gemma4_assistant()
    return (hf_target, Transformer.from_hf(hf_target).eval(), hf,
            read_back(hf, tmp_path_factory.mktemp("assistant")))


def sequence_states(target, tokens: torch.Tensor, assistant):
    """The target's states over whole sequences tokens [B, L]: its last hidden states [B, L, h]
    and the K/V the assistant reads, by kind, over all L slots."""
    cache = target.new_cache(batch_size=tokens.shape[0], max_slots=tokens.shape[1])
    with torch.no_grad():
        hidden = target(tokens, torch.arange(tokens.shape[1]), cache).last_hidden
    layers = shared_layers(assistant, target)
    return hidden, shared_kv(cache, layers, target.config, tokens.shape[1])


@torch.no_grad()
def test_teacher_forced_rows_draft_as_after_each_prefill(models):
    """Every position of a sequence at once (the masks a fit needs) gives the logits of a
    draft after the prefill of that many tokens, past the window."""
    _, target, _, assistant = models
    tokens = torch.tensor([PROMPTS[1] + [3, 4, 5, 6]])  # 11 tokens
    hidden, shared = sequence_states(target, tokens, assistant)
    positions = torch.arange(1, 11)
    masks = teacher_forced_masks(positions, 11, target.config.sliding_window)
    rows = assistant(target.embed(tokens[:, 1:]), hidden[:, :-1], positions, shared, masks)
    for t in (1, 6, 10):
        alone = assistant(target.embed(tokens[:, t:t + 1]), hidden[:, t - 1:t],
                          torch.tensor([t]), {k: (key[:, :, :t], value[:, :, :t])
                                              for k, (key, value) in shared.items()})
        torch.testing.assert_close(rows.logits[:, t - 1], alone.logits[:, 0])


def fitted_assistant(target, assistant):
    """A copy of assistant fit (AdamW, full batch) to the target's own greedy continuations of
    PROMPTS, one and two chain steps deep (the second reading the first's projected state):
    drafts that are accepted, so that lossless tests see acceptances beside rejections."""
    fitted = copy.deepcopy(assistant).requires_grad_(True).train()
    plain = {tuple(p): generate(target, p, max_new_tokens=16).tokens for p in PROMPTS}
    tokens, valid = continuation_rows(plain)
    hidden, shared = sequence_states(target, tokens, fitted)
    length = tokens.shape[1]
    positions = torch.arange(1, length - 2)
    masks = teacher_forced_masks(positions, length, target.config.sliding_window)
    embeds = target.embed(tokens).detach()

    def loss() -> LossOutput:
        step, total = None, 0.0
        for depth in (1, 2):  # the root t (its token t + depth - 1) predicts token t + depth
            state = hidden[:, :length - 3] if step is None else step.hidden
            step = fitted(embeds[:, depth:length - 3 + depth], state, positions, shared, masks)
            labels = tokens[:, depth + 1:length - 2 + depth].masked_fill(
                ~valid[:, depth + 1:length - 2 + depth], -100)
            total = total + F.cross_entropy(step.logits.flatten(0, 1), labels.flatten())
        return LossOutput(total, {})

    adam_fit(loss, fitted.parameters(), steps=30)
    return fitted.requires_grad_(False).eval()


def prefill_draft(models, params: SamplingParams, generator=None, **shape):
    """A draft (default a chain of 4) after the target's prefill of PROMPTS[1] (the root its
    last token), through the drafter's own reading of the target's cache and last hidden
    state."""
    _, target, _, assistant = models
    prompt = torch.tensor(PROMPTS[1])
    cache = target.new_cache(max_slots=16)
    with torch.no_grad():
        out = target(prompt[None, :-1], torch.arange(6), cache)
    drafter = Gemma4AssistantDrafter(assistant, **(shape or {"num_draft_tokens": 4}))
    drafter.begin(DecodeSetup(target, prompt, params, generator, 16, target_cache=cache))
    return drafter.propose(DraftContext(prompt, TargetFeatures(prompt[:-1],
                                                               out.last_hidden[0])))


@torch.no_grad()
def transformers_chain(models, tokens: list[int] | None = None):
    """transformers' assistant over transformers' target states after the prefill of
    PROMPTS[1], as its candidate generator hands them over: each step's logits [V] and its
    argmax, fed the given tokens (default: its own argmaxes)."""
    hf_target, _, hf, _ = models
    prompt = torch.tensor(PROMPTS[1])
    shared, hidden = hf_backbone(hf_target, prompt[None, :-1])
    token, logits, chosen = prompt[None, -1:], [], []
    for step in range(4):
        embeds = hf_target.model.embed_tokens(token)
        out = hf(inputs_embeds=torch.cat([embeds, hidden], -1), position_ids=torch.tensor([[6]]),
                 shared_kv_states=shared)
        logits.append(out.logits[0, -1])
        chosen.append(int(out.logits.argmax()))
        token = torch.tensor([[chosen[-1] if tokens is None else tokens[step]]])
        hidden = out.last_hidden_state
    return torch.stack(logits), chosen


def test_a_greedy_draft_is_transformers_chain(models):
    """The drafter reads the target's cache (the committed tokens' K/V of its last sliding and
    full layers) and last hidden state as transformers' candidate generator hands them over:
    the same greedy chain, each step reading the last one's projected state."""
    draft = prefill_draft(models, SamplingParams())
    assert draft.tokens.tolist() == transformers_chain(models)[1] and draft.q is None


def test_a_target_with_wider_full_layers_drafts_as_transformers(tmp_path):
    """Full layers wider than the sliding ones (as every published Gemma 4's), one K/V head:
    the target's cache holds them at the widest, and the assistant reads each layer's own
    heads and dims back, drafting transformers' chain from its states."""
    wide = {"global_head_dim": 32, "num_global_key_value_heads": 1}
    hf_target, hf = gemma4_model(**wide), gemma4_assistant(global_head_dim=32)
    models = (hf_target, Transformer.from_hf(hf_target).eval(), hf, read_back(hf, tmp_path))
    assert models[1].config.cache_dims == (2, 32, 32)
    assert prefill_draft(models, SamplingParams()).tokens.tolist() == \
        transformers_chain(models)[1]
    plain = [generate(models[1], p, max_new_tokens=10).tokens for p in PROMPTS]
    together = generate(models[1], PROMPTS, drafter=Gemma4AssistantDrafter(models[3], 3),
                        max_new_tokens=10)  # a batch: each row's cache view padded alike
    assert [r.tokens for r in together] == plain


def test_a_greedy_tree_takes_each_parents_top_tokens(models):
    """The root's children are transformers' first step's top two; node [0, 0] and [0, 1] the
    top two of its step fed the first child, with its projected state."""
    draft = prefill_draft(models, SamplingParams(), tree=TREE)
    assert draft.tree.parents == Tree.from_paths(TREE).parents and draft.q is None
    first, _ = transformers_chain(models)
    top = first[0].topk(2).indices.tolist()
    second, _ = transformers_chain(models, [top[0], 0, 0, 0])
    assert draft.tokens[:2].tolist() == top
    assert draft.tokens[2:4].tolist() == second[1].topk(2).indices.tolist()


def test_sampled_drafts_report_the_assistants_laws(models):
    """Drawn tokens, and the laws the draft reports, are transformers' assistant's warped as
    the target's are (top-p cutting some tokens out): what the verifier's exactness needs."""
    params = SamplingParams(0.8, top_p=0.9)
    draft = prefill_draft(models, params, torch.Generator().manual_seed(0))
    logits, _ = transformers_chain(models, draft.tokens.tolist())
    laws = logits_to_probs(logits, params)  # [4, V]
    torch.testing.assert_close(draft.q, laws, atol=1e-5, rtol=1e-4)
    assert (laws[torch.arange(4), draft.tokens] > 0).all() and (laws == 0).any()


@pytest.fixture(scope="module")
def fitted(models):
    return fitted_assistant(models[1], models[3])


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_is_lossless_with_drafts_accepted_and_rejected(models, fitted, shape):
    _, target, _, _ = models
    accepted, rejected = 0, 0
    for prompt in PROMPTS:
        plain = generate(target, prompt, max_new_tokens=16).tokens
        out = generate(target, prompt, drafter=Gemma4AssistantDrafter(fitted, **SHAPES[shape]),
                       max_new_tokens=16)
        assert out.tokens == plain
        accepted += out.stats.accepted
        rejected += out.stats.drafted - out.stats.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_batch_decodes_each_row_as_alone(models, fitted, shape):
    """Each row drafts with its own fork over its own row of the target's cache: plain greedy's
    tokens, and the drafts accepted as they are alone."""
    _, target, _, _ = models
    assistant = fitted
    alone = [generate(target, p, drafter=Gemma4AssistantDrafter(assistant, **SHAPES[shape]),
                      max_new_tokens=12) for p in PROMPTS]
    together = generate(target, PROMPTS, drafter=Gemma4AssistantDrafter(
        assistant, **SHAPES[shape]), max_new_tokens=12)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.stats.accepted for r in together] == [r.stats.accepted for r in alone]
    assert min(r.stats.accepted for r in alone) > 0


@functools.cache
def law_pair():
    """A target of 8 tokens whose laws are peaky and an assistant for it: its random drafts
    are accepted often enough to be in play."""
    import tempfile

    target = Transformer.from_hf(gemma4_model(seed=3, std=0.5, vocab_size=8)).eval()
    return target, read_back(gemma4_assistant(seed=4, std=0.5, vocab=8), tempfile.mkdtemp())


@pytest.mark.slow  # ~10 s at FAST_LAW_SAMPLES here: the default run checks the reported laws
@pytest.mark.parametrize("shape", [{"num_draft_tokens": 2}, {"tree": [[0], [1], [0, 0]]}],
                         ids=["chain", "tree"])
def test_sampling_through_the_assistant_follows_the_target_law(request, shape):
    target, assistant = law_pair()
    assert_drafted_sampling_is_exact(target, Gemma4AssistantDrafter(assistant, **shape), T1,
                                     law_samples(request))


class MisstatedLaw(Gemma4AssistantDrafter):
    """Planted bug: tokens drawn from the assistant's law but reported as drawn from a flatter
    one (its square root, renormalised)."""

    def propose(self, context):
        draft = super().propose(context)
        if draft.q is None:
            return draft
        flat = draft.q.sqrt()
        return dataclasses.replace(draft, q=flat / flat.sum(-1, keepdim=True))


@pytest.mark.slow  # ~2 s
def test_a_misstated_draft_law_is_caught():
    target, assistant = law_pair()
    assert sampled_pvalue(target, MisstatedLaw(assistant, 2), T1, 500) < P_VALUE_FLOOR


def test_a_target_of_another_shape_is_refused_in_one_line(models):
    _, _, _, assistant = models
    other = Transformer.from_hf(gemma4_model(hidden_size=48)).eval()
    with pytest.raises(ValueError, match="backbone_hidden_size 32 vs the target 48") as caught:
        generate(other, PROMPTS[0], drafter=Gemma4AssistantDrafter(assistant, 2),
                 max_new_tokens=2)
    assert "\n" not in str(caught.value)


# ---- the registry and the random preset ------------------------------------------------------


@pytest.mark.slow  # ~1.5 s; the default run drafts with it in test_every_method_everywhere
def test_the_random_preset_drafts_losslessly_through_the_registry(cfg_of):
    """model=random-gemma4: transformers' random Gemma 4 target and a random assistant of the
    preset's shape (centroid scoring), composed as eval/generate.py composes them."""
    from selfspec.from_config.generation import drafter_and_target
    from selfspec.from_config.models import load_target

    cfg = cfg_of("generate", "model=random-gemma4", "drafter=gemma4_assistant",
                 "num_draft_tokens=3")
    target = load_target(cfg)
    drafter, verified_on = drafter_and_target(cfg, target)
    assert verified_on is target and target.config.model_type == "gemma4_text"
    assistant = drafter.assistant
    assert assistant.config.ordered_embeddings and assistant.config.text.num_layers == 2
    assert assistant.config.backbone_hidden_size == target.config.hidden_size == 64
    for prompt in PROMPTS:
        out = generate(target, prompt, drafter=drafter, max_new_tokens=8)
        assert out.tokens == generate(target, prompt, max_new_tokens=8).tokens
        assert out.stats.drafted > 0


def test_the_method_without_an_assistant_is_refused_naming_the_fix(cfg_of):
    from selfspec.from_config.methods import entry

    cfg = cfg_of("generate", "model=tiny", "drafter=gemma4_assistant")
    with pytest.raises(ValueError, match="gemma4_assistant.path=") as caught:
        entry("gemma4_assistant").check(cfg, (2,))
    assert "\n" not in str(caught.value)


@pytest.mark.slow  # ~1 s: two timed generations
def test_bench_decode_measures_its_draft_cost():
    from selfspec.from_config.methods import cost_rows
    from selfspec.measure.costs import CostProfile
    from selfspec.measure.method_costs import method_cost_row

    target = Transformer.from_hf(gemma4_model()).eval()
    profile = CostProfile({1: 1.0, 64: 2.0}, cache_length=16, device="cpu", dtype="fp32")
    row = method_cost_row("gemma4_assistant", cost_rows()["gemma4_assistant"], target,
                          tuple(map(tuple, TREE)), [[3, 9, 4, 17, 5]], new_tokens=6,
                          profile=profile, seed=0, cuda_graphs=False)
    assert (row["nodes"], row["lossless"]) == (6, True)
    assert row["draft_cost"] > 0 and row["draft_cost_per_level"] == pytest.approx(
        row["draft_cost"] / 3)


def test_a_sweep_adds_the_tree_configs_choices_cut_to_each_length(cfg_of):
    from selfspec.from_config.methods import entry
    from selfspec.from_config.methods.entry import Loaded

    cfg = cfg_of("sweep", "model=random-gemma4", "tree=medusa_small")
    method = entry("gemma4_assistant")
    rows = method.variants(cfg, True)
    assert [v.label() for v in rows] == ["gemma4_assistant", "gemma4_assistant/tree"]
    assert [v.label() for v in method.variants(cfg, False)] == ["gemma4_assistant"]
    loaded = Loaded(cfg, target=None)
    loaded.once("gemma4_assistant", lambda: "an assistant")
    assert method.drafter(loaded, rows[1], 2).tree.num_nodes == 10  # medusa_small's depth <= 2
    assert method.drafter(loaded, rows[0], 3).tree.is_chain
