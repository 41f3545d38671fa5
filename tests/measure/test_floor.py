"""The floor benchmark (measure/floor.py): plain speeds, the cost profile, the oracle's rows."""

import pytest
from helpers import tiny_llama

from selfspec.from_config.sweeps import oracle_trees
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
    figures = measure_floor(target, hf_model, settings)
    assert figures["plain_tokens_per_s"] > 0 and figures["hf_plain_tokens_per_s"] > 0
    assert figures["peak_memory_mb"] > 0 and figures["peak_memory_kind"].startswith("cpu_")
    assert list(figures["cost_profile"]["c"]) == [1, 2, 4, 64]
    assert [r["k"] for r in figures["oracle"]] == [1, 3]
    for row in figures["oracle"]:
        assert row["lossless"] is True and row["tau"] > 1
        assert row["bound"] == pytest.approx(
            row["tau"] / figures["cost_profile"]["c"][2 if row["k"] == 1 else 4])
        assert 0 < row["time_split"]["forward"]["share"] < 1  # the oracle's steps, split
    (row,) = figures["oracle_trees"]
    assert (row["tree"], row["nodes"], row["depth"], row["lossless"]) == ("small", 3, 2, True)
    assert row["tau"] > 2 and row["bound"] == pytest.approx(
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
    with pytest.raises(ValueError, match="methods: unknown \\['eagle9'\\]; choose from eagle2,"):
        FloorSettings(methods=("eagle9",))
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
