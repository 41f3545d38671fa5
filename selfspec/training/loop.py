"""One training loop for every trainable drafter, on Hugging Face accelerate.

The same `fit` runs on one CPU, under DDP and under DeepSpeed ZeRO (1/2/3), because accelerate
owns the distribution. What is trained is an *objective*: an `nn.Module` holding the frozen
target (parameters with requires_grad=False) and the trainable head, whose forward returns a
`LossOutput`. Checkpoints hold the trainable parameters, the optimizer and scheduler states and
the RNG, never the frozen target; `resume=True` continues from the last complete one.

Data order is a pure function of (seed, step): the global batch of a step is the same whatever
the number of processes, so a 2-process run matches a 1-process run of the same global batch,
and a resumed run sees exactly the batches the interrupted one would have seen.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from selfspec.errors import SelfspecError
from selfspec.heads.base import LossOutput
from selfspec.quiet import quiet_imports
from selfspec.tracking import Tracker
from selfspec.training.best import KEEP, BestStep
from selfspec.training.checkpoints import (
    check_fresh_start,
    drop_frozen_weights_from_checkpoints,
    is_deepspeed,
    latest_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from selfspec.training.rows import TokenRows

log = logging.getLogger(__name__)


# Where each setting lives in the Hydra configs (conf/trainer, conf/optim), for messages.
SETTING_NAMES = {name: f"trainer.{name}" for name in (
    "max_steps", "micro_batch_size", "grad_accum", "save_every", "log_every", "eval_rows",
    "keep_checkpoints", "eval_every", "max_minutes")} | {name: f"optim.{name}" for name in (
    "lr", "clip_grad", "warmup_steps", "weight_decay")}


class NonFiniteLoss(SelfspecError, RuntimeError):
    """Training stopped on a NaN/inf loss; the last good checkpoint is kept."""


@dataclass(frozen=True)
class TrainSettings:
    """max_steps: optimizer steps. micro_batch_size: rows per process per micro-step; the
    global batch is micro_batch_size * processes * grad_accum rows. stop_after: end the run
    early after that many steps, as an interruption would (the schedule still spans max_steps).
    max_minutes: a training-time budget (evaluations not counted): the run evaluates, saves
    and finishes at the first step past it (the schedule still spans max_steps).
    epochs: train for this many passes over the rows instead of max_steps, evaluating and
    saving at the end of each (`for_rows` sets max_steps, eval_every and save_every).
    """

    run_dir: str
    max_steps: int
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the cosine ends at lr * min_lr_ratio
    clip_grad: float = 1.0
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end only
    eval_rows: int = 32
    save_every: int = 50
    keep_checkpoints: int = 2
    seed: int = 0
    resume: bool = False
    stop_after: int | None = None
    keep_best: str = "last"  # which step's export the run ends with: last, loss or tau
    stop_after_no_gain: int | None = None  # evaluations without a better keep_best value
    max_minutes: float | None = None
    epochs: float | None = None

    def __post_init__(self) -> None:
        at_least = {"max_steps": 1, "micro_batch_size": 1, "grad_accum": 1, "save_every": 1,
                    "log_every": 1, "eval_rows": 1, "keep_checkpoints": 1, "eval_every": 0,
                    "warmup_steps": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{SETTING_NAMES.get(name, name)} must be >= {low}, "
                                 f"got {getattr(self, name)}")
        for name in ("lr", "clip_grad"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{SETTING_NAMES[name]} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32), got {self.seed}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"trainer.epochs must be > 0 (or null), got {self.epochs}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"trainer.max_minutes must be > 0 (or null), got {self.max_minutes}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"trainer.stop_after must be >= 1 (or null), got {self.stop_after}")
        if self.keep_best not in KEEP:
            raise ValueError(f"trainer.keep_best must be one of {', '.join(KEEP)}, got "
                             f"{self.keep_best!r}")
        if self.stop_after_no_gain is not None and (
                self.stop_after_no_gain < 1 or self.keep_best == "last"):
            raise ValueError(f"trainer.stop_after_no_gain must be >= 1 evaluations (or null) and "
                             f"needs trainer.keep_best=tau or loss to judge by, got "
                             f"{self.stop_after_no_gain} with keep_best={self.keep_best}")


    def for_rows(self, rows: int, processes: int) -> TrainSettings:
        """These settings for a run over `rows` training rows on `processes` processes: with
        epochs, max_steps covers that many passes and every pass ends with an evaluation and
        a checkpoint."""
        if self.epochs is None:
            return self
        per_step = self.micro_batch_size * self.grad_accum * processes
        per_epoch = max(1, math.ceil(rows / per_step))
        return replace(self, max_steps=math.ceil(self.epochs * per_epoch), eval_every=per_epoch,
                       save_every=per_epoch)


@dataclass
class FitResult:
    """step: the last step trained; finished: the run reached max_steps or max_minutes, or
    stopped early for want of a gain (not interrupted); best: the judged best step's record
    (keep_best)."""

    step: int
    metrics: dict[str, float]
    checkpoint: Path | None
    finished: bool = True
    best: BestStep | None = None

    @property
    def export(self) -> Path | None:
        """The export the run ends with: the best step's when one was judged, else the last
        checkpoint's."""
        if self.best is not None and self.best.step is not None:
            return self.best.export
        return None if self.checkpoint is None else self.checkpoint / "export"


