"""scripts/objectives_table.py: the held-out tau of each run of a trainer.objective sweep, its
error, and its difference from the kl run's."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from selfspec.cli import exit_on_user_error

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "objectives_table.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("objectives_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def fake_run(folder: Path, objective: str | None, taus: list[tuple[float, float]]) -> None:
    """A finished run's recorded config and its evaluations' (tau, se), one every 10 steps."""
    folder.mkdir(parents=True)
    (folder / "run_config.json").write_text(json.dumps({"trainer": {"objective": objective}}))
    records = [{"step": 10 * (i + 1), "minutes": 1.0, "tokens_seen": 100, "eval/tau": tau,
                "eval/tau_se": se} for i, (tau, se) in enumerate(taus)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_table_reads_each_runs_last_tau_and_compares_it_with_kls(script, tmp_path, capsys):
    fake_run(tmp_path / "0", None, [(1.5, 0.2), (2.0, 0.03)])  # unset: kl
    fake_run(tmp_path / "1", "tv", [(1.6, 0.2), (2.05, 0.04)])
    script.main([str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert "| kl | 20 | 2.000 +- 0.030 |  |" in lines
    assert "| tv | 20 | 2.050 +- 0.040 | +0.050 +- 0.050 |" in lines  # sqrt(.03^2 + .04^2)
    script.main([str(tmp_path), "--out", str(tmp_path / "out" / "objectives.json")])
    rows = json.loads((tmp_path / "out" / "objectives.json").read_text())["sweeps"][str(tmp_path)]
    assert [(r["objective"], r["tau"], r["vs_kl"]) for r in rows] == [
        ("kl", 2.0, None), ("tv", 2.05, pytest.approx(0.05))]
    assert rows[1]["vs_kl_se"] == pytest.approx(0.05)
    with pytest.raises(SystemExit) as refused:
        exit_on_user_error(script.main, [str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
