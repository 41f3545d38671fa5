"""Draft models cut from the target (`Transformer.first_layers`, `DraftModelObjective`,
train/draft.py), saved as Hugging Face folders, drafting over a reduced vocabulary."""

import json
from functools import partial

import pytest
import torch
from helpers import SAMPLING_PROMPT, assert_drafted_sampling_is_exact, run_trainer, tiny_llama
from test_train_early_exit import three_layer_target
from test_train_medusa import sharegpt_file

from selfspec import generate
from selfspec.draft_vocab import (
    draft_vocabulary,
    load_draft_vocab,
    save_token_counts,
    token_counts,
)
from selfspec.drafters import SmallModelDrafter
from selfspec.losses import exit_loss
from selfspec.model import Transformer
from selfspec.objectives import DraftModelObjective
from selfspec.sampling import SamplingParams

PROMPTS = [[2, 3, 4, 5], [9, 8, 7, 6, 5], [11, 12]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, layers=3))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_the_first_layers_are_the_targets_early_exit(target, layers):
    draft = target.first_layers(layers)
    tokens = torch.tensor([PROMPTS[0]])
    positions = torch.arange(tokens.shape[1])
    assert draft.config.num_layers == layers and len(draft.layers) == layers
    torch.testing.assert_close(draft(tokens, positions).logits,
                               target(tokens, positions, exit_layer=layers).logits)
    draft.layers[0].mlp.up_proj.weight.data.zero_()  # a copy: the target is untouched
    assert target.layers[0].mlp.up_proj.weight.abs().sum() > 0


@pytest.mark.parametrize("layers", [0, 4])
def test_impossible_cuts_are_refused(target, layers):
    with pytest.raises(ValueError, match=r"num_layers must be in 1..3"):
        target.first_layers(layers)


def test_a_saved_model_loads_back_in_selfspec_and_transformers(tmp_path, target):
    from transformers import AutoModelForCausalLM

    draft = target.first_layers(2)
    draft.save_pretrained(tmp_path)
    tokens = torch.tensor([PROMPTS[1]])
    positions = torch.arange(tokens.shape[1])
    expected = draft(tokens, positions).logits
    torch.testing.assert_close(Transformer.from_pretrained(tmp_path)(tokens, positions).logits,
                               expected, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def plain_greedy(target) -> dict:
    return {tuple(p): generate(target, p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS}


def test_greedy_is_lossless_with_a_draft_vocabulary_missing_half_the_output(target,
                                                                            plain_greedy):
    produced = sorted({t for tokens in plain_greedy.values() for t in tokens})
    vocab = draft_vocabulary(torch.tensor(produced[::2]), target.config.vocab_size,
                             len(produced[::2]))
    drafter = SmallModelDrafter(target.first_layers(2), num_draft_tokens=4, draft_vocab=vocab)
    proposed = []
    original = drafter.propose
    drafter.propose = lambda context: _recorded(original(context), proposed)
    for prompt, expected in plain_greedy.items():
        assert generate(target, list(prompt), drafter=drafter,
                        max_new_tokens=NEW_TOKENS).tokens == expected
    assert proposed and set(proposed) <= set(produced[::2])


def _recorded(draft, proposed: list[int]):
    proposed.extend(draft.tokens.tolist())
    return draft


def test_a_full_draft_vocabulary_drafts_as_the_whole_head(target, plain_greedy):
    whole = draft_vocabulary(torch.arange(64), 64, 64)
    prompt = list(next(iter(plain_greedy)))
    runs = [generate(target, prompt, max_new_tokens=NEW_TOKENS,
                     drafter=SmallModelDrafter(target.first_layers(2), 3, draft_vocab=vocab))
            for vocab in (None, whole)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accept_histogram == runs[1].stats.accept_histogram


def test_first_candidates_are_the_drafts_top_tokens_and_stay_lossless(target, plain_greedy):
    """first_candidates=3: the draft model's three most likely first tokens, the chain under
    the first; greedy output stays plain greedy's, and the second and third candidates are
    the target's next token at some steps (they are in play, not decoration)."""
    draft = target.first_layers(2)
    drafter = SmallModelDrafter(draft, num_draft_tokens=3, first_candidates=3)
    seen = []
    original = drafter.propose
    drafter.propose = lambda context: _kept(original(context), context.tokens.tolist(), seen)
    for prompt, expected in plain_greedy.items():
        assert generate(target, list(prompt), drafter=drafter,
                        max_new_tokens=NEW_TOKENS).tokens == expected
    sibling_right = 0
    for context, proposal in seen:
        assert proposal.tree.parents == (-1, 0, 1, -1, -1)
        tokens = proposal.tokens.tolist()
        with torch.inference_mode():
            logits = draft(torch.tensor([context]), torch.arange(len(context))).logits[0, -1]
        assert [tokens[0], *tokens[3:]] == logits.topk(3).indices.tolist()
        prompt = next(p for p in plain_greedy if tuple(context[:len(p)]) == p)
        produced = context[len(prompt):]
        sibling_right += plain_greedy[prompt][len(produced)] in tokens[3:]
    assert sibling_right > 0


def _kept(draft, context: list[int], seen: list):
    seen.append((context, draft))
    return draft


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_p=0.9)])
def test_sampling_through_a_reduced_draft_is_exact(target, params):
    kept = torch.tensor(sorted(set(SAMPLING_PROMPT)) + [20, 30, 40])
    vocab = draft_vocabulary(kept, target.config.vocab_size, len(kept))
    drafter = SmallModelDrafter(target.first_layers(2), 2, draft_vocab=vocab)
    assert_drafted_sampling_is_exact(target, drafter, params)