def fit(
    objective: torch.nn.Module,
    train: TokenRows,
    evaluation: TokenRows | None,
    settings: TrainSettings,
    *,
    accelerator: Accelerator,
    tracker: Tracker | None = None,
    export: Callable[[dict[str, torch.Tensor], Path], None] | None = None,
    judge: Callable[[Path], dict[str, float]] | None = None,
) -> FitResult:
    """Train the objective's trainable parameters; returns the last step and its metrics.

    export(trainable_state_dict, folder) is called on the main process at every checkpoint
    with the full (gathered) trainable weights, e.g. to write head-only safetensors.
    judge(export_folder): metrics of a step's export at every evaluation, e.g. {"eval/tau":
    its drafter's held-out tau}, logged beside the loss; settings.keep_best then keeps the best
    step's export (`best.BestStep`), and settings.stop_after_no_gain ends the run early.
    """
    set_seed(settings.seed)
    settings = settings.for_rows(len(train), accelerator.num_processes)
    check_fresh_start(settings.run_dir, settings.resume)
    optimizer, scheduler = _optimizer_and_schedule(objective, settings,
                                                   fused=not is_deepspeed(accelerator))
    model, optimizer = accelerator.prepare(objective, optimizer)
    clock = TrainingClock()
    accelerator.register_for_checkpointing(scheduler, clock)
    trainable = {n for n, p in objective.named_parameters() if p.requires_grad}
    drop_frozen_weights_from_checkpoints(accelerator, trainable)
    checkpoints = Path(settings.run_dir) / "checkpoints"
    start = resume_checkpoint(accelerator, checkpoints) if settings.resume else 0
    if tracker is not None and settings.resume:
        tracker.resumed_at(start)
    end, last = settings.max_steps, settings.max_steps  # `last`: where an interruption stops
    if settings.stop_after is not None:
        last = min(last, settings.stop_after)
    metrics, saved = {}, latest_checkpoint(checkpoints)
    best = _best_step(settings, checkpoints, export, judge)
    done = start
    bar = tqdm(range(start, last), desc="train", disable=not accelerator.is_main_process)
    rows_per_step = settings.micro_batch_size * settings.grad_accum * accelerator.num_processes
    tokens_per_step = rows_per_step * train.tokens.shape[1]
    out_of_time = False
    for step in bar:
        metrics = _train_step(model, optimizer, scheduler, train, step, settings, accelerator)
        done = step + 1
        metrics |= {"minutes": clock.minutes(), "tokens_seen": done * tokens_per_step,
                    "epochs": done * rows_per_step / len(train)}
        out_of_time = _out_of_time(clock, settings.max_minutes, accelerator)
        evaluated = evaluation is not None and (_due(done, settings.eval_every, end)
                                                or out_of_time)
        if evaluated:
            with clock.paused():
                metrics |= _evaluate(model, evaluation, settings, accelerator)
                if judge is not None or best.judges:
                    metrics |= _judge(model, accelerator, trainable, export, judge, best, done,
                                      metrics)
        if tracker is not None and (_due(done, settings.log_every, end) or evaluated):
            tracker.log(metrics, step=done)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        no_gain = evaluated and best.should_stop(settings.stop_after_no_gain)
        if _due(done, settings.save_every, end) or no_gain or out_of_time:
            with clock.paused():
                saved = save_checkpoint(model, accelerator, checkpoints, done, trainable,
                                        settings, export)
        if no_gain:
            log.info("no better %s in %d evaluations: stopping at step %d (best: step %s)",
                     best.keep, settings.stop_after_no_gain, done, best.step)
        if out_of_time:
            log.info("trainer.max_minutes=%s reached: stopping at step %d", settings.max_minutes,
                     done)
        if no_gain or out_of_time:
            break
    finished = done == end or out_of_time or best.should_stop(settings.stop_after_no_gain)
    return FitResult(done, metrics, saved, finished, best if best.judges else None)


