"""What every trainer shares, from configs: settings, resume checks, DeepSpeed, training
rows (with self-distillation), a mask token from the rows, a single head's export, the judge
of its exports and its report. What each method's trainer composes (its checks, its fresh
module, its objective, its export's drafters) is its `TrainerEntry`, in its module under
`from_config/methods/`; `from_config.train_method` runs them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.checks import check_count
from selfspec.decode import generate
from selfspec.divergences import DIVERGENCES
from selfspec.drafters import Drafter
from selfspec.errors import SelfspecError
from selfspec.from_config.common import device, positive_int, sampling_params
from selfspec.from_config.models import (
    load_hf_model,
    load_target,
    load_tokenizer,
    resolve_model_path,
)
from selfspec.from_config.prompts import load_prompts
from selfspec.heads.draft_vocab import rarest_token, save_token_counts, token_counts
from selfspec.heads.io import describe_target, save_head
from selfspec.measure.passes import Comparison, compare_with_plain
from selfspec.measure.replay import GreedyRecord, cached_records, replay
from selfspec.metrics import TauEstimate
from selfspec.model import Transformer
from selfspec.model.fingerprint import weights_fingerprint
from selfspec.tracking import Tracker
from selfspec.training import checkpoints
from selfspec.training.data import (
    document_rows,
    first_answers,
    load_jsonl_documents,
    load_sharegpt,
    packed_stdlib_dataset,
    render_conversation,
    rows_from_dataset,
    self_distill,
    self_distill_rows,
)
from selfspec.training.features import StoreWriter
from selfspec.training.instructions import (
    cache_name,
    general_instructions,
    self_distilled_conversations,
    shipped_answers,
    stdlib_instructions,
)
from selfspec.training.loop import FitResult, TrainSettings, state_part
from selfspec.training.rows import TokenRows

# Settings a resumed run of any trainer may change: they shape neither the weights nor the
# optimizer. A method's own such settings (how its report drafts) are its TrainerEntry's
# `report_settings`; `methods.resumable_changes()` is the whole list.
RESUMABLE_CHANGES = (
    "trainer.resume", "trainer.stop_after", "trainer.threads", "trainer.log_every",
    "trainer.eval_every", "trainer.eval_rows", "trainer.save_every", "trainer.keep_checkpoints",
    "train_data.cache_dir", "final_eval", "wandb", "tree", "data", "sampling", "device",
    "dry_run", "num_gpus", "run_dir",
)


def start_training(
    cfg: DictConfig, check_method_settings: Callable[[DictConfig], Any],
    may_change: tuple[str, ...],
) -> tuple[TrainSettings, Transformer, Any]:
    """What every trainer does first: check every setting (the trainer's, the method's via
    check_method_settings, the device) before any model loads, record the run's config (a
    resume with other settings than `may_change` is refused), then load the target and its
    tokenizer. Returns (settings, target, tokenizer)."""
    settings = train_settings(cfg)
    check_method_settings(cfg)
    device(cfg)
    record_run_config(cfg, settings, may_change)
    target = load_target(cfg)
    return settings, target, load_tokenizer(target.source)


def record_run_config(cfg: DictConfig, settings: TrainSettings,
                      may_change: tuple[str, ...]) -> None:
    """Keep cfg in the run folder; a resume that changes a setting outside `may_change` (those
    that shape neither the weights nor the optimizer) is refused (see
    `training.record_run_config`)."""
    checkpoints.record_run_config(settings.run_dir, OmegaConf.to_container(cfg, resolve=True),
                                  resume=settings.resume, may_change=may_change)


def check_kept_run(cfg: DictConfig, run_dir: str | Path, may_change: tuple[str, ...]) -> None:
    """Refuse to keep a finished run of run_dir that was trained with settings other than
    cfg's outside `may_change` (the check a resume makes, without training): a curve never
    mixes runs of two configs."""
    changes = checkpoints.config_changes(run_dir, OmegaConf.to_container(cfg, resolve=True),
                                         may_change)
    if changes:
        raise SelfspecError(f"{run_dir} finished with another config ({changes}); remove that "
                            f"folder to train it again, or run with its values")


def run_tracker(cfg: DictConfig, settings: TrainSettings, is_main_process: bool
                ) -> Tracker | None:
    """The run's tracker (W&B per cfg.wandb, and metrics.jsonl) on the main process only."""
    if not is_main_process:
        return None
    return Tracker(settings.run_dir, project=cfg.wandb.project, use_wandb=cfg.wandb.enabled,
                   config=OmegaConf.to_container(cfg, resolve=True))


