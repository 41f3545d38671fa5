"""Generation configs (from_config/generation.py): the target and drafter a config builds."""

import pytest
import torch
from helpers import SMALL_OVERRIDES
from omegaconf import OmegaConf

from selfspec import generate
from selfspec.drafters import NgramDrafter, SmallModelDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import build_drafter, drafter_choice
from selfspec.from_config.models import load_target


def test_load_target_and_drafters_from_a_local_folder(cfg_of, small_folder):
    cfg = cfg_of("generate", f"model.path={small_folder}", f"model.draft.path={small_folder}",
                 *SMALL_OVERRIDES)
    target = load_target(cfg)
    assert target.source == str(small_folder) and target.embed_tokens.weight.dtype == torch.float32
    assert build_drafter(cfg_of("generate", "drafter=none"), target) is None
    assert isinstance(build_drafter(cfg_of("generate", "drafter=ngram"), target),
                      NgramDrafter)
    drafter = build_drafter(cfg, target)
    assert isinstance(drafter, SmallModelDrafter) and drafter.num_draft_tokens == 4
    plain = generate(target, [0, 5, 7], max_new_tokens=6)
    spec = generate(target, [0, 5, 7], drafter=drafter, max_new_tokens=6)
    assert spec.tokens == plain.tokens
    # The draft is the target itself: each step keeps its 4 drafts (tau k + 1; the output is
    # cut to max_new_tokens after verification).
    assert (spec.stats.steps, spec.stats.accepted, spec.stats.tau) == (2, 8, 5.0)


def test_drafter_errors_say_what_to_do(cfg_of, small_folder):
    target = load_target(cfg_of("generate", f"model.path={small_folder}",
                                *SMALL_OVERRIDES))
    with pytest.raises(ValueError, match="model.draft.path=.*drafter=ngram"):
        build_drafter(cfg_of("generate", "model=mistral-7b"), target)
    with pytest.raises(ValueError, match="unknown drafter 'eagle9'"):
        build_drafter(cfg_of("generate", "drafter=eagle9"), target)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_target(cfg_of("generate", f"model.path={small_folder}", "model.dtype=fp8",
                           *SMALL_OVERRIDES))


MODEL_CFG = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")


def test_no_small_draft_model_yet_is_refused_clearly():
    cfg = OmegaConf.create({"model": MODEL_CFG, "drafter": "small_model",
                            "num_draft_tokens": 4})
    with pytest.raises(ValueError, match="'smollm2-135m' has no standard small draft model"):
        drafter_choice(cfg)
