"""The one `main` of every trainer: train/<method>.py names its method and Hydra config and
calls `train_method`, which composes the method's `TrainerEntry` (its module under
`from_config/methods/`) with what every trainer shares (`from_config.training`)."""

from __future__ import annotations

import logging
from functools import partial

from omegaconf import DictConfig

from selfspec.from_config.common import set_threads
from selfspec.from_config.features import trainer_features
from selfspec.from_config.methods import resumable_changes, trainer
from selfspec.from_config.methods.entry import TrainingRun
from selfspec.from_config.training import (
    deepspeed_config,
    report_and_finish,
    run_tracker,
    start_training,
    tau_judge,
    training_rows,
)
from selfspec.training.loop import fit, make_accelerator


def train_method(cfg: DictConfig, name: str) -> None:
    """Train method `name`'s module on a frozen target (`cfg.dry_run`: print its memory plan
    only): check every setting, load the target, record the judge's answers (before a trainer
    that changes the target changes it), build the rows, the fresh module and its objective,
    fit, then report on held-out prompts."""
    method = trainer(name)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file checkpoint chatter
    set_threads(cfg, "trainer.threads")
    if cfg.dry_run:
        return method.dry_run(cfg)
    settings, target, tokenizer = start_training(cfg, method.check, resumable_changes())
    judge = tau_judge(cfg, target, partial(method.drafters, cfg),
                      replayable=method.replayable(cfg))
    train, heldout = training_rows(cfg, tokenizer, target)
    module = method.module(cfg, target, train)
    accelerator = make_accelerator(settings, deepspeed_config(cfg))
    features = trainer_features(cfg, target, train, heldout, method.streams(module))
    run = TrainingRun(cfg, target, tokenizer, train, module)
    objective = method.objective(run, features)
    tracker = run_tracker(cfg, settings, accelerator.is_main_process)
    result = fit(objective, train, heldout, settings, accelerator=accelerator, tracker=tracker,
                 export=method.exporter(run, objective), judge=judge)
    report_and_finish(cfg, settings, result, tracker, method.report)