def report_due(cfg: DictConfig, result: FitResult) -> bool:
    """Whether a training run reports on held-out prompts (it finished, not interrupted, and
    final_eval asks for prompts)."""
    return result.finished and int(cfg.final_eval.num_prompts) > 0


def report_and_finish(cfg: DictConfig, settings: TrainSettings, result: FitResult,
                      tracker: Tracker | None, report: Callable[..., None]) -> None:
    """Every trainer's last act: on the main process (the one with a tracker), a run that
    finished reports on held-out prompts (report(cfg, export folder, metrics, tracker)) for
    the export it ends with (the best step's under trainer.keep_best), says which step that
    is beside the last, then the tracker closes."""
    if tracker is None:
        return
    if report_due(cfg, result):
        if result.best is not None:
            best = result.best
            line = (f"kept step {best.step} ({best.keep} {best.value:.4g}, the best of "
                    f"{len(best.history)} evaluations) of {result.step}; its export: "
                    f"{best.export}")
            print(line)
            tracker.log_summary({"best_step": best.step, f"best_{best.keep}": best.value,
                                 "last_step": result.step, "best_export": str(best.export)})
        report(cfg, result.export, result.metrics, tracker)
    tracker.finish()


def final_eval_prompts(cfg: DictConfig, target: Transformer) -> list[list[int]]:
    """The first final_eval.num_prompts prompts of cfg.data, as the target's token ids."""
    prompts = load_prompts(cfg.data, load_tokenizer(target.source))
    return [p.ids for p in prompts[: int(cfg.final_eval.num_prompts)]]


def tau_prompts(cfg: DictConfig, target: Transformer) -> list[list[int]]:
    """trainer.tau_prompts prompts of cfg.data after the final_eval ones: held out from the
    training rows (another data set) and from the final report's prompts."""
    first, count = int(cfg.final_eval.num_prompts), int(cfg.trainer.tau_prompts)
    prompts = load_prompts(cfg.data, load_tokenizer(target.source))[first : first + count]
    if len(prompts) < count:
        raise ValueError(f"trainer.tau_prompts={count}: {cfg.data.name} has {len(prompts)} "
                         f"prompts after the {first} final_eval ones; lower it or raise "
                         f"data.num_prompts")
    return [p.ids for p in prompts]


# What a trainer's export drafts: {name: (drafter, the target it verifies on)}; "" for one.
ExportDrafters = dict[str, tuple[Drafter, Transformer]]
Export = Callable[[dict[str, torch.Tensor], Path], None]  # `training.loop.fit`'s export


@dataclass(frozen=True)
class TrainingRun:
    """A trainer's run as its objective and export see it: the config, the target and its
    tokenizer, the training rows and the fresh trainable module (heads, exits, a draft)."""

    cfg: DictConfig
    target: Transformer
    tokenizer: Any
    train: TokenRows
    module: Any
DraftersOf = Callable[[Transformer, Path], ExportDrafters]


def tau_judge(cfg: DictConfig, target: Transformer, drafters_of: DraftersOf,
              replayable: bool = True) -> Callable[[Path], dict[str, float]] | None:
    """A trainer's judge of its exports (`training.fit`'s `judge`): the greedy tau of each
    drafter an export makes (drafters_of(target, folder) -> {name: (drafter, the target it
    verifies on)}) over the target's greedy answers to `tau_prompts`, trainer.tau_new_tokens
    each, recorded once (cached in train_data.cache_dir, like the training answers).
    Replayed (one target forward per answer: `measure.replay`) where `replayable` and the
    drafts verify on the target itself, else decoded. Returns
    eval/tau (the mean over the drafters), eval/tau/<name> for named ones and
    eval/tau_seconds (what judging took). None when trainer.tau_prompts is 0."""
    if not int(cfg.trainer.get("tau_prompts") or 0):
        return None
    if _zero3(cfg):  # the trainer's target is partitioned across ranks: judge a whole copy
        target = load_target(cfg)
    new_tokens = positive_int(cfg, "trainer.tau_new_tokens")
    stops = tuple(target.config.eos_token_ids)
    records = cached_records(target, tau_prompts(cfg, target), new_tokens, stops,
                             cfg.train_data.get("cache_dir"))

    def judge(folder: Path) -> dict[str, float]:
        start = time.perf_counter()
        taus = {name: heldout_tau(target, drafter, verified, records, replayable)
                for name, (drafter, verified) in drafters_of(target, folder).items()}
        named = {f"eval/tau/{name}": t.tau for name, t in taus.items() if name}
        errors = {f"eval/tau_se/{name}" if name else "eval/tau_se": t.standard_error
                  for name, t in taus.items() if t.prompts > 1 and (name or len(taus) == 1)}
        seconds = time.perf_counter() - start  # what judging costs the run, beside its steps
        mean = sum(t.tau for t in taus.values()) / len(taus)
        return {"eval/tau": mean, "eval/tau_seconds": seconds} | named | errors

    return judge


