"""The config a run folder keeps (training/checkpoints.py): a resume with other settings is
refused, naming each; settings the code added or removed since the run started are not."""

import logging

import pytest

from selfspec.errors import SelfspecError
from selfspec.training.checkpoints import config_changes, record_run_config

RUN = {"optim": {"lr": 1e-3, "steps": 10}, "trainer": {"resume": False}, "wandb": {"on": 1}}


def test_a_resume_with_changed_settings_is_refused_naming_each(tmp_path):
    record_run_config(tmp_path, RUN, resume=False)
    changed = RUN | {"optim": {"lr": 2e-3, "steps": 10}, "wandb": {"on": 0}}
    assert config_changes(tmp_path, changed, may_change=("wandb",)) == (
        "optim.lr: 0.001 in the run, 0.002 now")
    with pytest.raises(SelfspecError, match="optim.lr: 0.001 in the run, 0.002 now"):
        record_run_config(tmp_path, changed, resume=True, may_change=("wandb",))
    record_run_config(tmp_path, RUN | {"wandb": {"on": 0}}, resume=True, may_change=("wandb",))


def test_settings_added_or_removed_since_the_run_started_do_not_stop_a_resume(tmp_path, caplog):
    record_run_config(tmp_path, RUN, resume=False)
    newer = {"optim": {"lr": 1e-3, "anchor_rule": "next"}, "trainer": {"resume": True}}
    with caplog.at_level(logging.WARNING):
        assert config_changes(tmp_path, newer, may_change=("trainer.resume",)) == ""
    said = caplog.text
    assert "optim.anchor_rule='next'" in said and "optim.steps='<removed>'" in said
    assert "wandb.on='<removed>'" in said
