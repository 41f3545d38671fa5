"""trainer.objective: every trainer's settings check takes every objective name and refuses a
bad one in one line; each trainer's objective module fits its draft by the name it was given."""

import pytest
import torch
from helpers import tiny_llama

from selfspec.divergences import DIVERGENCES
from selfspec.from_config.methods import mtp
from selfspec.from_config.methods.dflash import check_dflash_settings, dflash_head, dflash_objective
from selfspec.from_config.methods.eagle import check_eagle_settings, eagle_head, eagle_objective
from selfspec.from_config.methods.early_exit import (
    check_early_exit_settings,
    early_exit_heads,
    early_exit_objective,
)
from selfspec.from_config.methods.medusa import (
    check_medusa_settings,
    medusa_heads,
    medusa_objective,
)
from selfspec.from_config.methods.small_model import (
    check_draft_model_settings,
    draft_from_target,
    draft_model_objective,
)
from selfspec.from_config.training import TrainingRun
from selfspec.heads.draft_vocab import token_counts
from selfspec.model import Transformer
from selfspec.training.rows import TokenRows

EAGLE3 = ("eagle.version=3", "eagle.draft_vocab_size=32", "eagle.target_layers=[0,1,2]",
          "eagle.ttt_steps=2")
DFLASH = ("dflash.loss=kl", "dflash.target_layers=[0,1,2]", "dflash.block_size=4")
# (config, overrides, its settings check)
TRAINERS = {
    "medusa": ("train_medusa", (), check_medusa_settings),
    "medusa2": ("train_medusa", ("medusa.version=2",), check_medusa_settings),
    "eagle1": ("train_eagle", (), check_eagle_settings),
    "eagle3": ("train_eagle", EAGLE3, check_eagle_settings),
    "peagle": ("train_eagle", (*EAGLE3, "eagle.parallel=3"), check_eagle_settings),
    "dflash": ("train_dflash", DFLASH, check_dflash_settings),
    "early_exit": ("train_early_exit", ("early_exit.exit_layers=[1]",),
                   check_early_exit_settings),
    "draft": ("train_draft", ("draft_model.num_layers=1",), check_draft_model_settings),
    "mtp": ("train_mtp", ("mtp.steps=2",), mtp.check_trainer),
}


# one config a trainer: its variants (Medusa-2, EAGLE-1, P-EAGLE) pass the same check
@pytest.mark.parametrize("trainer", ["medusa", "eagle3", "dflash", "early_exit", "draft", "mtp"])
def test_every_trainer_takes_every_objective_and_refuses_a_bad_one_in_one_line(cfg_of, trainer):
    config, overrides, check = TRAINERS[trainer]
    cfg = cfg_of(config, *overrides, "run_dir=/tmp/unused")
    assert cfg.trainer.objective == "kl"  # the published loss by default
    for name in DIVERGENCES:
        cfg.trainer.objective = name
        check(cfg)
    cfg.trainer.objective = "l2"
    with pytest.raises(ValueError) as refused:
        check(cfg)
    assert str(refused.value).startswith("trainer.objective must be one of kl, tv, reverse_kl, "
                                         "jsd, lk") and "\n" not in str(refused.value)
    if trainer == "dflash":  # against the data (hard labels) only the cross-entropy applies
        cfg.trainer.objective, cfg.dflash.loss = "tv", "ce"
        with pytest.raises(ValueError, match="trainer.objective=tv fits the draft's law to the "
                                             "target's: set dflash.loss=kl"):
            check(cfg)


def objective_of(trainer: str, cfg, target: Transformer, rows: TokenRows) -> torch.nn.Module:
    if trainer.startswith("medusa"):
        return medusa_objective(cfg, target, medusa_heads(cfg, target, rows))
    if trainer in ("eagle1", "eagle3", "peagle"):
        return eagle_objective(cfg, target, eagle_head(cfg, target, rows))
    if trainer == "dflash":
        return dflash_objective(cfg, target, dflash_head(cfg, target, rows))
    if trainer == "early_exit":
        return early_exit_objective(cfg, target, early_exit_heads(cfg, target))
    if trainer == "mtp":  # a fresh module of mtp.add_module's layout
        run = TrainingRun(cfg, target, None, rows, mtp.trainable_module(cfg, target, rows))
        return mtp.objective(run, None)
    counts = token_counts(rows.tokens, target.config.vocab_size)
    return draft_model_objective(cfg, target, draft_from_target(cfg, target), counts)


# each trainer with an objective other than kl (the others run the same function)
@pytest.mark.slow
@pytest.mark.parametrize("trainer, name", [
    ("medusa", "tv"), ("medusa2", "lk"), ("eagle1", "jsd"), ("eagle3", "tv"),
    ("peagle", "reverse_kl"), ("dflash", "lk"), ("early_exit", "tv"), ("draft", "jsd"),
    ("mtp", "lk")])
def test_each_trainers_objective_fits_its_draft_by_the_name_given(cfg_of, trainer, name):
    config, overrides, _ = TRAINERS[trainer]
    cfg = cfg_of(config, *overrides, f"trainer.objective={name}", "run_dir=/tmp/unused")
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    objective = objective_of(trainer, cfg, target, rows)
    assert objective.objective == name
    out = objective(rows.tokens, rows.loss_mask)
    out.loss.backward()
    grads = [p.grad for p in objective.parameters() if p.requires_grad]
    assert out.loss.isfinite() and grads and all(g is not None and g.isfinite().all()
                                                  for g in grads)