def _zero3(cfg: DictConfig) -> bool:
    config = deepspeed_config(cfg) or {}
    return config.get("zero_optimization", {}).get("stage") == 3


def heldout_tau(target: Transformer, drafter: Drafter, verified: Transformer,
                records: list[GreedyRecord], replayable: bool) -> TauEstimate:
    """The drafter's greedy tau over the records' prompts, with its standard error over them:
    replayed over the recorded answers, or decoded by `generate` on `verified` (a Medusa-2
    export's adapted target, or a drafter that drafts in the target's own cache, which a
    replay does not keep)."""
    per_prompt = []
    for record in records:
        if replayable and verified is target:
            per_prompt.append(replay(target, drafter, record))
        else:
            per_prompt.append(generate(verified, record.prompt, drafter=drafter,
                                       max_new_tokens=record.answer_length,
                                       eos_token_id=list(target.config.eos_token_ids)).stats)
    return TauEstimate.of(per_prompt)


def compare_on_final_eval(cfg: DictConfig, target: Transformer, drafter: Drafter) -> Comparison:
    """A trained drafter against plain decoding of `target` on the final_eval prompts,
    final_eval.max_new_tokens each, under cfg.sampling."""
    prompts = final_eval_prompts(cfg, target)
    return compare_with_plain(target, drafter, prompts, sampling=sampling_params(cfg.sampling),
                              max_new_tokens=int(cfg.final_eval.max_new_tokens),
                              seed=int(cfg.seed))


def final_comparison(cfg: DictConfig, drafters_of: Callable[..., ExportDrafters], export: Path
                     ) -> tuple[Drafter, Comparison]:
    """A trainer's report: the one drafter its export makes (drafters_of(cfg, target, export)),
    against plain decoding of the target it verifies on, on a fresh target whatever DeepSpeed
    did to the trained one (`compare_on_final_eval`)."""
    drafter, verified = drafters_of(cfg, load_target(cfg), export)[""]
    return drafter, compare_on_final_eval(cfg, verified, drafter)


def log_report(cfg: DictConfig, tracker: Tracker, comparison: Comparison, summary: dict,
               *lines: str) -> None:
    """A trainer's report: the comparison's figures and `summary` to the tracker, then `lines`
    and the comparison printed."""
    tracker.log_summary({**comparison.as_dict(), **summary})
    print("\n".join([*lines, comparison.describe(cfg.data.name)]))


def heldout_top1(metrics: dict[str, float], prefix: str = "eval/") -> dict[str, float]:
    """The held-out top-1 agreements among a run's last metrics (those under `prefix`), named
    without "eval/" and rounded: the held-out rows', not the last batch's."""
    return {k.removeprefix("eval/"): round(v, 3) for k, v in metrics.items()
            if k.startswith(prefix) and k.endswith("top1")}


def mask_token(setting: int | None, target: Transformer, train: TokenRows) -> int:
    """The mask token of a method that drafts from masks (PARD, DFlash, P-EAGLE): its
    `mask_token_id` setting, or (null) the training rows' rarest token (the highest id among
    equals), so that it stands for nothing the rows say."""
    if setting is not None:
        return int(setting)
    return rarest_token(token_counts(train.tokens, target.config.vocab_size))


def rows_token_counts(target: Transformer, train: TokenRows) -> torch.Tensor:
    """The training rows' supervised tokens counted [V], kept beside an export (a draft
    vocabulary of any size is chosen from them later)."""
    return token_counts(train.tokens, target.config.vocab_size, train.loss_mask)


