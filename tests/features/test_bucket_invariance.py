"""The bucket-invariance diagnosis (scripts/invariance.py, run by scripts/bucket_invariance.py):
on the CPU its static steps run eagerly, where a row's results do not depend on its bucket
beyond float noise; planted row-dependent ops are found at their layer and op, and a planted
flip parts decoding where it was planted."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama
from torch import nn

from selfspec.model import Transformer
from selfspec.model.cpu_linear import invariant_rows_of
from selfspec.step import StaticSteps

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "invariance.py"
spec = importlib.util.spec_from_file_location("invariance", SCRIPT)
invariance = sys.modules.setdefault("invariance", importlib.util.module_from_spec(spec))
spec.loader.exec_module(invariance)
from invariance import (  # noqa: E402  (the module just loaded)
    RowDivergence,
    decode_divergence,
    diagnose,
    op_divergences,
    rows_against_alone,
)


class Shifted(nn.Module):
    """layer(x), plus `by` when it runs over several rows: an op whose rows depend on their
    bucket."""

    def __init__(self, layer: nn.Module, by: float, column: int | None = None) -> None:
        super().__init__()
        self.layer, self.by, self.column = layer, by, column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        if x.shape[1] > 1:
            out = out.clone()
            if self.column is None:
                out += self.by
            else:
                out[..., self.column] += self.by
        return out


def model(dtype: torch.dtype = torch.float32) -> Transformer:
    return Transformer.from_hf(tiny_llama(0)).to(dtype)


def inputs(target: Transformer, length: int = 48, rows: int = 8):
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    return (torch.randint(vocab, (1, length), generator=generator),
            torch.randint(vocab, (1, rows), generator=generator))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_themselves_alone_up_to_float_noise(dtype):
    target = model(dtype)
    prompt, tokens = inputs(target)
    steps = StaticSteps(target, 256)
    for rows in (2, 3, 5, 8):
        found = rows_against_alone(steps, prompt, tokens, 40, rows)
        assert [r.row for r in found] == list(range(rows))
        for row in found:
            assert row.bucket == {2: 2, 3: 4, 5: 8, 8: 8}[rows]
            assert len(row.moved) == target.config.num_layers + 1
            assert row.moved[0] == 0  # the embedding reads no other row
            assert max(row.moved) < (1e-5 if dtype == torch.float32 else 0.1)
            assert (row.first_layer is None) == (max(row.moved) == 0)
            assert not row.flipped and row.top2_gap > 0


def test_a_planted_row_dependent_op_is_found_at_its_layer_and_op():
    target = model()
    prompt, tokens = inputs(target)
    steps = StaticSteps(target, 256)
    before = {(o.layer, o.op) for o in op_divergences(steps, prompt, tokens, 40, 4)}
    attention = target.layers[1].self_attn
    attention.o_proj = Shifted(attention.o_proj, 1e-2)
    after = op_divergences(steps, prompt, tokens, 40, 4)
    planted = {(o.layer, o.op) for o in after} - before
    assert planted == {(1, "o_proj")}
    assert all(o.moved == pytest.approx(1e-2, rel=1e-3) for o in after
               if (o.layer, o.op) == (1, "o_proj"))
    assert sorted(o.row for o in after if (o.layer, o.op) == (1, "o_proj")) == [0, 1, 2, 3]
    rows = rows_against_alone(steps, prompt, tokens, 40, 3)
    assert all(r.moved[2] >= 1e-2 * 0.99 and r.first_layer <= 2 for r in rows)
    firsts = invariance.first_divergences(after)
    assert list(firsts) == ["cache 40 bucket 4"]


def test_decoding_is_lossless_in_fp32_and_a_planted_flip_is_placed():
    target = model()
    prompt, _ = inputs(target, length=20)
    steps = StaticSteps(target, 256)
    for k in (1, 4):
        report = decode_divergence(steps, prompt, 30, k)
        assert report["lossless"] and report["tau"] == 30 / report["steps"]
        assert report["steps"] == -(-30 // (k + 1))
    target.lm_head = Shifted(target.lm_head, 1e3, column=7)  # verification rows favour 7
    report = decode_divergence(steps, prompt, 30, 4)
    assert not report["lossless"] and report["verified_token"] == 7
    assert (report["position"], report["row"], report["bucket"], report["steps"]) == (0, 0, 8, 1)
    assert report["cache_length"] == prompt.shape[1] - 1
    assert report["logits_moved"] == pytest.approx(1e3, rel=1e-3)
    assert report["top2_gap"] > 0


def test_a_flip_is_a_near_tie_when_the_logits_moved_at_least_half_its_gap():
    row = RowDivergence(64, 8, 5, 2, [0.0, 1e-3], 1, logits_moved=0.02, argmax_alone=3,
                        argmax_in_bucket=4, top2_gap=0.03)
    assert row.flipped and row.near_tie
    assert not RowDivergence(64, 8, 5, 2, [0.0], None, 0.01, 3, 4, 0.03).near_tie
    assert not RowDivergence(64, 8, 5, 2, [0.0], None, 0.05, 3, 3, 0.03).near_tie  # no flip


def test_the_diagnosis_runs_every_view_and_says_what_it_found():
    target = model()
    prompt, tokens = inputs(target, length=40, rows=4)
    report = diagnose(target, prompt, tokens, modes=["eager", "invariant"], buckets=[2, 4],
                      cache_lengths=[16, 40], new_tokens=12, draft_lengths=[1, 2])
    for mode in ("eager", "invariant"):
        found = report[mode]
        cases = [(r["cache_length"], r["bucket"], r["rows"]) for r in found["rows"]]
        assert cases == [(16, 2, 2), (16, 4, 3), (16, 4, 4), (40, 2, 2), (40, 4, 3), (40, 4, 4)]
        assert all(r["flips"] == 0 for r in found["rows"])
        assert [d["lossless"] for d in found["decode"]] == [True, True]
        assert "Decoding: k=1 lossless" in found["verdict"]
    # the exact mode: every row the bits it has alone, at every layer and in its logits
    assert all(r["logits_moved"] == 0 and r["rows_moved"] == 0 and r["first_layer"] is None
               for r in report["invariant"]["rows"])
    assert "every row bitwise equal to itself alone" in report["invariant"]["verdict"]
    assert target.compile_steps is False and invariant_rows_of(target) is None  # as it was
    with pytest.raises(ValueError, match="modes: unknown"):
        diagnose(target, prompt, tokens, modes=["fast"])


@pytest.mark.slow
def test_the_compiled_steps_are_diagnosed_on_the_cpu_too():
    """inductor's CPU backend: the compiled stages are ops of the report, and decoding in
    compiled steps stays lossless in fp32."""
    torch._dynamo.reset()  # graphs another test of this worker compiled would be reused
    target = model()
    prompt, tokens = inputs(target, length=24, rows=2)
    report = diagnose(target, prompt, tokens, modes=["compiled"], buckets=[2],
                      cache_lengths=[24], new_tokens=8, draft_lengths=[1])["compiled"]
    assert report["setup_seconds"] > 0
    assert all(d["lossless"] for d in report["decode"])
    # one graph per stage and bucket (1 and 2), the op checks' calls included: no recompiling
    assert report["compile_counts"]["stats"]["unique_graphs"] == 4
    assert not report["compile_counts"].get("graph_break")
    assert {o["op"] for o in report["ops"]} <= {"input_norm", "qkv", "rope", "attention",
                                                "o_proj", "post_norm", "mlp",
                                                "attention_inputs", "layer_output"}
    assert all(o["moved"] < 1e-5 for o in report["ops"])
