"""Build selfspec's default tiny target (and its distilled draft) from the stdlib source.

    python scripts/build_tiny.py --stage all --threads 1 --target-minutes 70 --draft-minutes 12

Stages, each reading the previous one's output from ``--out``:
  tokenizer  byte-level BPE on the train split          -> <out>/tokenizer/
  target     selfspec-tiny, LlamaForCausalLM from scratch -> <out>/target/
  draft      selfspec-tiny-draft, distilled from target   -> <out>/draft/
Both models train through ``selfspec.training.loop.fit``; its run folders (checkpoints, run config)
are <out>/_work/target/ and <out>/_work/draft/ (never shipped); ``--resume`` continues them.
A time budget becomes a step count at a run's start, from the measured speed of a few steps.
``--quick`` runs the same recipe in seconds with toy sizes (for tests).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from selfspec.cli import exit_on_user_error
from selfspec.corpus import HELDOUT_BUCKETS, read_source, stdlib_files, stdlib_manifest_sha256
from selfspec.divergences import kl_to_teacher
from selfspec.errors import SelfspecError
from selfspec.heads.base import LossOutput
from selfspec.training.checkpoints import CHECKPOINT_PREFIX, RUN_CONFIG, record_run_config
from selfspec.training.data import EOS_TOKEN, pack_token_stream, token_stream
from selfspec.training.loop import TrainSettings, fit, make_accelerator
from selfspec.training.rows import TokenRows

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "selfspec" / "assets" / "tiny"
HELDOUT_SCRIPT = REPO / "scripts" / "heldout_loss.py"
MIN_LR_RATIO = 0.1  # cosine decays to a tenth of the peak, not to zero
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1
NEXT_TOKEN = "next_token_loss"  # the metric both objectives report; fit evaluates it held out
HELDOUT_METRIC = f"eval/{NEXT_TOKEN}"


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Recipe:
    """Everything that decides what gets built, apart from the CLI's budgets and seed."""

    vocab_size: int
    seq_len: int
    batch_size: int
    target: ModelSpec
    draft: ModelSpec
    target_lr: float
    draft_lr: float
    warmup_steps: int
    log_every: int
    eval_every: int
    eval_tokens: int  # periodic held-out check on a prefix of the held-out stream
    final_eval_tokens: int | None  # the model card's number; None: heldout_loss.py's default
    max_files: int | None = None  # quick: train on a handful of small files only
    target_steps: int | None = None  # quick: fixed step counts instead of time budgets
    draft_steps: int | None = None


FULL = Recipe(vocab_size=4096, seq_len=256, batch_size=16,
              target=ModelSpec(8, 256, 8, 4, 688), draft=ModelSpec(2, 128, 4, 2, 344),
              target_lr=1e-3, draft_lr=2e-3, warmup_steps=50, log_every=10, eval_every=100,
              eval_tokens=16_384, final_eval_tokens=None)
QUICK = Recipe(vocab_size=384, seq_len=32, batch_size=4,
               target=ModelSpec(1, 32, 2, 1, 64), draft=ModelSpec(1, 16, 2, 1, 32),
               target_lr=3e-3, draft_lr=3e-3, warmup_steps=2, log_every=1, eval_every=2,
               eval_tokens=256, final_eval_tokens=1024, max_files=6, target_steps=4,
               draft_steps=3)


@dataclass
class Ctx:
    """One invocation: parsed flags, recipe, folders and the command that reproduces it."""

    args: argparse.Namespace
    recipe: Recipe
    out: Path
    command: str

    @property
    def work(self) -> Path:
        return self.out / "_work"


# ----------------------------------------------------------------------------- tokenizer


def corpus_files(recipe: Recipe) -> list[Path]:
    """Training files: the whole train split, or a handful of small ones for --quick."""
    files = stdlib_files("train")
    if recipe.max_files:
        files = [f for f in files if 2_000 <= f.stat().st_size <= 12_000][: recipe.max_files]
    return files


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (lossless on any text) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read_source(f) for f in tqdm(files, desc="tokenizer")), trainer)
    # no cleanup of spaces on decode: the round trip must be exact for source code
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN,
                                   eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   clean_up_tokenization_spaces=False)


