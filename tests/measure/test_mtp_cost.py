"""The MTP module's draft cost beside EAGLE's (measure/method_costs.py): the same EAGLE-2 tree
over the target's own module and over a random EAGLE-1 head of the same layer's size."""

import pytest
from mtp_reference import mtp_target

from selfspec.from_config.methods import cost_rows
from selfspec.measure.costs import CostProfile
from selfspec.measure.method_costs import method_cost_row


@pytest.mark.slow  # ~0.8 s: two timed generations each
def test_the_mtp_module_drafts_an_eagle2_tree_at_a_measured_cost():
    target = mtp_target("nextn", seed=1, vocab=96)
    profile = CostProfile({1: 1.0, 64: 2.0}, cache_length=16, device="cpu", dtype="fp32")
    rows = [method_cost_row(name, cost_rows()[name], target, ((0,),), [[3, 9, 4, 17, 5]],
                            new_tokens=6,
                            profile=profile, seed=0, cuda_graphs=False)
            for name in ("mtp", "eagle2")]
    for row in rows:
        assert (row["nodes"], row["lossless"], row["c_verify"]) == (60, True, 2.0)
        assert row["draft_cost"] > 0 and row["draft_cost_per_level"] == pytest.approx(
            row["draft_cost"] / 6)
    assert rows[0]["drafts"].startswith("the target's own MTP module")
    with pytest.raises(ValueError, match="the target has no MTP modules"):
        method_cost_row("mtp", cost_rows()["mtp"], mtp_target(None, modules=0), ((0,),),
                        [[3, 9]], 2, profile, 0, False)
