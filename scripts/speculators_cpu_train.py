"""speculators' own trainer (`speculators train`, 0.9.0) on a CPU-only torch, in one process.
Run it with the python of speculators' venv (scripts/peers.sh speculators); selfspec is not
installed there, and nothing here imports it.

    .peers/speculators/venv/bin/python scripts/speculators_cpu_train.py METRICS.jsonl \
        --speculator-type eagle3 --verifier-name-or-path MODEL --data-path DATA ...

Everything after the first argument is speculators' own command line. Its trainer assumes an
accelerator in two places, both worked around here, where they apply:
- it moves the model and every batch to `get_local_rank()`, the integer 0 (a CUDA device):
  the trainer's copy of that function answers "cpu" instead;
- its step timer calls `torch.accelerator.synchronize()`, which raises without an
  accelerator: with none, it does nothing (CPU work is synchronous already).
Each logged step's metrics (its loss, learning rate and speculators' own step profile) are
also written, one JSON object a line, to METRICS.jsonl.
"""

from __future__ import annotations

import json
import logging
import sys


class JsonLines(logging.Handler):
    """speculators' metric records (dicts) as JSON lines."""

    def __init__(self, path: str):
        super().__init__()
        self.file = open(path, "a")  # noqa: SIM115 - kept open for the run

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.file.write(json.dumps(record.msg, default=float) + "\n")
            self.file.flush()


def run_on_cpu() -> None:
    """The two workarounds above, applied before the trainer is built."""
    import torch
    from speculators.train import trainer

    trainer.get_local_rank = lambda: "cpu"  # was the int 0: `.to(0)` is a CUDA device
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *_args, **_kwargs: None


def log_metrics_to(path: str) -> None:
    """speculators' trainer configures its metric logger itself (logging's dictConfig, which
    replaces that logger's handlers): the JSON-lines handler joins right after."""
    from speculators.train import cli

    configure = cli.setup_metric_logger

    def configure_then_add(*args, **kwargs):
        configure(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(JsonLines(path))

    cli.setup_metric_logger = configure_then_add


def main(metrics: str, argv: list[str]) -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    run_on_cpu()
    log_metrics_to(metrics)
    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: speculators_cpu_train.py METRICS.jsonl <speculators train flags>")
    main(sys.argv[1], sys.argv[2:])
