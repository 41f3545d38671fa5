"""Learning curves read back from run folders (selfspec/measure/curves.py)."""

import json

from selfspec.measure.curves import final_report, judge_share, rising, tau_curve
from selfspec.tracking import Tracker


def test_a_runs_tau_curve_and_its_final_report(tmp_path):
    tracker = Tracker(tmp_path, use_wandb=False)
    tracker.log({"loss": 3.0, "minutes": 0.1, "tokens_seen": 512}, step=1)
    tracker.log({"loss": 2.0, "eval/tau": 1.4, "eval/tau_seconds": 1.0, "minutes": 0.2,
                 "tokens_seen": 1024}, step=2)
    tracker.log({"loss": 1.0, "eval/tau": 1.9, "eval/tau_se": 0.1, "eval/tau_seconds": 2.0,
                 "minutes": 0.45, "tokens_seen": 2048, "epochs": 2.0}, step=4)
    curve = tau_curve(tmp_path)
    assert curve == [
        {"step": 2, "minutes": 0.2, "tokens_seen": 1024, "epochs": None, "tau": 1.4,
         "tau_se": None, "tau_seconds": 1.0},
        {"step": 4, "minutes": 0.45, "tokens_seen": 2048, "epochs": 2.0, "tau": 1.9,
         "tau_se": 0.1, "tau_seconds": 2.0}]
    assert judge_share(curve) == 3.0 / (27.0 + 3.0)
    (tmp_path / "summary.json").write_text(json.dumps({"tau": 2.0, "speedup": 1.3}))
    assert final_report(tmp_path) == {"tau": 2.0, "speedup": 1.3}


def test_a_report_of_several_exits_gives_its_best_trained_one(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({
        "E1/norm/tau": 3.0, "E1/norm/speedup": 1.5, "E1/adapter/tau": 2.0,
        "E1/adapter/speedup": 1.1, "E2/adapter/tau": 2.5, "E2/adapter/speedup": 1.2}))
    assert final_report(tmp_path) == {"tau": 2.5, "speedup": 1.2}


def test_a_curve_is_rising_while_its_last_quarter_still_gains():
    def curve(*taus):
        return [{"tau": t} for t in taus]

    assert rising(curve(1.0, 1.2, 1.3, 1.5))
    assert not rising(curve(1.0, 1.5, 1.5, 1.49))  # flat at the end
    assert not rising(curve(1.0, 1.6, 1.4, 1.5))  # below its best
    assert not rising(curve(1.5))