def corpus_facts(recipe: Recipe, files: list[Path]) -> dict:
    """What the data was, for the model cards: Python version, manifest hash, file counts."""
    return {"python": platform.python_version(),
            "stdlib_manifest_sha256": stdlib_manifest_sha256("all"),
            "train_files": len(stdlib_files("train")),
            "heldout_files": len(stdlib_files("heldout")),
            "files_used_for_training": len(files), "quick": recipe.max_files is not None}


def stage_tokenizer(ctx: Ctx) -> None:
    folder = ctx.out / "tokenizer"
    if ctx.args.resume and (folder / "tokenizer.json").is_file():
        print(f"[tokenizer] kept {folder} (--resume)")
        return
    files = corpus_files(ctx.recipe)
    tokenizer = train_tokenizer(files, ctx.recipe.vocab_size)
    tokenizer.save_pretrained(folder)
    facts = corpus_facts(ctx.recipe, files)
    (folder / "corpus.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(f"[tokenizer] vocab {len(tokenizer)} from {len(files)} files -> {folder}")


def load_tokenizer(ctx: Ctx):
    """The stage-1 tokenizer, refusing one built from a different stdlib."""
    from transformers import AutoTokenizer

    folder = ctx.out / "tokenizer"
    if not (folder / "corpus.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {folder}: run --stage tokenizer first")
    facts = json.loads((folder / "corpus.json").read_text())
    if facts["stdlib_manifest_sha256"] != stdlib_manifest_sha256("all"):
        raise RuntimeError(f"{folder} was built from another stdlib (Python {facts['python']}"
                           f", this is {platform.python_version()}): rebuild the tokenizer")
    return AutoTokenizer.from_pretrained(folder), facts


# ----------------------------------------------------------------------------- data, models


@dataclass
class Data:
    train: TokenRows  # [N, T] packed training windows
    heldout: TokenRows  # [M, T] periodic held-out check


def every_token(windows: torch.Tensor) -> TokenRows:
    """Rows of which every token is to be predicted (plain language modelling)."""
    return TokenRows(windows, torch.ones_like(windows))


def load_data(ctx: Ctx, tokenizer) -> Data:
    t0, r = time.monotonic(), ctx.recipe
    ids = token_stream(tokenizer, tqdm(corpus_files(r), desc="tokenize"))
    train = pack_token_stream(ids, r.seq_len)
    # the held-out stream as scripts/heldout_loss.py reads it, cut short
    heldout_ids = token_stream(tokenizer, stdlib_files("heldout"), max_tokens=r.eval_tokens)
    heldout = pack_token_stream(heldout_ids, r.seq_len)
    print(f"[data] {len(ids)} train tokens -> {tuple(train.shape)} windows, held-out check "
          f"{tuple(heldout.shape)} ({time.monotonic() - t0:.0f}s)")
    return Data(every_token(train), every_token(heldout))


def llama_config(spec: ModelSpec, tokenizer):
    from transformers import LlamaConfig

    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)


def new_model(spec: ModelSpec, tokenizer, seed: int) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # the initial weights depend on the seed only
    return LlamaForCausalLM(llama_config(spec, tokenizer)).float().train()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- objectives


def decay_groups(model: nn.Module) -> list[dict]:
    """AdamW groups for `fit`: weight decay on matrices, none on norms (1-D), which only scale."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY,
             "betas": BETAS},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "betas": BETAS}]


class NextTokenObjective(nn.Module):
    """The target's objective for `fit`: next-token cross entropy of a causal LM (HF's own
    loss; a token whose loss_mask is 0 is not predicted)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def param_groups(self, lr: float) -> list[dict]:
        return decay_groups(self.model)  # every group at fit's lr

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        loss = self.predict(tokens, loss_mask).loss
        return LossOutput(loss, {NEXT_TOKEN: float(loss.detach())})

    def predict(self, tokens: torch.Tensor, loss_mask: torch.Tensor):
        labels = tokens.masked_fill(loss_mask == 0, -100)  # -100: HF's loss skips the token
        return self.model(input_ids=tokens, labels=labels)


