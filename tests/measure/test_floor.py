"""The floor benchmark (measure/floor.py): plain speeds, the cost profile, the oracle's rows."""

import pytest
from helpers import tiny_llama

from selfspec.from_config.methods import cost_rows
from selfspec.from_config.sweeps import floor_settings, oracle_trees
from selfspec.measure.floor import FloorSettings, measure_floor
from selfspec.model import Transformer


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))


def test_the_floor_benchmark_reports_plain_speeds_costs_and_the_oracle(target):
    hf_model = tiny_llama(0, vocab=96, layers=2)  # the weights `target` was converted from
    tree = ((0,), (1,), (0, 0))
    settings = FloorSettings(prompt_tokens=12, new_tokens=8, num_prompts=1, repeats=1,
                             draft_lengths=(1, 3), cost_lengths=(1, 2, 4, 64),
                             oracle_trees=(("small", tree),),
                             methods=("eagle2", "medusa", "dflash"),
                             method_tree=tree)
    figures = measure_floor(target, hf_model, settings, cost_rows())
    assert figures["plain_tokens_per_s"] > 0 and figures["hf_plain_tokens_per_s"] > 0
    assert figures["peak_memory_mb"] > 0 and figures["peak_memory_kind"].startswith("cpu_")
    assert list(figures["cost_profile"]["c"]) == [1, 2, 4, 64]
    assert figures["batches"] == [] and figures["memory_floor"]["floor_ms"] > 0
    assert [r["k"] for r in figures["oracle"]] == [1, 3]
    for row in figures["oracle"]:  # it proposes the target's own answer: all accepted
        assert row["lossless"] is True and row["tau"] == row["k"] + 1  # 8 = whole steps
        assert row["bound"] == pytest.approx(
            row["tau"] / figures["cost_profile"]["c"][2 if row["k"] == 1 else 4])
        assert 0 < row["time_split"]["forward"]["share"] < 1  # the oracle's steps, split
    (row,) = figures["oracle_trees"]
    assert (row["tree"], row["nodes"], row["depth"], row["lossless"]) == ("small", 3, 2, True)
    # two deep: every step keeps the oracle's two tokens and adds one
    assert row["tau"] == 3.0 and row["bound"] == pytest.approx(
        row["tau"] / figures["cost_profile"]["c"][4])
    eagle2, medusa, dflash = figures["methods"]
    assert (eagle2["method"], eagle2["nodes"], medusa["nodes"]) == ("eagle2", 60, 3)
    # DFlash drafts 8 tokens in one forward: its cost is its one level's
    assert (dflash["nodes"], dflash["lossless"], dflash["published_tau"]) == (8, True, None)
    assert dflash["draft_cost_per_level"] == dflash["draft_cost"] > 0
    for row in (eagle2, medusa):
        assert row["lossless"] is True and row["draft_cost"] > 0
        assert row["step_cost"] == pytest.approx(row["c_verify"] + row["draft_cost"])
        assert row["projected_speedup"] == pytest.approx(row["published_tau"] / row["step_cost"])
    assert eagle2["draft_cost_per_level"] == pytest.approx(eagle2["draft_cost"] / 6)
    assert eagle2["c_verify"] == figures["cost_profile"]["c"][64]
    with pytest.raises(ValueError, match="methods: unknown \\['eagle9'\\]; choose from "):
        measure_floor(target, hf_model, FloorSettings(methods=("eagle9",)), cost_rows())
    with pytest.raises(ValueError, match="cost_lengths must reach 4 for the oracle tree small"):
        FloorSettings(cost_lengths=(1, 2), draft_lengths=(1,), oracle_trees=(("small", tree),))
    assert [name for name, _ in oracle_trees(["eagle2", "medusa_63"])] == ["eagle2", "medusa_63"]
    assert len(oracle_trees(["medusa_63"])[0][1]) == 63
    with pytest.raises(ValueError, match="unknown tree 'top_k_products': choose from eagle2, "):
        oracle_trees(["top_k_products"])
    with pytest.raises(ValueError, match="cost_lengths must reach max"):
        FloorSettings(draft_lengths=(8,), cost_lengths=(1, 4))
    with pytest.raises(ValueError, match="cuda_graphs must be true, false or null, got 'yes'"):
        FloorSettings(cuda_graphs="yes")


def test_the_memory_floor_counts_what_a_token_reads_at_the_measured_bandwidth(target):
    from selfspec.measure.costs import CostProfile
    from selfspec.measure.floor import bytes_read_per_token, copy_bandwidth, measure_memory_floor

    config = target.config
    weights, kv = bytes_read_per_token(target, 100)
    every = sum(p.numel() * 4 for p in target.parameters())
    table = config.vocab_size * config.hidden_size * 4  # all but one row of it is not read
    assert weights == every - table + config.hidden_size * 4
    assert kv == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 100 * 4
    tied = Transformer.from_hf(tiny_llama(0, vocab=96, layers=2))
    tied.lm_head.weight = tied.embed_tokens.weight  # one table: the LM head reads it whole
    assert bytes_read_per_token(tied, 1)[0] == sum(p.numel() * 4 for p in tied.parameters())
    assert copy_bandwidth("cpu", 1 << 20, repeats=3, warmup=1) > 1e8  # > 0.1 GB/s anywhere
    profile = CostProfile({1: 0.004}, 100, "cpu", "float32")
    floor = measure_memory_floor(target, profile, plain_tokens_per_s=125.0, nbytes=1 << 20)
    seconds = (weights + kv) / floor["copy_bytes_per_s"]
    assert floor["floor_ms"] == pytest.approx(1000 * seconds)
    assert floor["share_of_one_token_forward"] == pytest.approx(seconds / 0.004)
    assert floor["share_of_plain_decoding"] == pytest.approx(seconds * 125.0)


def test_the_batch_curve_runs_plain_and_the_oracle_over_each_batch(target):
    from selfspec.measure.floor import measure_batches

    settings = FloorSettings(prompt_tokens=10, new_tokens=9, repeats=1, batch_sizes=(1, 3),
                             batch_draft_tokens=2, cost_lengths=(1, 16))
    rows = measure_batches(target, settings)
    assert [r["batch_size"] for r in rows] == [1, 3]
    for row in rows:
        assert row["lossless"] is True and row["tau"] == pytest.approx(9 / 3)  # full chains
        assert row["speedup"] == pytest.approx(row["oracle_tokens_per_s"]
                                               / row["plain_tokens_per_s"])
        assert row["c_verify"] > 0 and row["bound"] == pytest.approx(row["tau"] / row["c_verify"])
    assert measure_batches(target, FloorSettings()) == []
    with pytest.raises(ValueError, match="batch_sizes and batch_draft_tokens must be >= 1"):
        FloorSettings(batch_sizes=(0,))


def test_bench_decode_names_only_the_methods_that_give_a_cost_row(cfg_of):
    rows = cost_rows()
    assert {"eagle2", "eagle3", "eagle1", "medusa", "early_exit", "dflash", "mtp"} <= set(rows)
    assert rows["eagle2"].published_tau == 4.98 and rows["dflash"].published_tau is None
    assert floor_settings(cfg_of("bench_decode", "methods=[eagle2,dflash]")).methods == (
        "eagle2", "dflash")
    with pytest.raises(ValueError, match="methods: unknown \\['eagle9'\\]; choose from "):
        floor_settings(cfg_of("bench_decode", "methods=[eagle9]"))
