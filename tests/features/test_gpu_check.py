"""The GPU check's runner (scripts/gpu_check.py, gpu_check.sh): parts in order within a budget,
each under its own timeout (its whole process group stopped), a failing part never stopping
the next, at most a few flat files written; the plan printed on any machine; and the real
parts' commands checked here, so a lent GPU is never spent on a typo."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.sweeps import floor_settings

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(spec))
spec.loader.exec_module(gpu_check)
Part = gpu_check.Part

PY = shlex.quote(sys.executable)


def headline(figures: dict) -> str:
    return f"value {figures['value']}"


def running(pid: int) -> bool:
    """Whether the process runs (a zombie left to a parent that does not reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 1)
    monkeypatch.setattr(gpu_check, "KILL_GRACE_S", 2)


def test_parts_run_in_order_and_a_failure_or_a_timeout_never_stops_the_next(tmp_path, fast):
    parts = [
        Part("fails", 10, "echo going wrong; exit 3", "r.json", headline, needs_cuda=False),
        Part("hangs", 2, "sleep 300 & echo $! > {run}/child.pid; wait", "r.json", headline,
             needs_cuda=False),
        Part("works", 10, f"{PY} -c \"import json; json.dump({{'value': 7}}, "
                          f"open('{{run}}/r.json', 'w'))\"", "r.json", headline,
             needs_cuda=False),
        Part("gpu", 10, "exit 0", "r.json", headline),
    ]
    out = tmp_path / "out"
    start = time.monotonic()
    outcomes = gpu_check.run_parts(parts, out, budget_s=60, cuda=False, work=tmp_path / "w")
    assert time.monotonic() - start < 20
    assert {n: o.status for n, o in outcomes.items()} == {
        "fails": "failed (exit 3)", "hangs": "timeout", "works": "ok",
        "gpu": "skipped (no CUDA device)"}
    assert outcomes["works"].headline == "value 7" and outcomes["works"].figures == {"value": 7}
    child = int((tmp_path / "w" / "hangs" / "child.pid").read_text())
    time.sleep(0.5)
    assert not running(child)  # the part's whole process group was stopped
    log = (out / "gpu_check.log").read_text()
    assert "going wrong" in log and "===== hangs: timeout" in log
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["parts"]["works"]["figures"] == {"value": 7}
    assert "works" in (out / "summary.txt").read_text()


def test_what_comes_back_is_a_few_flat_files_of_plain_names(tmp_path, fast):
    parts = [Part(f"p{i}", 5, f"echo {i} > {{run}}/a.txt", "r.json", headline,
                  needs_cuda=False) for i in range(12)]
    gpu_check.run_parts(parts, tmp_path / "out", budget_s=60, cuda=False, work=tmp_path / "w")
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["gpu_check.json", "gpu_check.log", "runs.tar.gz",
                                             "summary.txt"]
    assert all(p.parent == tmp_path / "out" and re.fullmatch(r"[A-Za-z0-9._-]+", p.name)
               and p.stat().st_size < 16 << 20 for p in files)


@pytest.mark.slow  # 4 s of real timeouts; the order-and-timeout test covers the runner quick
def test_parts_past_the_budget_are_cut_short_or_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 3)
    parts = [Part("long", 60, "sleep 30", "r.json", headline, needs_cuda=False),
             Part("late", 60, "exit 0", "r.json", headline, needs_cuda=False)]
    outcomes = gpu_check.run_parts(parts, tmp_path / "out", budget_s=4, cuda=False,
                                   work=tmp_path / "w")
    assert outcomes["long"].status == "timeout" and outcomes["long"].seconds < 10
    assert outcomes["late"].status.startswith("skipped (") and "budget left" in \
        outcomes["late"].status


def test_junit_results_become_counts_and_failures(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite time="3.5">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2'
        '&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="no"/></testcase>'
        '<testcase classname="tests.test_b" name="test_err"><error message="boom"/></testcase>'
        '</testsuite></testsuites>')
    counts = gpu_check.read_figures(path)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["errors"]) == \
        (1, 1, 1, 1)
    assert counts["failures"][0] == {"test": "tests.test_a::test_bad",
                                     "message": "assert 1 == 2"}
    assert gpu_check.tests_headline(counts) == \
        "1 passed, 1 failed, 1 errors, 1 skipped; first: test_bad"


def test_a_run_splits_into_result_files(tmp_path):
    record = {"written": "2026-11-27 10:00:00", "parts": {
        "bench": {"status": "ok", "seconds": 90.0, "headline": "plain 115 tok/s",
                  "figures": {"plain_tokens_per_s": 115.0}},
        "trainers": {"status": "skipped (no CUDA device)", "seconds": 0, "headline": "",
                     "figures": None}}}
    (tmp_path / "gpu_check.json").write_text(json.dumps(record))
    written = gpu_check.split(tmp_path / "gpu_check.json", tmp_path / "results", "h100")
    assert [p.name for p in written] == ["h100_bench.json", "h100_gpu_check_summary.txt"]
    assert json.loads(written[0].read_text()) == {"plain_tokens_per_s": 115.0}
    assert "skipped (no CUDA device)" in written[1].read_text()


def test_the_plan_lists_every_part_with_its_timeout_and_refuses_unknown_ones():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "plan"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    for part in gpu_check.PARTS:
        assert re.search(rf"^{part.name} +timeout +{part.timeout_s} s", done.stdout, re.M)
    assert f"budget: {gpu_check.BUDGET_S} s" in done.stdout
    wrong = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "plan", "benhc"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHON": sys.executable})
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: unknown part benhc")
    assert [p.name for p in gpu_check.chosen(["tests"])] == ["cuda_tests", "trainers"]