class DistillObjective(NextTokenObjective):
    """The draft's objective: (1 - hard_weight) x KL(teacher || draft) of the next-token laws
    (`kl_to_teacher`) + hard_weight x next-token cross entropy. The teacher is frozen, so fit
    trains and checkpoints the draft alone."""

    def __init__(self, model: nn.Module, teacher: nn.Module, hard_weight: float):
        super().__init__(model)
        self.teacher, self.hard_weight = teacher.requires_grad_(False).eval(), hard_weight

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=tokens).logits  # [B, T, V]
        out = self.predict(tokens, loss_mask)
        kl = kl_to_teacher(out.logits, teacher_logits, loss_mask)
        loss = (1.0 - self.hard_weight) * kl + self.hard_weight * out.loss
        return LossOutput(loss, {"kl": float(kl.detach()), NEXT_TOKEN: float(out.loss.detach())})


# ----------------------------------------------------------------------------- training


@dataclass
class Job:
    name: str  # "target" or "draft": names the run folder
    peak_lr: float
    warmup_steps: int
    budget_s: float  # either a time budget ...
    max_steps: int | None  # ... or a fixed number of steps (reproducible to the bit)
    batch_size: int
    seed: int
    log_every: int
    eval_every: int
    ckpt_s: float


@dataclass(frozen=True)
class Plan:
    """A run in steps: its length (the fixed count, or the time budget at the measured speed)
    and its checkpoint interval."""

    seconds_per_step: float
    steps: int
    save_every: int


def plan_steps(job: Job, seconds_per_step: float) -> Plan:
    steps = job.max_steps or max(1, round(job.budget_s / seconds_per_step))
    return Plan(seconds_per_step, steps, max(1, round(job.ckpt_s / seconds_per_step)))


def measure_step_seconds(objective: nn.Module, rows: TokenRows, batch_size: int, accelerator,
                         repeats: int = 3) -> float:
    """Seconds of one training step (forward, backward, AdamW) on the training device: the
    median of `repeats` after a warm-up, on a throwaway copy of the objective."""
    probe = copy.deepcopy(objective).to(accelerator.device)
    optimizer = torch.optim.AdamW(p for p in probe.parameters() if p.requires_grad)
    batch = rows.select(torch.arange(batch_size)).to(accelerator.device)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with accelerator.autocast():
            loss = probe(batch.tokens, batch.loss_mask).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # waits for the device
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


