"""Training configs (from_config/training.py): each composes, self-distillation, chat prompts."""

import pytest
import torch
from helpers import group_options, tiny_llama

from selfspec.from_config.methods.medusa import medusa_drafter, tree_depth
from selfspec.from_config.models import resolve_model_path
from selfspec.from_config.training import (
    deepspeed_config,
    distilled_corpus,
    final_eval_prompts,
    self_distill_enabled,
    tau_judge,
    tau_prompts,
    train_settings,
    training_rows,
)
from selfspec.heads import MedusaConfig, MedusaHeads
from selfspec.model import Transformer
from selfspec.training.rows import TokenRows


@pytest.mark.parametrize(
    "override",
    [f"{group}={name}" for group in ("optim", "trainer", "deepspeed", "tree", "model", "data",
                                     "sampling") for name in group_options(group)],
)
def test_every_training_config_composes(cfg_of, override):
    cfg = cfg_of("train_medusa", override, "run_dir=/tmp/unused")
    settings = train_settings(cfg)
    assert settings.max_steps >= 1 and settings.lr > 0
    heads = MedusaHeads(MedusaConfig(8, 64, num_heads=int(cfg.medusa.num_heads)))
    drafter = medusa_drafter(cfg.tree, heads)
    depth = tree_depth(cfg.tree) or 1
    assert 1 <= drafter.max_nodes and depth <= cfg.medusa.num_heads
    config = deepspeed_config(cfg)
    assert config is None or config["zero_optimization"]["stage"] in (2, 3)


@pytest.mark.parametrize("value, source, expected", [
    ("auto", "stdlib", True), ("auto", "sharegpt", False), ("false", "stdlib", False),
    ("true", "sharegpt", True)])
def test_self_distillation_is_automatic_for_the_corpus_only(cfg_of, value, source, expected):
    cfg = cfg_of("train_medusa", f"train_data.self_distill={value}", f"train_data.source={source}",
                 "run_dir=/tmp/unused")
    assert self_distill_enabled(cfg) is expected


def test_corpus_self_distillation_rewrites_the_rows_the_run_draws(cfg_of, tmp_path):
    cfg = cfg_of("train_medusa", "trainer.max_steps=2", "trainer.micro_batch_size=3",
                 "trainer.grad_accum=2",
                 "trainer.eval_rows=2", "train_data.self_distill_prompt_tokens=4",
                 f"train_data.cache_dir={tmp_path}", "run_dir=/tmp/unused")
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 64, (40, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    train, heldout = distilled_corpus(cfg, target, rows, rows)
    assert len(train) == 2 * 3 * 2 and len(heldout) == 2  # steps x global batch; eval rows
    assert train.loss_mask[:, :4].sum() == 0 and train.loss_mask[:, 4:].all()
    with pytest.raises(ValueError, match="self_distill needs the target"):
        distilled_corpus(cfg, None, rows, rows)


def test_eagle_runs_go_over_fewer_self_distilled_rows_for_several_epochs(cfg_of, tmp_path):
    cfg = cfg_of("train_eagle", "trainer.max_steps=5", "trainer.micro_batch_size=2",
                 "trainer.eval_rows=2",
                 "train_data.self_distill_prompt_tokens=4", "train_data.self_distill_rows=3",
                 f"train_data.cache_dir={tmp_path}", "run_dir=/tmp/unused")
    assert cfg.trainer.max_steps == 5  # the eagle_quick preset's 600 steps overridden
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 64, (40, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    train, _ = distilled_corpus(cfg, target, rows, rows)
    assert len(train) == 3  # not the 10 rows the run draws
    cfg.train_data.self_distill_rows = 0
    with pytest.raises(ValueError, match="self_distill_rows"):
        training_rows(cfg, None, target)


def test_general_chat_prompts_come_first_and_a_bad_count_is_refused(cfg_of, monkeypatch):
    from selfspec.from_config import training as build_training
    from selfspec.training.instructions import general_instructions

    asked = []
    monkeypatch.setattr(build_training, "self_distilled_conversations",
                        lambda prompts, *args, **kwargs: asked.append(prompts) or [])
    # the stdlib's own list is test_instructions'; its parse costs seconds a process
    monkeypatch.setattr(build_training, "stdlib_instructions",
                        lambda count: [f"stdlib {i}" for i in range(count)])
    target = Transformer.from_hf(tiny_llama(0))
    cfg = cfg_of("train_eagle", "train_data.source=instructions", "train_data.num_prompts=3",
                 "train_data.general_prompts=5", "train_data.cache_dir=null",
                 "run_dir=/tmp/unused")
    build_training.instruction_conversations(cfg, target, None)
    # general first: the held-out twentieth comes from the kind of prompt evaluation asks
    assert asked == [general_instructions(5) + ["stdlib 0", "stdlib 1", "stdlib 2"]]
    for bad in (-1, "2", True):
        cfg.train_data.general_prompts = bad
        with pytest.raises(ValueError, match="general_prompts must be an integer >= 0"):
            build_training.instruction_conversations(cfg, target, None)


# ---- held-out tau during training -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    return Transformer.from_pretrained(resolve_model_path(
        __import__("omegaconf").OmegaConf.create({"name": "tiny", "asset": "tiny/target"})))


