"""The suffix entry (from_config/methods/suffix.py): its settings, its rows, the drafter a
config builds, and refusals that name the setting."""

import pytest

from selfspec import generate
from selfspec.drafters.suffix import SuffixDrafter
from selfspec.from_config.generation import build_drafter, generation_settings
from selfspec.from_config.methods.suffix import variants
from selfspec.from_config.models import load_target


def test_a_config_builds_a_suffix_drafter_whose_store_learns_across_prompts(cfg_of):
    cfg = cfg_of("generate", "drafter=suffix", "num_draft_tokens=3", "suffix.tree=true",
                 "suffix.max_tree_depth=12", "suffix.min_token_prob=0.2")
    target = load_target(cfg)
    drafter = build_drafter(cfg, target)
    assert isinstance(drafter, SuffixDrafter) and drafter.max_nodes == 3
    assert drafter.settings.tree and drafter.settings.min_token_prob == 0.2
    assert drafter.store.max_depth == 12
    prompt = [5, 9, 6, 5, 9]
    plain = generate(target, prompt, max_new_tokens=8).tokens
    for _ in range(2):  # the same drafter, its store kept
        assert generate(target, prompt, drafter=drafter, max_new_tokens=8).tokens == plain
    assert len(drafter.store.sequences) == 2 and drafter.store.sequences[0] == plain[
        :len(drafter.store.sequences[0])]


def test_a_sweep_takes_a_row_per_tree_value(cfg_of):
    cfg = cfg_of("sweep", "methods=[suffix]", "suffix.tree=[false,true]")
    assert [v.label() for v in variants(cfg)] == ["suffix", "suffix/tree"]


@pytest.mark.parametrize("override, message", [
    ("suffix.max_tree_depth=1", "suffix.max_tree_depth must be an integer >= 2"),
    ("suffix.min_token_prob=2", "min_token_prob in"),
    ("suffix.tree=[true,false]", "suffix.tree: give one value here"),
])
def test_bad_settings_name_the_setting(cfg_of, override, message):
    with pytest.raises(ValueError, match=message):
        generation_settings(cfg_of("generate", "drafter=suffix", override))
