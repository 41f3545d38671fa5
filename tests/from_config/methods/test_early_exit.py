"""The early-exit entry (from_config/methods/early_exit.py): exits, drafters, sweep rows."""

from helpers import tiny_llama

from selfspec import from_config
from selfspec.model import Transformer


def test_early_exit_configs_build_exits_drafters_and_sweep_rows(cfg_of):
    cfg = cfg_of("train_early_exit", "early_exit.exit_layers=[1]", "run_dir=/tmp/unused")
    assert from_config.check_early_exit_settings(cfg) == (1,)
    target = Transformer.from_hf(tiny_llama(0))
    (head,) = from_config.early_exit_heads(cfg, target)
    assert head.config.kind == "adapter" and head.exit_layer == 1
    drafter = from_config.early_exit_drafter(cfg, head)
    assert (drafter.max_nodes, drafter.confidence_threshold) == (6, 0.6)
    def early_exit_variants(cfg):
        return tuple(v.label() for v in from_config.entry("early_exit").variants(cfg, True))

    sweep = cfg_of("sweep", "methods=[early_exit]")
    assert early_exit_variants(sweep) == tuple(
        f"early_exit/E{e}/norm/{stop}" for e in (2, 4, 6) for stop in ("nostop", "stop0.6"))
    adapters = cfg_of("lossless", "early_exit.exits=/some/export", "early_exit.exit_layers=3",
                      "early_exit.confidence_threshold=0.5")
    assert early_exit_variants(adapters) == ("early_exit/E3/norm/stop0.5",
                                             "early_exit/E3/adapter/stop0.5")