def head_exporter(head: torch.nn.Module, prefix: str, target: Transformer,
                  counts: torch.Tensor | None = None) -> Export:
    """The export of one trained head (`training.fit`'s export): the head alone (safetensors and
    its config, in the published checkpoints' names) from the state's entries under `prefix`
    and the buffers it holds now (a draft vocabulary's maps, which training leaves alone), with
    the training rows' token `counts` beside it when given."""
    config, info = head.config, describe_target(target)
    buffers = {name: b.detach().clone() for name, b in head.named_buffers()}

    def export(state: dict[str, torch.Tensor], folder: Path) -> None:
        trained = type(head)(config)
        trained.load_state_dict(state_part(state, prefix) | buffers)
        save_head(folder, trained, config, info)
        if counts is not None:
            save_token_counts(folder, counts)

    return export


def training_objective(cfg: DictConfig) -> str:
    """trainer.objective: the divergence a trainer fits its draft's law to the target's by
    (`selfspec.divergences`; unset: kl, the published default), checked."""
    name = str(cfg.trainer.get("objective") or "kl")
    if name not in DIVERGENCES:
        raise ValueError(f"trainer.objective must be one of {', '.join(DIVERGENCES)} (the "
                         f"divergence the draft's law is fitted to the target's by), got "
                         f"{name!r}")
    return name


def train_settings(cfg: DictConfig) -> TrainSettings:
    """TrainSettings from cfg.trainer and cfg.optim (the run folder is cfg.run_dir)."""
    t, o = cfg.trainer, cfg.optim
    return TrainSettings(
        run_dir=str(cfg.run_dir), max_steps=int(t.max_steps),
        micro_batch_size=int(t.micro_batch_size), grad_accum=int(t.grad_accum),
        lr=float(o.lr), weight_decay=float(o.weight_decay), warmup_steps=int(o.warmup_steps),
        clip_grad=float(o.clip_grad), log_every=int(t.log_every), eval_every=int(t.eval_every),
        eval_rows=int(t.eval_rows), save_every=int(t.save_every),
        keep_checkpoints=int(t.keep_checkpoints), seed=int(cfg.seed), resume=bool(t.resume),
        stop_after=None if t.stop_after is None else int(t.stop_after),
        keep_best=str(t.get("keep_best", "last")),
        stop_after_no_gain=(None if t.get("stop_after_no_gain") is None
                            else int(t.stop_after_no_gain)),
        max_minutes=None if t.get("max_minutes") is None else float(t.max_minutes),
        epochs=None if t.get("epochs") is None else float(t.epochs),
    )


def deepspeed_config(cfg: DictConfig) -> dict | None:
    """The DeepSpeed config dict of cfg.deepspeed, or None without DeepSpeed."""
    config = cfg.deepspeed.get("config")
    return None if config is None else OmegaConf.to_container(config, resolve=True)


def training_rows(
    cfg: DictConfig, tokenizer, target: Transformer | None = None,
    store: StoreWriter | None = None,
) -> tuple[TokenRows, TokenRows]:
    """(train, held-out) packed rows of cfg.train_data at cfg.trainer.seq_len; with
    train_data.self_distill the target rewrites the assistant turns (sharegpt) or continues
    each corpus row after its first tokens (stdlib) first (writing their states into `store`
    as it generates them, when given). train_data.max_answers: the first N answers (chat
    conversations, JSON-lines documents, corpus rows) in a fixed shuffled order."""
    source, seq_len = cfg.train_data.source, positive_int(cfg, "trainer.seq_len", 2)
    for key in ("max_rows", "self_distill_rows", "max_answers"):
        if cfg.train_data.get(key) is not None:
            positive_int(cfg, f"train_data.{key}")
    answers = cfg.train_data.get("max_answers")
    if source == "stdlib":
        cache = cfg.train_data.get("cache_dir")
        train, heldout = (
            rows_from_dataset(packed_stdlib_dataset(tokenizer, split, seq_len, cache))
            for split in ("train", "heldout")
        )
        if self_distill_enabled(cfg):
            train, heldout = distilled_corpus(cfg, target, train, heldout, store)
        if answers is not None:
            train = train.select(torch.tensor(first_answers(range(len(train)), answers)))
    elif source == "jsonl":
        if not cfg.train_data.get("path"):
            raise ValueError("train_data.source=jsonl needs train_data.path=/file.jsonl")
        train, heldout = document_rows(load_jsonl_documents(cfg.train_data.path, tokenizer),
                                       seq_len, answers)
    elif source == "sharegpt":
        if not cfg.train_data.get("path"):
            raise ValueError("train_data.source=sharegpt needs train_data.path=/file.json")
        conversations = load_sharegpt(cfg.train_data.path)
        if self_distill_enabled(cfg):
            conversations = self_distill(
                conversations, target, tokenizer, seed=int(cfg.seed),
                max_new_tokens=int(cfg.train_data.self_distill_max_new_tokens),
            )
        train, heldout = chat_rows(conversations, tokenizer, seq_len, answers)
    elif source == "instructions":
        train, heldout = chat_rows(instruction_conversations(cfg, target, tokenizer),
                                   tokenizer, seq_len, answers)
    else:
        raise ValueError(f"unknown train_data.source {source!r}: choose stdlib, instructions, "
                         f"sharegpt or jsonl")
    cap = cfg.train_data.get("max_rows")
    if cap is not None:
        train = train.select(torch.arange(min(int(cap), len(train))))
    return train, heldout


