"""The early-exit entry (from_config/methods/early_exit.py): its sweep rows."""

from selfspec.from_config.methods import entry


def early_exit_variants(cfg) -> tuple[str, ...]:
    return tuple(v.label() for v in entry("early_exit").variants(cfg, True))


def test_early_exit_rows_are_every_layer_exit_and_stop(cfg_of):
    sweep = cfg_of("sweep", "methods=[early_exit]")
    assert early_exit_variants(sweep) == tuple(
        f"early_exit/E{e}/norm/{stop}" for e in (2, 4, 6) for stop in ("nostop", "stop0.6"))
    adapters = cfg_of("lossless", "early_exit.exits=/some/export", "early_exit.exit_layers=3",
                      "early_exit.confidence_threshold=0.5")
    assert early_exit_variants(adapters) == ("early_exit/E3/norm/stop0.5",
                                             "early_exit/E3/adapter/stop0.5")