def test_a_vocabulary_for_another_target_is_refused_before_generating(target):
    vocab = draft_vocabulary(torch.arange(10), 32, 8)
    drafter = SmallModelDrafter(target.first_layers(1), 2, draft_vocab=vocab)
    with pytest.raises(ValueError, match="maps into 32 token ids, the target has 64"):
        generate(target, PROMPTS[0], drafter=drafter, max_new_tokens=4)


def test_token_counts_choose_any_vocabulary_size_later(tmp_path):
    tokens = torch.tensor([[5, 5, 5, 7, 7, 9, 1], [5, 7, 3, 3, 3, 3, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0]])
    save_token_counts(tmp_path, token_counts(tokens, 16, mask))
    assert load_draft_vocab(tmp_path, 2).target_ids.tolist() == [3, 5]  # 4x each, then 7 (3x)
    assert load_draft_vocab(tmp_path, 3).target_ids.tolist() == [3, 5, 7]
    assert load_draft_vocab(tmp_path, 4).target_ids.tolist() == [3, 5, 7, 9]
    with pytest.raises(FileNotFoundError, match="train/draft.py writes them"):
        load_draft_vocab(tmp_path / "elsewhere", 2)


def test_the_objective_trains_only_the_drafts_unfrozen_weights(target):
    draft = target.first_layers(1)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    objective = DraftModelObjective(target, draft)
    tokens = torch.randint(64, (2, 12))
    out = objective(tokens, torch.ones_like(tokens))
    out.loss.backward()
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None
    assert draft.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.parameters())
    assert 0 <= out.metrics["draft/top1"] <= 1 and out.metrics["draft/kl"] > 0


def test_cached_features_give_the_same_loss(target):
    tokens, mask = torch.randint(64, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    draft = target.first_layers(2)
    losses = [DraftModelObjective(target, draft, cache_features=cache)(tokens, mask).loss
              for cache in (False, True)]
    torch.testing.assert_close(losses[0], losses[1])


def test_a_negative_hard_weight_is_refused(target):
    with pytest.raises(ValueError, match="hard_weight must be >= 0"):
        DraftModelObjective(target, target.first_layers(1), hard_weight=-1.0)


# ---- train/draft.py --------------------------------------------------------------------------


run_entry = partial(run_trainer, "draft")


def test_train_draft_exports_a_model_both_libraries_load_and_reports(tmp_path, quick_build):
    from transformers import AutoModelForCausalLM

    model = three_layer_target(quick_build, tmp_path / "model")
    done = run_entry(
        "model=local", f"model.path={model}", "train_data.source=sharegpt",
        f"train_data.path={sharegpt_file(tmp_path)}", "trainer.max_steps=4",
        "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.save_every=2",
        "trainer.eval_every=2", "trainer.threads=1", "final_eval.num_prompts=2",
        "final_eval.max_new_tokens=12", "draft_model.num_layers=1",
        "draft_model.draft_vocab=40", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "draft vocabulary: 40" in done.stdout and "lossless=True" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["lossless"] is True and summary["tau"] >= 1
    export = tmp_path / "run/checkpoints/step_0000004/export"
    target = Transformer.from_pretrained(model)
    draft = Transformer.from_pretrained(export)
    assert draft.config.num_layers == 1
    # Frozen, so the target's own; the layer trained, so not the target's.
    torch.testing.assert_close(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert not torch.equal(draft.layers[0].mlp.up_proj.weight, target.layers[0].mlp.up_proj.weight)
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 1
    assert len(load_draft_vocab(export, 40).target_ids) == 40
    assert (export / "tokenizer.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("draft_model.num_layers=8", "a draft must be shallower than the target"),
    ("draft_model.num_layers=0", "draft_model.num_layers must be an integer >= 1"),
    ("draft_model.draft_vocab=5000", "draft_model.draft_vocab must be null or 1..vocab_size"),
])
def test_train_draft_refuses_impossible_settings_before_loading(tmp_path, override, message):
    done = run_entry(override, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_train_draft_dry_run_plans_a_70b_target_without_weights(tmp_path):
    done = run_entry("model=llama2-70b", "dry_run=true", f"hydra.run.dir={tmp_path}",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    h, kv, ffn = 8192, 1024, 28672  # Llama-2-70B
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert f"first 2 layers and final norm): {2 * layer + h:,} parameters" in done.stdout


def test_a_draft_vocabulary_restricts_both_laws(target):
    tokens, mask = torch.randint(64, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    kept = torch.tensor([1, 5, 6, 20, 33, 50])
    vocab = draft_vocabulary(kept, 64, len(kept))
    draft = target.first_layers(2)
    positions = torch.arange(9)
    student = draft(tokens, positions).logits[..., kept]
    teacher = target(tokens, positions).logits[..., kept]
    expected = exit_loss(student, teacher, tokens, mask).loss
    got = DraftModelObjective(target, draft, draft_vocab=vocab)(tokens, mask).loss
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="hard_weight > 0 with a draft vocabulary"):
        DraftModelObjective(target, draft, hard_weight=0.5, draft_vocab=vocab)
