"""The tracker (selfspec/tracking.py) without W&B: WANDB_MODE=disabled, or no wandb package
(the GPU machines have none), leaves the JSON-lines record alone, and says so once."""

import sys

import pytest

from selfspec.tracking import Tracker, read_metrics, wandb_available


def log_two_steps(run_dir) -> Tracker:
    tracker = Tracker(run_dir, use_wandb=True)
    tracker.log({"loss": 2.0}, step=1)
    tracker.log({"loss": 1.5, "medusa/head0_top1": 0.25}, step=2)
    tracker.log_summary({"tau": 1.7})
    tracker.log_media(images={"plot": run_dir / "missing.png"})  # nothing to do without W&B
    tracker.finish()
    return tracker


def test_without_the_wandb_package_the_json_lines_record_goes_on_alone(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as where it is absent
    tracker = log_two_steps(tmp_path)
    assert tracker.wandb_dir is None and not (tmp_path / "wandb").exists()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0},
                                      {"step": 2, "loss": 1.5, "medusa/head0_top1": 0.25}]
    assert (tmp_path / "summary.json").is_file()
    assert capsys.readouterr().err.count("wandb is not installed") == 1


def test_wandb_mode_disabled_keeps_the_json_lines_record_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not wandb_available()
    tracker = log_two_steps(tmp_path)
    assert tracker.wandb_dir is None and [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert "wandb" not in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["offline", None])
def test_wandb_is_available_where_the_package_is(monkeypatch, mode):
    pytest.importorskip("wandb")
    if mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    assert wandb_available()