def test_the_parts_come_in_order_of_value_and_the_first_ones_fit_the_budget():
    names = [p.name for p in gpu_check.PARTS]
    assert names[:6] == ["preflight", "exact", "cuda_tests", "diagnosis", "trainers", "bench"]
    assert sum(p.timeout_s for p in gpu_check.PARTS[:4]) <= gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S <= 8 * 60
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[a-z_]+", n) for n in names)


def part_arguments(part) -> list[str]:
    """The words of a part's command, without its shell substitutions."""
    return shlex.split(re.sub(r"\$\([^)]*\)", "", part.command))


def test_every_test_a_part_names_exists():
    for part in gpu_check.PARTS:
        for argument in part_arguments(part):
            if argument.startswith("tests/"):
                path, _, test = argument.partition("::")
                assert (ROOT / path).is_file(), argument
                assert not test or f"def {test}(" in (ROOT / path).read_text(), argument


@pytest.mark.parametrize("part", [p for p in gpu_check.PARTS
                                  if "eval/bench_decode.py" in p.command], ids=lambda p: p.name)
def test_every_bench_parts_settings_compose_and_pass_their_checks(part):
    overrides = [a for a in part_arguments(part)[2:] if not a.startswith("hydra.run.dir")]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench_decode", overrides=overrides)
    settings = floor_settings(cfg)  # every check that runs before a model loads
    assert cfg.model.name == "random-7b" and cfg.device == "cuda"
    if part.name == "bench":
        assert settings.cost_lengths == tuple(range(1, 129)) and settings.methods
    if part.name == "batch":
        assert settings.batch_sizes == (1, 2, 4, 8, 16, 32)


@pytest.mark.parametrize("script", ["scripts/bucket_invariance.py",
                                    "scripts/bench_quantized_target.py"])
def test_the_scripts_parts_run_take_their_options(script):
    (part,) = [p for p in gpu_check.PARTS if script in p.command]
    arguments = part_arguments(part)[2:]
    source = (ROOT / script).read_text()
    for option in (a for a in arguments if a.startswith("--")):
        assert f'"{option}"' in source, option


SMALL = ["device=cpu", "threads=1", "model.arch.hidden_size=64", "model.arch.intermediate_size=128",
         "model.arch.num_layers=2", "model.arch.num_heads=4", "model.arch.num_kv_heads=4",
         "model.arch.vocab_size=256"]


def run_script(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_diagnosis_script_runs_on_the_cpu_in_every_mode(tmp_path, dtype):
    """The diagnosis part's script, its every mode (compiled: inductor's CPU backend), on a
    small random Llama: its first run is not the GPU's."""
    out = tmp_path / "diagnosis.json"
    done = run_script(["scripts/bucket_invariance.py", "--buckets", "2", "4", "--cache-lengths",
                       "16", "24", "--new-tokens", "12", "--draft-lengths", "1", "3", "--out",
                       str(out), f"model.dtype={dtype}", *SMALL])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["eager", "compiled", "compiled_emulated", "invariant"]
    for mode in report["modes"].values():
        assert all(d["lossless"] for d in mode["decode"]), mode["verdict"]
    assert gpu_check.diagnosis_headline(report).count("lossless") == 8
    assert done.stdout.count("Decoding: k=1 lossless") == 4


@pytest.mark.slow
def test_the_quantized_part_runs_on_the_cpu(tmp_path):
    out = tmp_path / "quantized.json"
    done = run_script(["scripts/bench_quantized_target.py", "--model", "random-7b",
                       "--prompts", "1", "--new-tokens", "8", "--prompt-tokens", "16", "--out",
                       str(out), "model.dtype=fp32", *SMALL[2:]])
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert list(figures["tokens_per_s"]) == ["fp32", "int8", "int4"]
    assert "int8 per row" in figures["layouts"]["int8"]
    assert gpu_check.quantized_headline(figures).startswith("fp32 ")


def test_a_headline_counts_the_outputs_that_parted_and_how_many_at_near_ties():
    tie = {"prompt": 0, "position": 9, "top2_gap": 0.03, "tolerance": 0.2, "near_tie": True}
    rows = [{"lossless": True}, {"lossless": False, "first_difference": tie},
            {"lossless": False, "first_difference": tie | {"near_tie": False}},
            {"lossless": False}]  # a record from before first_difference existed
    assert gpu_check.lossless_said(rows[:1]) == ""
    assert gpu_check.lossless_said(rows) == "; NOT lossless in 3 (1 at near-ties, 1 not examined)"


@pytest.mark.slow
def test_the_families_part_runs_on_the_cpu(tmp_path):
    """scripts/bench_families.py on one preset (the MTP target): its figures and the part's
    headline, lossless in fp32."""
    out = tmp_path / "families.json"
    done = run_script(["scripts/bench_families.py", "--out", str(out), "--device", "cpu",
                       "--presets", "random-mtp", "--new-tokens", "8"])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["presets"]) == ["random-mtp"]
    assert [m["method"] for m in report["presets"]["random-mtp"]["methods"]] == ["mtp"]
    assert gpu_check.families_headline(report).startswith("random-mtp: plain ")
    assert gpu_check.families_headline(report).endswith("lossless")
    assert gpu_check.families_headline({"presets": {"x": {"error": "boom"}}}) == "x: error: boom"
