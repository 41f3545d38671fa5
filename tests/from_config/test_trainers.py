"""What each trainer composes (its `TrainerEntry`, in its method's module under
from_config/methods/): every trainable method's settings, fresh module, objective and export
drafters, from its training config."""

import pytest
import torch
from helpers import tiny_llama

from selfspec.drafters import ParallelEagleDrafter
from selfspec.drafters.eagle_static import DynamicShape
from selfspec.from_config.methods.dflash import (
    check_dflash_settings,
    dflash_head,
    dflash_objective,
    dflash_trainer_drafter,
)
from selfspec.from_config.methods.eagle import (
    check_eagle_settings,
    eagle_head,
    eagle_objective,
    eagle_trainer_drafter,
)
from selfspec.from_config.methods.early_exit import (
    EarlyExitObjective,
    check_early_exit_settings,
    early_exit_heads,
    early_exit_objective,
    early_exit_trainer_drafter,
)
from selfspec.from_config.methods.medusa import (
    check_medusa_settings,
    check_medusa_tree,
    medusa_heads,
    medusa_objective,
)
from selfspec.from_config.methods.small_model import (
    DraftModelObjective,
    check_draft_model_settings,
    draft_from_target,
    draft_model_objective,
)
from selfspec.heads.draft_vocab import token_counts
from selfspec.model import Transformer
from selfspec.training.rows import TokenRows


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


@pytest.fixture(scope="module")
def rows() -> TokenRows:
    tokens = torch.randint(2, 64, (6, 12), generator=torch.Generator().manual_seed(0))
    return TokenRows(tokens, torch.ones_like(tokens))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_eagle_training_configs_build_their_heads_drafters_and_objectives(cfg_of, target, rows,
                                                                          version):
    eagle3 = ["eagle.draft_vocab_size=32", "eagle.target_layers=[0,1,2]"] if version == 3 else []
    cfg = cfg_of("train_eagle", f"eagle.version={version}", *eagle3, "eagle.ttt_steps=2",
                 "run_dir=/tmp/unused")
    assert check_eagle_settings(cfg) == version
    head = eagle_head(cfg, target, rows)
    config = head.config
    assert config.version == (3 if version == 3 else 1)
    drafter = eagle_trainer_drafter(cfg, head)
    if version == 1:  # the static chain4 tree
        assert drafter.shape.tree.is_chain and drafter.max_nodes == 4
    else:  # the EAGLE-2 defaults for a CPU
        assert drafter.shape == DynamicShape(total_tokens=8, depth=3, top_k=2)
    objective = eagle_objective(cfg, target, head)
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()
    if version == 3:
        seen = rows.tokens.unique()
        assert len(seen) > 32  # so the draft vocabulary holds training tokens only
        assert set(head.draft_vocab.target_ids.tolist()) < set(seen.tolist())


def test_a_p_eagle_training_config_builds_its_head_drafter_and_objective(cfg_of, target, rows):
    cfg = cfg_of("train_eagle", "eagle.version=3", "eagle.parallel=3", "eagle.draft_vocab_size=32",
                 "eagle.target_layers=[0,1,2]", "eagle.tree_nodes=5", "run_dir=/tmp/unused")
    assert check_eagle_settings(cfg) == 3
    head = eagle_head(cfg, target, rows)
    config = head.config
    counts = token_counts(rows.tokens, target.config.vocab_size)
    assert config.parallel == 3 and counts[config.mask_token_id] == counts.min()  # the rarest
    drafter = eagle_trainer_drafter(cfg, head)
    assert isinstance(drafter, ParallelEagleDrafter)
    assert (drafter.k, drafter.shape.nodes) == (3, 5)
    objective = eagle_objective(cfg, target, head)
    assert objective.keep == 0.5
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()
    with pytest.raises(ValueError, match="eagle.version=3"):
        check_eagle_settings(cfg_of("train_eagle", "eagle.parallel=3",
                                    "run_dir=/tmp/unused"))


def test_early_exit_training_configs_build_exits_drafters_and_their_objective(cfg_of, target,
                                                                             rows):
    cfg = cfg_of("train_early_exit", "early_exit.exit_layers=[1]", "early_exit.hard_weight=0.5",
                 "run_dir=/tmp/unused")
    assert check_early_exit_settings(cfg) == (1,)
    (head,) = early_exit_heads(cfg, target)
    assert head.config.kind == "adapter" and head.exit_layer == 1
    drafter = early_exit_trainer_drafter(cfg, head)
    assert (drafter.max_nodes, drafter.confidence_threshold) == (6, 0.6)
    objective = early_exit_objective(cfg, target, [head])
    assert isinstance(objective, EarlyExitObjective) and objective.hard_weight == 0.5
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()