def tiny_drafters(target: Transformer, records=()) -> dict:
    """One drafter of each kind a replay can judge: Medusa heads and an EAGLE-1 head fit to
    the records' answers (briefly: they must accept something), and the shipped draft model."""
    from helpers import fit_eagle_head, fit_medusa_heads

    from selfspec.drafters import EagleDrafter, MedusaDrafter, SmallModelDrafter

    answers = {tuple(r.prompt): r.tokens for r in records} or {(1, 2, 3): [4, 5, 6, 7]}
    medusa, _ = fit_medusa_heads(target, answers, num_heads=2)
    eagle, _ = fit_eagle_head(target, answers)
    draft = Transformer.from_pretrained(resolve_model_path(
        __import__("omegaconf").OmegaConf.create({"name": "tiny-draft", "asset": "tiny/draft"})))
    return {"medusa": MedusaDrafter(medusa, [[0], [0, 0], [1]]),
            "eagle": EagleDrafter(eagle, total_tokens=4, depth=2, top_k=2),
            "small_model": SmallModelDrafter(draft, 3)}


@pytest.mark.slow
def test_replayed_tau_equals_the_tau_generate_measures_on_the_same_answers(cfg_of,
                                                                           tiny_target):
    from selfspec.from_config.training import heldout_tau
    from selfspec.measure.replay import record_greedy

    cfg = cfg_of("train_medusa", "trainer.tau_prompts=3", "trainer.tau_new_tokens=32",
                 "run_dir=/tmp/unused")
    prompts = tau_prompts(cfg, tiny_target)
    records = [record_greedy(tiny_target, p, 32, tuple(tiny_target.config.eos_token_ids))
               for p in prompts]
    for name, drafter in tiny_drafters(tiny_target, records).items():
        replayed = heldout_tau(tiny_target, drafter, tiny_target, records, replayable=True)
        decoded = heldout_tau(tiny_target, drafter, tiny_target, records, replayable=False)
        assert replayed.tau == pytest.approx(decoded.tau, abs=1e-9), name
        assert replayed.standard_error == pytest.approx(decoded.standard_error, abs=1e-9)
        assert replayed.tau > 1.0 and replayed.prompts == 3, name  # not trivially equal


def test_tau_is_judged_on_prompts_held_out_from_the_final_report(cfg_of, tiny_target):
    cfg = cfg_of("train_medusa", "trainer.tau_prompts=4", "final_eval.num_prompts=3",
                 "run_dir=/tmp/unused")
    judged, reported = (tau_prompts(cfg, tiny_target),
                        final_eval_prompts(cfg, tiny_target))
    assert len(judged) == 4 and len(reported) == 3
    assert not {tuple(p) for p in judged} & {tuple(p) for p in reported}
    with pytest.raises(ValueError, match="trainer.tau_prompts=999: humaneval has"):
        tau_prompts(cfg_of("train_medusa", "trainer.tau_prompts=999",
                           "run_dir=/tmp/unused"), tiny_target)


def test_the_judge_names_each_drafter_and_averages_them(cfg_of, tiny_target, tmp_path):
    drafters = tiny_drafters(tiny_target)
    cfg = cfg_of("train_medusa", "trainer.tau_prompts=2", "trainer.tau_new_tokens=16",
                 "run_dir=/tmp/unused")
    judge = tau_judge(cfg, tiny_target, lambda target, folder: {
        name: (drafter, target) for name, drafter in drafters.items()})
    judged = judge(tmp_path)
    named = [judged[f"eval/tau/{name}"] for name in drafters]
    assert judged["eval/tau"] == pytest.approx(sum(named) / len(named))
    assert all(judged[f"eval/tau_se/{name}"] is not None for name in drafters)  # two prompts
    assert "eval/tau_se" not in judged  # the mean of several drafters has none
    off = cfg_of("train_medusa", "trainer.tau_prompts=0", "run_dir=/tmp/unused")
    assert tau_judge(off, tiny_target, lambda target, folder: {}) is None
