"""The registry entry of the quantized copy (selfspec/from_config/methods/quantized.py): its rows
from conf/drafters.yaml's `quantized` settings, one line refusing a bad bits value or an int4
this machine cannot run, and a drafter over the copy built once, lossless through
eval/generate.py's path."""

from __future__ import annotations

import pytest
from helpers import sweep_variant  # tests/ is on the path: tests/conftest.py's folder
from hydra import compose, initialize_config_dir

from selfspec import generate
from selfspec.drafters import SmallModelDrafter
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.generation import drafter_and_target
from selfspec.from_config.methods import Loaded, entry
from selfspec.from_config.methods.quantized import QuantizedVariant
from selfspec.from_config.models import load_target
from selfspec.from_config.sweeps import plan_sweep
from selfspec.model import quantized as quantized_module
from selfspec.model.quantized import QuantizedLinear


@pytest.fixture(scope="module")
def compose_cfg():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda config, *overrides: compose(config, overrides=list(overrides))


def test_the_rows_and_labels_come_from_the_composed_settings(compose_cfg):
    method = entry("quantized")
    cfg = compose_cfg("sweep", "methods=[quantized]")
    assert method.variants(cfg, True) == (QuantizedVariant(bits=8),)  # conf/drafters.yaml
    cfg = compose_cfg("sweep", "methods=[quantized]", "quantized.bits=[8,4]",
                      "quantized.first_candidates=[1,3]", "quantized.confidence_threshold=0.5")
    assert [v.label() for v in method.variants(cfg, True)] == [
        "quantized/int8/stop0.5", "quantized/int8/top3/stop0.5", "quantized/int4/stop0.5",
        "quantized/int4/top3/stop0.5"]
    variant = sweep_variant(cfg, "quantized/int4/top3/stop0.5")
    assert (variant.bits, variant.first_candidates, variant.confidence_threshold) == (4, 3, 0.5)
    assert (method.order, method.color, method.ours) == (58, "navy", True)


def test_a_single_generation_takes_exactly_one_row(compose_cfg):
    method = entry("quantized")
    cfg = compose_cfg("generate", "drafter=quantized", "quantized.bits=4")
    assert method.variants(cfg, False) == (QuantizedVariant(bits=4),)
    cfg = compose_cfg("generate", "drafter=quantized", "quantized.bits=[8,4]")
    with pytest.raises(ValueError, match=r"quantized: its settings describe 2 rows "
                                         r"\(quantized/int8, quantized/int4\)"):
        method.variants(cfg, False)


@pytest.mark.parametrize("bits", ["[3]", "[8,16]", "true", "8.0"])
def test_a_bad_bits_value_is_refused_in_one_line_naming_the_setting(compose_cfg, bits):
    cfg = compose_cfg("sweep", "methods=[quantized]", f"quantized.bits={bits}")
    with pytest.raises(ValueError) as refused:
        plan_sweep(cfg, 1)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("quantized.bits: give 8 or 4"), message


def test_an_int4_this_machine_cannot_run_is_refused_before_loading(compose_cfg, monkeypatch):
    monkeypatch.setattr(quantized_module, "int4_failure", lambda *_: "RuntimeError: no kernel")
    cfg = compose_cfg("sweep", "methods=[quantized]", "quantized.bits=[8,4]")
    with pytest.raises(ValueError) as refused:
        plan_sweep(cfg, 1)
    message = str(refused.value)
    assert "\n" not in message, message
    assert message.startswith("quantized.bits=4: int4 does not run on this machine"), message
    assert "use bits 8" in message and "pip install torchao==0.18.0" in message


def test_the_drafter_drafts_with_the_copy_built_once_and_is_lossless(compose_cfg):
    cfg = compose_cfg("generate", "model=tiny", "drafter=quantized", "quantized.bits=4",
                      "num_draft_tokens=3")
    target = load_target(cfg)
    drafter, verified_on = drafter_and_target(cfg, target)
    assert isinstance(drafter, SmallModelDrafter) and verified_on is target
    assert isinstance(drafter.model.lm_head, QuantizedLinear) and drafter.num_draft_tokens == 3
    method, loaded = entry("quantized"), Loaded(cfg, target)
    variant = QuantizedVariant(bits=8)
    method.load(loaded, (variant,))
    assert method.drafter(loaded, variant, 2).model is method.drafter(loaded, variant, 5).model
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    result = generate(target, prompt, drafter=drafter, max_new_tokens=16)
    assert result.tokens == generate(target, prompt, max_new_tokens=16).tokens
    assert result.stats.drafted > 0