class TrainingRecord:
    """`fit`'s tracker here: the loss-curve rows (mean train loss since the previous row; the
    held-out loss where fit evaluated), training seconds and each session's command. It is
    saved with every checkpoint (accelerate's custom state), so a resume continues all three
    where the checkpoint left them."""

    def __init__(self, job: Job, steps: int, tokens_per_step: int, command: str):
        self.name, self.log_every, self.steps = job.name, job.log_every, steps
        self.tokens_per_step = tokens_per_step
        self.step, self.elapsed_s, self.curve, self.commands = 0, 0.0, [], [command]
        self.losses: list[float] = []
        self.earlier_s, self.clock = 0.0, time.monotonic()  # earlier sessions, this one's start

    @property
    def tokens(self) -> int:
        return self.step * self.tokens_per_step

    def state_dict(self) -> dict:
        return {"step": self.step, "elapsed_s": self.elapsed_s, "curve": self.curve,
                "commands": self.commands}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.elapsed_s, self.curve = state["step"], state["elapsed_s"], state["curve"]
        self.commands = [*state["commands"], self.commands[-1]]
        self.earlier_s, self.clock = self.elapsed_s, time.monotonic()

    def resumed_at(self, step: int) -> None:
        if step:
            print(f"[{self.name}] resumed at step {step} ({self.elapsed_s / 60:.1f} min done)")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Called by fit after every step (log_every=1); keeps a row every log_every steps,
        at every held-out check and at the end."""
        self.losses.append(metrics["loss"])
        self.step, self.elapsed_s = step, self.earlier_s + time.monotonic() - self.clock
        heldout = metrics.get(HELDOUT_METRIC)
        if step % self.log_every and heldout is None and step < self.steps:
            return
        self.curve.append({"step": step, "train_loss": statistics.fmean(self.losses),
                           "heldout_loss": heldout, "tokens_seen": self.tokens,
                           "elapsed_s": round(self.elapsed_s, 1), "lr": metrics["lr"]})
        self.losses.clear()
        if heldout is not None:
            tqdm.write(f"[{self.name}] step {step} train {self.curve[-1]['train_loss']:.3f} "
                       f"held-out {heldout:.3f} tokens {self.tokens} "
                       f"{self.elapsed_s / 60:.1f} min")


@dataclass
class Trained:
    """What the model card says about a finished run."""

    job: Job
    plan: Plan
    record: TrainingRecord
    precision: str


def has_checkpoint(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*"))


def run_folder(ctx: Ctx, name: str) -> Path:
    """<out>/_work/<name>, fit's run folder: a checkpoint there is continued (--resume) or
    discarded (--fresh), never silently dropped."""
    folder = ctx.work / name
    if has_checkpoint(folder) and not (ctx.args.resume or ctx.args.fresh):
        raise FileExistsError(f"{folder} holds a checkpoint: pass --resume to continue it or "
                              "--fresh to discard it")
    if not ctx.args.resume and folder.exists():
        shutil.rmtree(folder)
    return folder


def step_seconds(run_dir: Path, resume: bool, measure: Callable[[], float]) -> float:
    """The run's speed: measured at its start, then read back from its run config, so that a
    resume plans the same steps."""
    saved = run_dir / RUN_CONFIG
    if resume and saved.is_file():
        return json.loads(saved.read_text())["seconds_per_step"]
    return measure()


def keep_run_config(run_dir: Path, config: dict, resume: bool) -> None:
    """fit's run config; a resume that would change it is refused, naming the flags' way out."""
    try:
        record_run_config(run_dir, config, resume=resume)
    except SelfspecError as error:
        raise SelfspecError(f"{error} (here: rerun with the original flags, or --fresh to "
                            "start over)") from None


def train(ctx: Ctx, run_dir: Path, job: Job, objective: nn.Module, data: Data,
          config: dict) -> Trained:
    """Train the objective through `fit` (checkpointed in run_dir, resumed under --resume)."""
    # one process, no accumulation: the accelerator reads no step counts from its settings
    accelerator = make_accelerator(TrainSettings(str(run_dir), max_steps=1))
    seconds = step_seconds(run_dir, ctx.args.resume, lambda: measure_step_seconds(
        objective, data.train, job.batch_size, accelerator))
    keep_run_config(run_dir, {**config, "seconds_per_step": seconds}, ctx.args.resume)
    plan = plan_steps(job, seconds)
    record = TrainingRecord(job, plan.steps, job.batch_size * ctx.recipe.seq_len, ctx.command)
    accelerator.register_for_checkpointing(record)
    settings = TrainSettings(
        run_dir=str(run_dir), max_steps=plan.steps, micro_batch_size=job.batch_size,
        lr=job.peak_lr, warmup_steps=job.warmup_steps, min_lr_ratio=MIN_LR_RATIO, clip_grad=1.0,
        log_every=1, eval_every=job.eval_every, eval_rows=len(data.heldout),
        save_every=plan.save_every, keep_checkpoints=1, seed=job.seed, resume=ctx.args.resume)
    fit(objective, data.train, data.heldout, settings, accelerator=accelerator, tracker=record)
    precision = "fp32" if accelerator.mixed_precision == "no" else accelerator.mixed_precision
    return Trained(job, plan, record, precision)


# ----------------------------------------------------------------------------- export, cards


def measure_heldout(folder: Path, recipe: Recipe) -> dict:
    """The card's held-out numbers, by scripts/heldout_loss.py's own `measure` (the command the
    card tells readers to rerun), called in this process: a second Python would spend longer
    importing transformers than the measure takes."""
    spec = importlib.util.spec_from_file_location("heldout_loss", HELDOUT_SCRIPT)
    heldout_loss = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout_loss)
    max_tokens = recipe.final_eval_tokens or heldout_loss.DEFAULT_MAX_TOKENS
    return heldout_loss.measure(folder, max_tokens, recipe.seq_len)


def export(model, tokenizer, folder: Path, recipe: Recipe) -> dict:
    """float16 safetensors + tokenizer files, then the held-out measure of what was saved."""
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.float16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    metrics = measure_heldout(folder, recipe)
    return {**metrics, "model": folder.name}  # no build-machine path in shipped files


@dataclass
class Card:
    """What a model card says; filled by the target and draft stages."""

    name: str
    summary: str
    model: nn.Module
    corpus: dict
    trained: Trained
    metrics: dict
    training_notes: list[str]
    stage_wall_s: float


def architecture_lines(model) -> list[str]:
    c = model.config
    return [f"- `LlamaForCausalLM`: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads ({c.num_key_value_heads} kv heads), "
            f"intermediate {c.intermediate_size}, vocab {c.vocab_size}, untied embeddings, "
            f"max_position_embeddings {c.max_position_embeddings}",
            f"- parameters: {n_params(model):,} ({n_params(model) / 1e6:.2f}M), stored as "
            "float16 safetensors; load in float32 on CPU (fp16/bf16 matmuls crawl there)"]


def data_lines(corpus: dict) -> list[str]:
    quick = " (--quick: a handful of small files only)" if corpus["quick"] else ""
    return [f"- source: the standard library `.py` files of Python {corpus['python']} "
            "(`sysconfig.get_paths()['stdlib']`), without site-packages and test folders "
            f"(test/, tests/, idle_test/){quick}",
            f"- file-list sha256 (relative paths + content hashes, `selfspec.corpus."
            f"stdlib_manifest_sha256()`): `{corpus['stdlib_manifest_sha256']}`",
            f"- split by file (sha256 of the relative path, 1 bucket in {HELDOUT_BUCKETS} held "
            f"out): {corpus['train_files']} train files, {corpus['heldout_files']} held-out "
            f"files; trained on {corpus['files_used_for_training']} files",
            f"- tokenizer: byte-level BPE (`tokenizers`), `{EOS_TOKEN}` as bos/eos/pad; "
            "documents joined with eos"]


def budget_text(job: Job, plan: Plan) -> str:
    if job.max_steps is not None:
        return f"{job.max_steps} steps"
    return (f"{job.budget_s / 60:.0f} min of training time ({plan.steps} steps at "
            f"{plan.seconds_per_step:.3f} s/step, measured at the start)")


def training_lines(card: Card, recipe: Recipe) -> list[str]:
    job, plan, rec = card.trained.job, card.trained.plan, card.trained.record
    return [*card.training_notes,
            f"- {rec.step} steps x batch {job.batch_size} x {recipe.seq_len} tokens: "
            f"{rec.tokens:,} tokens seen ({rec.tokens / max(rec.elapsed_s, 1e-9):.0f} tok/s)",
            f"- AdamW (betas {BETAS[0]:g}/{BETAS[1]:g}, wd {WEIGHT_DECAY:g}), peak lr "
            f"{job.peak_lr:g}, {job.warmup_steps} warmup steps, cosine to {MIN_LR_RATIO:g}x "
            f"over a budget of {budget_text(job, plan)}; grad clip 1.0; "
            f"{card.trained.precision}; `selfspec.training.loop.fit`",
            f"- training time {rec.elapsed_s / 60:.1f} min over {len(rec.commands)} session(s); "
            f"this stage's last session {card.stage_wall_s / 60:.1f} min wall",
            f"- seed {job.seed}, {torch.get_num_threads()} torch thread(s), torch "
            f"{torch.__version__}, transformers {transformers_version()}"]


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def model_card(card: Card, recipe: Recipe) -> str:
    m = card.metrics
    result = [f"- held-out loss **{m['heldout_loss']:.4f}** nats/token, perplexity "
              f"**{m['perplexity']:.2f}**, on the first {m['tokens']:,} predicted held-out "
              f"tokens (windows of {m['seq_len']}; rerun with `python scripts/heldout_loss.py "
              "FOLDER`)"]
    commands = [f"    {c}" for c in card.trained.record.commands]
    sections = [f"# {card.name}", "", card.summary, "", "## Architecture",
                *architecture_lines(card.model), "", "## Data", *data_lines(card.corpus), "",
                "## Training", *training_lines(card, recipe), "", "## Results", *result, "",
                "## Build", "Built (and resumed, if more than one line) with:", "",
                *commands, "", "Loss curve: `loss_curve.json` (step, train loss, periodic "
                "held-out loss on a short prefix of the held-out split, tokens, seconds).", "",
                "## Use", "", "    import torch",
                "    from transformers import AutoModelForCausalLM, AutoTokenizer",
                "    tok = AutoTokenizer.from_pretrained(FOLDER)",
                "    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)",
                ""]
    return "\n".join(sections)


def write_card_and_curve(folder: Path, card: Card, recipe: Recipe) -> None:
    (folder / "README.md").write_text(model_card(card, recipe))
    rec = card.trained.record
    curve = {"model": card.name, "final": card.metrics, "steps": rec.step,
             "tokens_seen": rec.tokens, "elapsed_s": round(rec.elapsed_s, 1),
             "curve": rec.curve}
    (folder / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")


def finished(folder: Path) -> bool:
    return (folder / "README.md").is_file() and (folder / "loss_curve.json").is_file()


# ----------------------------------------------------------------------------- stages


def job_for(ctx: Ctx, name: str) -> Job:
    r, a = ctx.recipe, ctx.args
    minutes = a.target_minutes if name == "target" else a.draft_minutes
    steps = a.target_steps if name == "target" else a.draft_steps
    steps = steps or (r.target_steps if name == "target" else r.draft_steps)
    return Job(name=name, peak_lr=r.target_lr if name == "target" else r.draft_lr,
               warmup_steps=r.warmup_steps, budget_s=minutes * 60.0, max_steps=steps,
               batch_size=r.batch_size, seed=a.seed + (name == "draft"),
               log_every=r.log_every, eval_every=r.eval_every, ckpt_s=a.ckpt_minutes * 60.0)


def run_config(job: Job, spec: ModelSpec, tokenizer_file: Path, extra: dict) -> dict:
    """What a run must agree with to be resumed (budgets may change, sizes may not)."""
    tok_sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    return {"spec": asdict(spec), "seed": job.seed, "batch_size": job.batch_size,
            "peak_lr": job.peak_lr, "max_steps": job.max_steps, "tokenizer_sha256": tok_sha,
            **extra}


def kept_under_resume(ctx: Ctx, name: str) -> bool:
    """--resume keeps a stage whose folder is finished and whose run was checkpointed."""
    kept = ctx.args.resume and finished(ctx.out / name) and has_checkpoint(ctx.work / name)
    if kept:
        print(f"[{name}] kept finished {ctx.out / name} (--resume)")
    return kept


@dataclass
class StageRun:
    """A stage's trained model and what its card reports."""

    model: nn.Module
    corpus: Any
    trained: Any
    metrics: dict
    started: float


