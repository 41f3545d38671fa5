"""scripts/bench_store.py: a smoke run on the tiny target (figures are the lead's to measure)."""

import importlib.util
import json
from pathlib import Path

import torch
from helpers import run_script, suite_threads

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_store.py"


def test_the_store_benchmark_reports_every_arm_as_json(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_store", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        report = bench.main(["--rows", "2", "--seq-len", "24", "--prompt-tokens", "20",
                             "--batch", "2", "--steps", "1", "--rounds", "1", "--threads",
                             str(suite_threads()), "--methods", "medusa", "eagle3",
                             "--override", "medusa:medusa.num_heads=2", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == report
    assert report["layers"] == [2, 4, 5]  # EAGLE-3's fused layers of the 8-layer tiny target
    assert set(report["generation"]["new_tokens_per_s"]) == {"plain", "storing"}
    assert report["store_build"]["tokens_per_s"] > 0
    for method in ("medusa", "eagle3"):
        rates = report["training"][method]["tokens_per_s"]
        assert rates["online"] > 0 and rates["from_store"] > 0



def test_a_bad_override_is_one_line_and_exit_2(monkeypatch, capsys):
    code, _, err = run_script("scripts/bench_store.py", ["--override", "nomethod:a=1"],
                              monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert err.startswith("error: --override 'nomethod:a=1': give METHOD:KEY=VALUE")
    assert err.count("\n") == 1