class TrainingClock:
    """Training minutes across interruptions: saved in every checkpoint (accelerate's custom
    state), so a resumed run's curve against minutes continues where the checkpoint left it
    (the minutes after the last checkpoint are lost with the steps)."""

    def __init__(self) -> None:
        self.before, self.started = 0.0, time.monotonic()

    def minutes(self) -> float:
        return (self.before + time.monotonic() - self.started) / 60

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside does not count (evaluation, tau replay, checkpoints): the minutes are
        training minutes, comparable between methods whose evaluations cost differently."""
        stopped = time.monotonic()
        try:
            yield
        finally:
            self.started += time.monotonic() - stopped

    def state_dict(self) -> dict[str, float]:
        return {"seconds": self.minutes() * 60}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.before, self.started = float(state["seconds"]), time.monotonic()


def _out_of_time(clock: TrainingClock, max_minutes: float | None, accelerator) -> bool:
    """Whether the budget is spent, by the main process's clock (all processes stop at the
    same step)."""
    if max_minutes is None:
        return False
    spent = [clock.minutes() >= max_minutes]
    if accelerator.num_processes > 1:
        broadcast_object_list(spent, from_process=0)
    return spent[0]


def _best_step(settings: TrainSettings, checkpoints: Path, export, judge) -> BestStep:
    """The run's record of its best step (resumed from its checkpoints folder)."""
    if settings.keep_best != "last" and export is None:
        raise ValueError(f"trainer.keep_best={settings.keep_best} keeps the best step's export: "
                         f"this trainer exports nothing")
    if settings.keep_best == "tau" and judge is None:
        raise ValueError("trainer.keep_best=tau needs held-out tau at every evaluation: set "
                         "trainer.tau_prompts >= 1, or keep_best=loss")
    return BestStep.resumed(settings.keep_best, checkpoints / "best")


def _judge(model, accelerator, trainable, export, judge, best: BestStep, step: int,
           metrics: dict[str, float]) -> dict[str, float]:
    """Export this step on the main process, judge the export, offer it to `best`; every
    rank gets the judged metrics and the best record (so that all stop together)."""
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 partitions; on every rank
    judged: dict[str, float] = {}
    if accelerator.is_main_process:
        folder = best.folder.parent / "judged" / "export"
        if folder.exists():
            shutil.rmtree(folder)
        export({k: v for k, v in state.items() if k in trainable}, folder)
        judged = judge(folder) if judge is not None else {}
        if best.judges:
            best.offer(step, metrics | judged, folder)
    judged, best.step, best.value, best.since_gain = broadcast_object_list(
        [judged, best.step, best.value, best.since_gain])
    return judged


def state_part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of a state dict under `prefix` (e.g. an objective's "head."), unprefixed."""
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def make_accelerator(settings: TrainSettings, deepspeed_config: dict | None = None) -> Accelerator:
    """An Accelerator for this launch: one process, DDP under torchrun, or DeepSpeed ZeRO.

    Checks afterwards that accelerate really runs what was launched: some CPU combinations
    otherwise fall back silently to one process, or to replicas that never synchronise.
    """
    from accelerate import DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    handlers = [InitProcessGroupKwargs(backend=backend)] if world > 1 else []
    plugin = None
    if deepspeed_config:
        plugin = DeepSpeedPlugin(hf_ds_config={
            **deepspeed_config,
            "train_micro_batch_size_per_gpu": settings.micro_batch_size,
            "gradient_accumulation_steps": settings.grad_accum,
            "gradient_clipping": settings.clip_grad,
        })
    threads = torch.get_num_threads()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available() and plugin is None,  # CPU DDP needs cpu=True
        mixed_precision=_mixed_precision(plugin is not None),
        gradient_accumulation_steps=settings.grad_accum,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
    )
    # Under torchrun on a CPU without OMP_NUM_THREADS, accelerate resets torch's thread count
    # to its own guess: keep the caller's (e.g. trainer.threads).
    torch.set_num_threads(threads)
    _check_launch(accelerator, world, plugin is not None)
    return accelerator


def _mixed_precision(deepspeed: bool) -> str:
    """bf16 autocast on GPUs that have it; fp32 on CPU, where bf16 is ~30x slower. Under
    DeepSpeed its own config's bf16 block decides."""
    if deepspeed or not torch.cuda.is_available():
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "no"


def _check_launch(accelerator: Accelerator, world: int, deepspeed: bool) -> None:
    if accelerator.num_processes != world:
        raise SelfspecError(
            f"launched {world} processes but accelerate runs {accelerator.num_processes}: "
            f"launch with torchrun --nproc_per_node N (or accelerate launch --use_deepspeed)"
        )
    if deepspeed and not is_deepspeed(accelerator):
        raise SelfspecError(
            "a DeepSpeed config was given but accelerate did not enable DeepSpeed (is "
            "ACCELERATE_USE_CPU set? it disables DeepSpeed): unset it, or use deepspeed=none"
        )


# ---- one step --------------------------------------------------------------------------------