def chat_rows(conversations: list[list[dict]], tokenizer, seq_len: int,
              max_answers: int | None = None) -> tuple[TokenRows, TokenRows]:
    """(train, held-out) packed chat rows; the first twentieth of the conversations is held
    out (`data.document_rows`), max_answers of the rest trained on."""
    return document_rows([render_conversation(tokenizer, c) for c in conversations], seq_len,
                         max_answers)


def instruction_conversations(cfg: DictConfig, target: Transformer | None, tokenizer
                              ) -> list[list[dict]]:
    """train_data.general_prompts general chat prompts and train_data.num_prompts
    stdlib-docstring instructions, answered by the target itself
    (always self-distilled: these prompts come without answers), batched through
    transformers' `generate` on the target's weights and cached in train_data.cache_dir."""
    if target is None:
        raise ValueError("train_data.source=instructions needs the target to answer its prompts")
    general = cfg.train_data.get("general_prompts") or 0
    check_count("train_data.general_prompts", general, 0)
    # general first: the held-out rows (the first twentieth) then come from them too
    prompts = (general_instructions(general)
               + stdlib_instructions(positive_int(cfg, "train_data.num_prompts")))
    new_tokens = positive_int(cfg, "train_data.self_distill_max_new_tokens")
    name = cache_name(weights_fingerprint(target), new_tokens)
    cache_dir = cfg.train_data.get("cache_dir")
    cache = None if cache_dir is None else os.path.join(cache_dir, name)
    def answering_model():  # the target's own weights, in transformers for batched generate
        return load_hf_model(resolve_model_path(cfg.model), cfg.model.dtype, device(cfg))

    return self_distilled_conversations(
        prompts, answering_model, tokenizer, max_new_tokens=new_tokens, cache_file=cache,
        shipped_file=shipped_answers(name),
        batch_size=positive_int(cfg, "train_data.self_distill_batch_size"))


def self_distill_enabled(cfg: DictConfig) -> bool:
    """train_data.self_distill: true, false, or auto (stdlib yes: batched and cheap;
    sharegpt no: regenerating a chat set one conversation at a time is a long job)."""
    value = cfg.train_data.get("self_distill", False)
    if value == "auto":
        return cfg.train_data.source == "stdlib"
    if not isinstance(value, bool):
        raise ValueError(f"train_data.self_distill must be true, false or auto, got {value!r}")
    return value


def distilled_corpus(
    cfg: DictConfig, target: Transformer | None, train: TokenRows, heldout: TokenRows,
    store: StoreWriter | None = None,
) -> tuple[TokenRows, TokenRows]:
    """The stdlib rows continued by the target itself: as many training rows as the run will
    draw (steps x global batch, or train_data.max_rows or self_distill_rows if fewer: the run
    then goes over them for several epochs) and the held-out rows that evaluation reads.
    store: the feature store that the generation writes (`train/store.py`), a shard of
    store.rows_per_shard rows per generated batch."""
    if target is None:
        raise ValueError("train_data.self_distill needs the target to generate with")
    t = cfg.trainer
    drawn = (int(t.max_steps) * int(t.micro_batch_size) * int(t.grad_accum)
             * int(os.environ.get("WORLD_SIZE", "1")))
    caps = (cfg.train_data.get(key) for key in ("max_rows", "self_distill_rows"))
    count = min([drawn, *(int(cap) for cap in caps if cap is not None)])
    options = {"prompt_tokens": int(cfg.train_data.self_distill_prompt_tokens),
               "cache_dir": cfg.train_data.get("cache_dir"), "store": store}
    if store is not None:
        options["batch_size"] = positive_int(cfg, "store.rows_per_shard")
    return (self_distill_rows(train, target, count=count, store_prefix="train", **options),
            self_distill_rows(heldout, target, count=int(t.eval_rows), store_prefix="heldout",
                              **options))