@pytest.mark.parametrize("vocab", ["null", "16"])
def test_draft_model_training_configs_build_the_draft_and_its_objective(cfg_of, target, rows,
                                                                        vocab):
    cfg = cfg_of("train_draft", "draft_model.num_layers=1", f"draft_model.draft_vocab={vocab}",
                 "run_dir=/tmp/unused")
    assert check_draft_model_settings(cfg) == 1
    draft = draft_from_target(cfg, target)
    assert draft.config.num_layers == 1 and not draft.lm_head.weight.requires_grad
    counts = token_counts(rows.tokens, target.config.vocab_size, rows.loss_mask)
    objective = draft_model_objective(cfg, target, draft, counts)
    assert isinstance(objective, DraftModelObjective)
    if vocab == "null":
        assert objective.vocab_ids is None
    else:  # the 16 most frequent training tokens
        assert set(objective.vocab_ids.tolist()) == set(
            torch.sort(-counts, stable=True).indices[:16].tolist())
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()


@pytest.mark.parametrize("version", [1, 2])
def test_medusa_training_configs_build_heads_and_their_objective(cfg_of, target, rows, version):
    cfg = cfg_of("train_medusa", f"medusa.version={version}", "run_dir=/tmp/unused")
    assert check_medusa_settings(cfg) == version
    check_medusa_tree(cfg, target.config)
    heads = medusa_heads(cfg, target, rows)
    objective = medusa_objective(cfg, Transformer.from_hf(tiny_llama(0)), heads)
    assert type(objective).__name__ == ("MedusaObjective" if version == 1 else "Medusa2Objective")
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()


@pytest.mark.parametrize("overrides", [[], ["dflash.loss=kl", "dflash.draft_vocab_size=32",
                                             "dflash.tree_nodes=6", "dflash.mask_token_id=3"]])
def test_dflash_training_configs_build_their_head_drafter_and_objective(cfg_of, overrides):
    cfg = cfg_of("train_dflash", "dflash.target_layers=[0,1,2]", "dflash.block_size=4",
                 "run_dir=/tmp/unused", *overrides)
    check_dflash_settings(cfg)
    target = Transformer.from_hf(tiny_llama(0))
    tokens = torch.randint(2, 60, (6, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))  # ids below 60: 63 is never seen
    head = dflash_head(cfg, target, rows)
    objective = dflash_objective(cfg, target, head)
    assert head.config.target_layers == (0, 1, 2)
    if overrides:
        assert head.config.mask_token_id == 3 and objective.teacher
        assert set(head.draft_vocab.target_ids.tolist()) < set(tokens.unique().tolist())
    else:  # the rarest token of the rows: one they never hold, the highest such id
        assert head.config.mask_token_id == 63
    drafter = dflash_trainer_drafter(cfg, head)
    assert drafter.k == 3 and drafter.shape.nodes == (6 if overrides else None)
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()


@pytest.mark.parametrize("override, message", [
    ("dflash.loss=mse", "dflash.loss must be ce"),
    ("dflash.gamma=0", "dflash.gamma must be > 0"),
    ("dflash.anchors=0", "dflash.anchors must be an integer >= 1"),
    ("dflash.block_size=1", "dflash.block_size must be an integer >= 2"),
    ("dflash.num_draft_tokens=9", r"num_draft_tokens must be in 1\.\.8"),
])
def test_impossible_dflash_settings_are_refused_before_anything_loads(cfg_of, override, message):
    cfg = cfg_of("train_dflash", override, "run_dir=/tmp/unused")
    with pytest.raises(ValueError, match=message):
        check_dflash_settings(cfg)


@pytest.mark.parametrize("setting", ["eagle.draft_vocab_size=32", "eagle.target_layers=[0,1,2]"])
def test_eagle1_and_2_heads_refuse_eagle3s_settings(cfg_of, setting):
    cfg = cfg_of("train_eagle", "eagle.version=2", setting, "run_dir=/tmp/unused")
    with pytest.raises(ValueError, match="are EAGLE-3's: an EAGLE-2 head reads the last hidden"):
        check_eagle_settings(cfg)