def run_stage(ctx: Ctx, name: str, objective_of: Callable[[nn.Module], nn.Module],
              config_extra: dict, also: str = "") -> StageRun:
    """A fresh model of the recipe's `name` spec trained by `fit` on objective_of(model), and
    exported to <out>/<name>; also: what the first line adds about the stage."""
    started = time.monotonic()
    run_dir = run_folder(ctx, name)
    tokenizer, corpus = load_tokenizer(ctx)
    job, spec = job_for(ctx, name), getattr(ctx.recipe, name)
    model = new_model(spec, tokenizer, job.seed)
    print(f"[{name}] {n_params(model):,} parameters, {spec}{also}")
    config = run_config(job, spec, ctx.out / "tokenizer" / "tokenizer.json", config_extra)
    trained = train(ctx, run_dir, job, objective_of(model), load_data(ctx, tokenizer), config)
    metrics = export(model, tokenizer, ctx.out / name, ctx.recipe)
    return StageRun(model, corpus, trained, metrics, started)


def stage_target(ctx: Ctx) -> None:
    if kept_under_resume(ctx, "target"):
        return
    run = run_stage(ctx, "target", NextTokenObjective, {})
    card = Card("selfspec-tiny", "selfspec's default target: a small Llama-family code model "
                "trained from scratch on the Python standard library, with no model hub.",
                run.model, run.corpus, run.trained, run.metrics, ["- objective: next-token "
                "cross entropy on packed windows, from a random init"],
                time.monotonic() - run.started)
    write_card_and_curve(ctx.out / "target", card, ctx.recipe)
    print(f"[target] held-out loss {run.metrics['heldout_loss']:.4f} "
          f"(ppl {run.metrics['perplexity']:.2f}) -> {ctx.out / 'target'}")


