"""eval/sweep.py on the toy target: results files, plots, an offline W&B run, the Hugging
Face peers, multirun folders, rows over draft vocabularies, an auto row chosen on other
prompts, and bad input refused before any model loads."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import EVAL, HAS_WANDB, load_entry, suite_threads, toy
from matplotlib.image import imread

from selfspec.heads.draft_vocab import save_token_counts
from selfspec.measure.grid import COLUMNS, SweepRow
from selfspec.measure.results import format_table, split_percent
from selfspec.metrics import OTHER, PHASES

PLOTS = ("acceptance_vs_draft_length", "tokens_per_s_vs_draft_length",
         "speedup_at_best_draft_length", "acceptance_by_position", "speedup_vs_bound")


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, quick_build, cfg_of) -> Path:
    """2 methods x draft lengths [1, 2] x greedy and t1, 2 prompts, 8 new tokens."""
    run_dir = tmp_path_factory.mktemp("sweep")
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[small_model,ngram]",
                 "num_draft_tokens=[1,2]", "samplings=[greedy,t1]", "bench.num_prompts=2",
                 "bench.max_new_tokens=8", f"run_dir={run_dir}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        load_entry("sweep").run(cfg)
    return run_dir


# ---- the sweep's outputs ---------------------------------------------------------------------


def test_results_json_has_every_grid_row(sweep_dir):
    results = json.loads((sweep_dir / "results.json").read_text())
    rows = results["rows"]
    grid = {(r["method"], r["draft_length"], r["sampling"]) for r in rows}
    assert grid == {(m, k, s) for m in ("small_model", "ngram") for k in (1, 2)
                    for s in ("greedy", "t1")}
    for row in rows:
        # tau from the steps: each keeps its accepted drafts and adds one token, the last
        # step's cut to the 8 new tokens after verification
        steps, k = sum(row["nodes_histogram"]), row["draft_length"]
        assert row["new_tokens"] <= row["tau"] * steps <= row["new_tokens"] + 2 * k
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert len(row["acceptance_by_position"]) == row["draft_length"]
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["baseline_tokens_per_s"])
        assert row["new_tokens"] == 16 and row["prompts"] == 2 and row["baseline"] == "plain"
        assert row["peak_memory_mb"] > 0 and row["memory_measure"] == "cpu_peak_rss_sampled"
        assert 0.0 <= row["draft_time_share"] < 1.0 and row["target_forwards_per_token"] > 0
        assert row["lossless"] is (True if row["sampling"] == "greedy" else None)
    machine = results["machine"]
    assert machine["cpu_count"] == os.cpu_count()  # the machine it ran on, not a default
    assert machine["torch_threads"] == suite_threads()  # threads=null: the caller's threads
    assert machine["torch_version"]
    assert len(results["prompt_ids"]) == 2


def saved_bound(row: dict, profile: dict) -> float:
    """A row's bound recomputed from results.json alone: tau / (the mean over its steps of
    c(N + 1), c taken at the next measured length, + its draft time in one-token forwards)."""
    c = {int(n): value for n, value in profile["c"].items()}
    steps = sum(row["nodes_histogram"])
    forward = sum(count * c[min(m for m in c if m >= n + 1)]
                  for n, count in enumerate(row["nodes_histogram"])) / steps
    draft = (row["draft_ms_per_step"] or 0.0) / profile["one_token_ms"]
    return row["tau"] / (forward + draft)


def test_rows_carry_the_time_split_the_bound_and_the_efficiency(sweep_dir):
    results = json.loads((sweep_dir / "results.json").read_text())
    profile = results["cost_profile"]
    assert profile["device"] == "cpu" and profile["one_token_ms"] > 0
    prompts_and_half = profile["cache_length"]  # mean prompt length + half of 8 new tokens
    assert prompts_and_half > 4
    assert max(map(int, profile["c"])) >= 3  # k = 2: forwards of 3 tokens
    for row in results["rows"]:
        split = row["time_split"]
        assert set(split) == {*PHASES, OTHER}
        assert all(split[p]["s_per_step"] > 0 for p in PHASES), split  # every phase ran
        assert sum(p["share"] for p in split.values()) == pytest.approx(1.0)
        assert split["draft"]["share"] == pytest.approx(row["draft_time_share"])
        assert sum(row["nodes_histogram"]) > 0
        assert row["nodes_per_step"] <= row["draft_length"]
        assert row["draft_cost"] == pytest.approx(row["draft_ms_per_step"]
                                                  / profile["one_token_ms"])
        assert row["bound"] == pytest.approx(saved_bound(row, profile))
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["bound"])
    table = format_table([SweepRow(**r) for r in results["rows"]])
    assert "bound" in table and "pre/draft/fwd/probs/verify/commit/other" in table
    assert split_percent(results["rows"][0]["time_split"]) in table


def test_results_csv_has_the_columns_and_a_line_per_row(sweep_dir):
    with (sweep_dir / "results.csv").open() as f:
        reader = csv.DictReader(f)
        lines = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    assert {"tau", "acceptance_rate", "acceptance_by_position", "tokens_per_s", "speedup",
            "target_forwards_per_token", "draft_time_share", "peak_memory_mb",
            "repeated_4gram_share", "lossless"} <= set(COLUMNS)
    assert len(lines) == 8
    assert all(len(json.loads(line["acceptance_by_position"])) >= 1 for line in lines)


def test_plots_are_readable_pngs(sweep_dir):
    for name in PLOTS:
        path = sweep_dir / f"{name}.png"
        assert path.stat().st_size > 1000
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.skipif(not HAS_WANDB, reason="needs wandb")
def test_offline_wandb_run_holds_the_table_and_plots(sweep_dir):
    (run,) = list((sweep_dir / "wandb").glob("offline-run-*"))
    assert list(run.glob("run-*.wandb"))
    media = run / "files" / "media"
    images = [p.name for p in media.rglob("*.png")]
    assert len(images) == len(PLOTS)
    assert all(any(image.startswith(name) for image in images) for name in PLOTS)
    assert list(media.rglob("results_*.table.json"))
    records = [json.loads(line) for line in (sweep_dir / "metrics.jsonl").read_text().split("\n")
               if line]
    assert [r["step"] for r in records] == list(range(8))
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert "small_model/greedy" in summary["best"]
    assert summary["machine"] == json.loads((sweep_dir / "results.json").read_text())["machine"]


def test_hf_peers_and_medusa_on_a_self_draft(tmp_path, quick_build, cfg_of, heads_dir):
    """With the target as its own draft, drafts are accepted: lossless is then meaningful."""
    cfg = cfg_of("sweep", *toy(quick_build, draft="target"), f"medusa_heads={heads_dir}",
                 "methods=[small_model,hf_assisted,hf_prompt_lookup,medusa,ngram]",
                 "num_draft_tokens=[2,3]", "samplings=[greedy]", "bench.num_prompts=2",
                 "bench.max_new_tokens=12", "wandb.enabled=false", f"run_dir={tmp_path}")
    load_entry("sweep").run(cfg)
    rows = {(r["method"], r["draft_length"]): r
            for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert ("medusa", 3) not in rows  # 2 heads: length 3 folds into the depth-2 tree
    assert rows["medusa", 2]["draft_nodes"] == 10  # medusa_small's nodes of depth <= 2
    assert all(r["lossless"] is True for r in rows.values())
    for method, k in (("small_model", 2), ("small_model", 3), ("hf_assisted", 2),
                      ("hf_assisted", 3)):  # a self-draft is always accepted
        assert rows[method, k]["acceptance_rate"] == 1.0 and rows[method, k]["tau"] == k + 1
    for method in ("ngram", "hf_prompt_lookup"):  # lookup on the toy target's code: measured
        assert rows[method, 3]["tau"] > 1.1  # 1.30 and 1.14
    for method, peer in (("hf_assisted", "small_model"), ("hf_prompt_lookup", "ngram")):
        row = rows[method, 2]
        assert row["baseline"] == "hf_plain"
        assert row["ours_over_hf"] == pytest.approx(rows[peer, 2]["tokens_per_s"]
                                                    / row["tokens_per_s"])
    assert rows["hf_assisted", 2]["draft_time_share"] > 0
    assert rows["hf_prompt_lookup", 2]["draft_time_share"] is None  # not measurable
    profile = json.loads((tmp_path / "results.json").read_text())["cost_profile"]
    assert max(map(int, profile["c"])) >= 11  # medusa_small's 10 nodes of depth <= 2, + 1
    for row in rows.values():
        assert (row["time_split"] is None) == row["method"].startswith("hf_")
        assert row["bound"] == pytest.approx(saved_bound(row, profile))
    lookup = rows["hf_prompt_lookup", 2]
    assert lookup["draft_cost"] is None and lookup["bound"] > 0  # a draft that costs nothing


def test_a_sweep_over_batch_sizes_compares_each_batch_with_its_own_plain_decoding(
        tmp_path, quick_build, cfg_of):
    """bench.batch_sizes=[1,2,3]: rows per batch size, lossless at each, every row's bound
    from c_B(N) of its own batch size, per-prompt latencies, the Hugging Face plain peer of
    the same batch, and the speedup-against-batch-size figure."""
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[ngram,small_model,hf_plain]",
                 "num_draft_tokens=[2]", "samplings=[greedy]", "bench.num_prompts=3",
                 "bench.max_new_tokens=10", "bench.batch_sizes=[1,2,3]", "wandb.enabled=false",
                 f"run_dir={tmp_path}")
    load_entry("sweep").run(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["method"], r["batch_size"]): r for r in results["rows"]}
    assert set(rows) == {(m, b) for m in ("ngram", "small_model", "hf_plain") for b in (1, 2, 3)}
    profiles = results["cost_profiles"]
    assert sorted(map(int, profiles)) == [1, 2, 3]
    for (method, batch), row in rows.items():
        assert row["lossless"] is True, (method, batch)  # every row its prompt's own output
        assert row["prompts"] == 3 and 0 < row["latency_s_mean"] <= row["latency_s_p90"]
        if method != "hf_plain":
            assert row["bound"] == pytest.approx(saved_bound(row, profiles[str(batch)]))
            assert row["tau"] == rows[method, 1]["tau"]  # the same outputs, batched or not
    assert rows["hf_plain", 2]["baseline"] == "plain"
    assert (tmp_path / "speedup_vs_batch_size.png").stat().st_size > 10_000


@pytest.mark.slow
def test_multirun_writes_a_folder_per_job(tmp_path, quick_build):
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run(
        [sys.executable, str(EVAL / "sweep.py"), "-m", *toy(quick_build), "methods=ngram",
         "num_draft_tokens=1,2", "samplings=[greedy]", "bench.num_prompts=1",
         "bench.max_new_tokens=4", "wandb.enabled=false", f"threads={suite_threads()}",
         "cost_profile=false", f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for job, k in (("0", 1), ("1", 2)):
        results = json.loads((tmp_path / job / "results.json").read_text())
        (row,) = results["rows"]
        assert (row["method"], row["draft_length"]) == ("ngram", k)
        # cost_profile=false: no profile, no bound, no speedup-vs-bound plot; the split stays
        assert results["cost_profile"] is None and row["bound"] is row["efficiency"] is None
        assert not (tmp_path / job / "speedup_vs_bound.png").exists()
        assert row["time_split"]["forward"]["share"] > 0


def test_small_model_rows_over_draft_vocabularies_are_lossless(tmp_path, quick_build, cfg_of):
    """small_model.draft_vocab adds a small_model/V{K} row per size, chosen from the token
    counts saved beside the draft model, and first_candidates a /top{W} row per count."""
    draft = tmp_path / "draft"
    shutil.copytree(quick_build / "draft", draft)
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    save_token_counts(draft, torch.arange(vocab).flip(0))  # low ids most frequent
    cfg = cfg_of("sweep", *toy(quick_build), f"model.draft.path={draft}",
                 "methods=[small_model]", "small_model.draft_vocab=[null,40]",
                 "small_model.first_candidates=[1,3]", "num_draft_tokens=[2]",
                 "samplings=[greedy]", "bench.num_prompts=2", "bench.max_new_tokens=8",
                 "cost_profile=false", f"run_dir={tmp_path / 'run'}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        load_entry("sweep").run(cfg)
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"small_model", "small_model/top3", "small_model/V40",
                                           "small_model/V40/top3"}
    assert all(r["lossless"] is True for r in rows)
    shutil.rmtree(draft)
    (draft / "config.json").parent.mkdir()
    shutil.copytree(quick_build / "draft", draft, dirs_exist_ok=True)  # no counts now
    with pytest.raises(FileNotFoundError, match="token_counts.safetensors not found"):
        load_entry("sweep").run(cfg)


def test_a_sweep_adds_an_auto_row_chosen_on_other_prompts(tmp_path, quick_build,
                                                          cfg_of):
    cfg = cfg_of("sweep", *toy(quick_build), "methods=[ngram]", "num_draft_tokens=[1,3,auto]",
                 "samplings=[greedy]", "bench.num_prompts=2", "bench.max_new_tokens=8",
                 "auto.calibration_prompts=2", "wandb.enabled=false", f"run_dir={tmp_path}")
    load_entry("sweep").run(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in results["rows"] if r["method"] == "ngram/auto"}
    fixed = [r for r in results["rows"] if r["method"] == "ngram"]
    auto = rows["ngram/auto"]
    assert [e["size"] for e in auto["auto_choice"]["estimates"]] == [1, 3]
    assert auto["draft_length"] == auto["auto_choice"]["size"] in (1, 3)
    assert auto["auto_vs_best"] == pytest.approx(
        auto["speedup"] / max(r["speedup"] for r in fixed))
    assert auto["lossless"] is True and auto["bound"] is not None
    calibration, evaluated = results["calibration_prompt_ids"], results["prompt_ids"]
    assert len(calibration) == 2 and not set(calibration) & set(evaluated)


# ---- bad input, refused before any model loads -----------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["methods=[small_model,layerskip]"], "unknown method(s) ['layerskip']"),
        (["methods=[eagle]"], "eagle needs a trained head: set eagle_head="),
        (["methods=[eagle]", "eagle_head=/nonexistent/export"], "no head_config.json"),
        (["methods=[eagle]", "eagle_head={empty_dir}", "num_draft_tokens=[2,13]"],
         "eagle.total_tokens (12) < the longest draft length (13)"),
        (["num_draft_tokens=[2,0]"], "num_draft_tokens must be integers >= 1"),
        (["num_draft_tokens=-1"], "num_draft_tokens must be integers >= 1"),
        (["samplings=[greedy,hot]"], "unknown sampling setting 'hot'"),
        (["methods=[medusa]"], "medusa needs trained heads: set medusa_heads="),
        (["methods=[medusa]", "medusa_heads=/nonexistent/export"], "no head_config.json"),
        (["data=mt_bench", "data.path=/nonexistent/questions.jsonl"], "file not found"),
        (["data=mt_bench", "data.path={empty}"], "holds no questions"),
        (["baseline=sometimes"], "unknown baseline mode"),
        (["small_model.draft_vocab=[null,0]"], "small_model.draft_vocab: give token counts >= 1"),
        (["small_model.first_candidates=[1,0]"],
         "small_model.first_candidates: give candidate counts >= 1"),
        (["split_time=sometimes"], "split_time must be true, false or null"),
        (["cuda_graphs=sometimes"], "cuda_graphs must be true, false or null"),
        (["ngram.corpus=/no/such/answers.jsonl"], "ngram.corpus: no file at /no/such/answers"),
        (["ngram.tree_nodes=0"], "ngram.tree_nodes must be an integer >= 1"),
        (["ngram.corpus_length=0"], "ngram.corpus_length must be an integer >= 1"),
        (["methods=[ngram+medusa]"], "ngram+medusa needs trained heads: set medusa_heads="),
        (["methods=[ngram+medusa]", "medusa_heads={empty_dir}", "ngram.merged_nodes=0"],
         "ngram.merged_nodes must be an integer >= 1"),
        (["methods=[ngram+medusa]", "medusa_heads={empty_dir}", "ngram.medusa_choices=[[1,0]]"],
         "ngram.medusa_choices: give Medusa choices"),
        (["cost_profile=2"], "cost_profile must be true or false"),
        (["bench.batch_sizes=[1,0]"], "bench.batch_sizes: give integers >= 1"),
        (["methods=[hf_assisted]", "bench.batch_sizes=[1,2]"],
         "hf_assisted decode one prompt at a time"),
        (["num_draft_tokens=[auto]"], "num_draft_tokens must be integers >= 1 (and optionally"),
        (["num_draft_tokens=[2,auto]", "cost_profile=false"], "predicts speedups from the cost"),
        (["num_draft_tokens=[2,auto]", "data.num_prompts=4", "bench.num_prompts=4"],
         "auto draft lengths need auto.calibration_prompts >= 1 prompts after the 4 evaluated"),
    ],
)
def test_bad_input_is_refused_before_any_model_loads(
    tmp_path, quick_build, cfg_of, monkeypatch, overrides, message
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "head_config.json").write_text("{}")
    overrides = [o.replace("{empty}", str(empty)).replace("{empty_dir}", str(tmp_path / "export"))
                 for o in overrides]
    entry = load_entry("sweep")

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr(entry, "load_sweep_models", no_loading)
    cfg = cfg_of("sweep", *toy(quick_build), *overrides, f"run_dir={tmp_path / 'run'}")
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        entry.run(cfg)
    assert message in str(info.value)
    assert not (tmp_path / "run").exists()