def _train_step(model, optimizer, scheduler, train, step, settings, accelerator) -> dict:
    """grad_accum micro-steps, one optimizer step; metrics averaged over micro-steps and ranks."""
    outputs = []
    for micro in range(settings.grad_accum):
        batch = _micro_batch(train, step, micro, settings, accelerator)
        with accelerator.accumulate(model):
            out: LossOutput = model(batch.tokens, batch.loss_mask)
            _stop_if_not_finite(out.loss, step + 1, settings, accelerator)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients and not is_deepspeed(accelerator):
                accelerator.clip_grad_norm_(model.parameters(), settings.clip_grad)
            optimizer.step()
            optimizer.zero_grad()
        outputs.append(out)
    scheduler.step()
    metrics = _mean_over_ranks(outputs, accelerator)
    return metrics | {"lr": scheduler.get_last_lr()[0]}


def _micro_batch(train: TokenRows, step, micro, settings, accelerator) -> TokenRows:
    """This process's rows of micro-step `micro` of optimizer step `step`, on its device.

    The corpus stays on the CPU (self-distilled rows come back there too); only the rows a
    micro-step uses go to the device the prepared model lives on.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    per_micro = settings.micro_batch_size * world
    first = (step * settings.grad_accum + micro) * per_micro + rank * settings.micro_batch_size
    positions = torch.arange(first, first + settings.micro_batch_size)
    return train.select(_epoch_order(positions, len(train), settings.seed)).to(accelerator.device)


def _epoch_order(positions: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Row index at each position of an endless stream of seeded per-epoch permutations."""
    epochs, offsets = positions // n, positions % n
    rows = torch.empty_like(positions)
    for epoch in epochs.unique().tolist():
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        chosen = epochs == epoch
        rows[chosen] = order[offsets[chosen]]
    return rows


def _mean_over_ranks(outputs: list[LossOutput], accelerator: Accelerator) -> dict[str, float]:
    names = sorted(outputs[0].metrics)
    local = torch.tensor(
        [[o.loss.item()] + [o.metrics[k] for k in names] for o in outputs], dtype=torch.float64
    ).mean(0)
    values = accelerator.reduce(local.to(accelerator.device), reduction="mean").tolist()
    return dict(zip(["loss", *names], values, strict=True))


def _stop_if_not_finite(loss: torch.Tensor, step: int, settings, accelerator) -> None:
    bad = torch.tensor(float(not torch.isfinite(loss).all()), device=accelerator.device)
    if accelerator.reduce(bad, reduction="sum").item() > 0:
        kept = latest_checkpoint(Path(settings.run_dir) / "checkpoints")
        raise NonFiniteLoss(
            f"the loss became NaN/inf at step {step}; training stopped without saving. "
            f"Last good checkpoint: {kept or 'none yet'}. Lower optim.lr or check the data, "
            f"then resume with trainer.resume=true."
        )


@torch.no_grad()
def _evaluate(model, evaluation: TokenRows, settings, accelerator) -> dict[str, float]:
    """Mean loss and metrics over the first eval_rows rows, split across processes."""
    model.eval()
    rows = torch.arange(min(settings.eval_rows, len(evaluation)))
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    outputs = [
        model(chunk.tokens, chunk.loss_mask)
        for chunk in (evaluation.select(i).to(accelerator.device)
                      for i in mine.split(settings.micro_batch_size))
    ]
    model.train()
    return {f"eval/{k}": v for k, v in _mean_over_ranks(outputs, accelerator).items()}


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _optimizer_and_schedule(objective: torch.nn.Module, settings: TrainSettings,
                            fused: bool = False):
    """AdamW over the trainable parameters: the objective's own `param_groups(lr)` when it
    has them (e.g. a lower rate for adapters on the target), else all at settings.lr.

    fused: torch's one-kernel AdamW where every parameter allows it (CPU or CUDA floats). On
    two CPU cores it stepped a 9M-parameter EAGLE-3 head in 5.5 ms against 31 ms. `fit` asks
    for it except under DeepSpeed, whose ZeRO steps the client optimizer over its own
    flattened partitions."""
    if not any(p.requires_grad for p in objective.parameters()):
        raise ValueError("the objective has no trainable parameters")
    if hasattr(objective, "param_groups"):
        groups = objective.param_groups(settings.lr)
    else:
        groups = [{"params": [p for p in objective.parameters() if p.requires_grad]}]
    params = [p for group in groups for p in group["params"]]
    fused = fused and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                          for p in params)
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay,
                                  fused=fused or None)
    with quiet_imports():  # slow, and with torchao installed noisy: only when training
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, settings.warmup_steps, settings.max_steps, min_lr_rate=settings.min_lr_ratio
    )
    return optimizer, scheduler