def load_teacher(ctx: Ctx) -> tuple[nn.Module, dict]:
    """The shipped target (its fp16 weights in fp32: fp16 crawls on CPU) and its measured
    held-out numbers."""
    from transformers import AutoModelForCausalLM

    folder = ctx.out / "target"
    if not finished(folder):
        raise FileNotFoundError(f"no finished target in {folder}: run --stage target first")
    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return teacher, json.loads((folder / "loss_curve.json").read_text())["final"]


def compare_lines(draft: dict, target: dict) -> tuple[bool, str]:
    weaker = draft["heldout_loss"] > target["heldout_loss"]
    verdict = "weaker than the target, as a baseline draft must be" if weaker else (
        "NOT weaker than the target: the baseline is unfair, train the target longer")
    return weaker, (f"- draft held-out loss {draft['heldout_loss']:.4f} vs target "
                    f"{target['heldout_loss']:.4f}: {verdict}")


def stage_draft(ctx: Ctx) -> None:
    if kept_under_resume(ctx, "draft"):
        return
    teacher, target_metrics = load_teacher(ctx)
    hard = ctx.args.hard_weight
    run = run_stage(ctx, "draft", lambda model: DistillObjective(model, teacher, hard),
                    {"hard_weight": hard}, f"; teacher {n_params(teacher):,}")
    weaker, comparison = compare_lines(run.metrics, target_metrics)
    notes = [f"- distilled from selfspec-tiny (`../target`, {n_params(teacher):,} parameters): "
             f"loss = {1 - hard:g} x KL(target || draft) of the next-token laws "
             f"(`selfspec.divergences.kl_to_teacher`) + {hard:g} x next-token cross entropy; "
             "the curve's train loss is that mix", comparison]
    card = Card("selfspec-tiny-draft", "The small-draft-model baseline for selfspec-tiny: same "
                "tokenizer, distilled from the target so that it imitates it.", run.model,
                run.corpus, run.trained, run.metrics, notes, time.monotonic() - run.started)
    write_card_and_curve(ctx.out / "draft", card, ctx.recipe)
    print(f"[draft] {comparison[2:]} -> {ctx.out / 'draft'}")
    if not weaker:
        print("[draft] WARNING: the draft is not weaker than the target", file=sys.stderr)


STAGES = {"tokenizer": [stage_tokenizer], "target": [stage_target], "draft": [stage_draft],
          "all": [stage_tokenizer, stage_target, stage_draft]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=sorted(STAGES), default="all")
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    p.add_argument("--target-minutes", type=float, default=70.0,
                   help="training-time budget of the target (turned into steps at its start)")
    p.add_argument("--draft-minutes", type=float, default=12.0)
    p.add_argument("--target-steps", type=int, default=None,
                   help="fixed step count instead of the time budget (bit-reproducible)")
    p.add_argument("--draft-steps", type=int, default=None)
    p.add_argument("--hard-weight", type=float, default=0.1,
                   help="weight of the hard-label loss in the draft's distillation mix")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-minutes", type=float, default=3.0, help="checkpoint interval")
    p.add_argument("--resume", action="store_true", help="continue from <out>/_work/")
    p.add_argument("--fresh", action="store_true", help="discard <out>/_work/ checkpoints")
    p.add_argument("--quick", action="store_true", help="seconds-long toy build (needs --out)")
    args = p.parse_args(argv)
    if args.quick and args.out is None:
        p.error("--quick needs --out: it must not overwrite the shipped models")
    if args.resume and args.fresh:
        p.error("--resume and --fresh contradict each other")
    if not 0.0 <= args.hard_weight <= 1.0:
        p.error("--hard-weight must be in [0, 1]")
    if min(args.target_minutes, args.draft_minutes, args.ckpt_minutes, args.threads) <= 0:
        p.error("budgets, --ckpt-minutes and --threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ctx = Ctx(args, QUICK if args.quick else FULL, (args.out or DEFAULT_OUT).resolve(),
              shlex.join(["python", "scripts/build_tiny.py", *argv]))
    t0 = time.monotonic()
    for stage in STAGES[args.stage]:
        stage(ctx)
    print(f"[build_tiny] {args.stage} done in {(time.monotonic() - t0) / 60:.1f} min -> "
          f"{ctx.out} (checkpoints in {ctx.work}, not to be shipped)")
    return 0


if __name__ == "__main__":
    if not sys.stderr.isatty():  # a log file: a progress line every 30 s, not every step
        os.environ.setdefault("TQDM_MININTERVAL", "30")
    sys.exit(exit_on_user_error(main))
