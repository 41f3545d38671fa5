"""Build selfspec's default tiny target (and its distilled draft) from the stdlib source.

    python scripts/build_tiny.py --stage all --threads 1 --target-minutes 70 --draft-minutes 12

Stages, each reading the previous one's output from ``--out``:
  tokenizer  byte-level BPE on the train split          -> <out>/tokenizer/
  target     selfspec-tiny, LlamaForCausalLM from scratch -> <out>/target/
  draft      selfspec-tiny-draft, distilled from target   -> <out>/draft/
Training checkpoints go to <out>/_work/ (never shipped); ``--resume`` continues from them.
``--quick`` runs the same recipe in seconds with toy sizes (for tests).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import heldout_loss  # sibling script: scripts/ is on sys.path when run as a script
import torch
import torch.nn.functional as F
from tqdm import tqdm

from selfspec.cli import exit_on_user_error
from selfspec.data import (
    EOS_TOKEN,
    HELDOUT_BUCKETS,
    pack_token_stream,
    read_source,
    stdlib_files,
    stdlib_manifest_sha256,
    token_stream,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "selfspec" / "assets" / "tiny"
MIN_LR_RATIO = 0.1  # cosine decays to a tenth of the peak, not to zero


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
    final_eval_tokens: int  # the model card's number, same as scripts/heldout_loss.py
    max_files: int | None = None  # quick: train on a handful of small files only
    target_steps: int | None = None  # quick: fixed step counts instead of time budgets
    draft_steps: int | None = None


FULL = Recipe(vocab_size=4096, seq_len=256, batch_size=16,
              target=ModelSpec(8, 256, 8, 4, 688), draft=ModelSpec(2, 128, 4, 2, 344),
              target_lr=1e-3, draft_lr=2e-3, warmup_steps=50, log_every=10, eval_every=100,
              eval_tokens=16_384, final_eval_tokens=heldout_loss.DEFAULT_MAX_TOKENS)
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
    train: torch.Tensor  # [N, T] packed training windows
    heldout: torch.Tensor  # [M, T] periodic held-out check
    train_tokens: int


def load_data(ctx: Ctx, tokenizer) -> Data:
    t0 = time.monotonic()
    ids = token_stream(tokenizer, tqdm(corpus_files(ctx.recipe), desc="tokenize"))
    train = pack_token_stream(ids, ctx.recipe.seq_len)
    heldout = heldout_loss.heldout_windows(tokenizer, ctx.recipe.eval_tokens, ctx.recipe.seq_len)
    print(f"[data] {len(ids)} train tokens -> {tuple(train.shape)} windows, held-out check "
          f"{tuple(heldout.shape)} ({time.monotonic() - t0:.0f}s)")
    return Data(train, heldout, len(ids))


def llama_config(spec: ModelSpec, tokenizer):
    from transformers import LlamaConfig

    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)


def new_model(spec: ModelSpec, tokenizer, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # the initial weights depend on the seed only
    return LlamaForCausalLM(llama_config(spec, tokenizer)).float().train()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- training loop


@dataclass
class Job:
    name: str  # "target" or "draft": names the checkpoint file
    peak_lr: float
    warmup_steps: int
    budget_s: float | None  # either a time budget ...
    max_steps: int | None  # ... or a fixed number of steps (reproducible to the bit)
    batch_size: int
    seed: int
    log_every: int
    eval_every: int
    ckpt_s: float


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # training seconds, summed over every session that resumed
    curve: list[dict] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    done: bool = False
    lr: float = 0.0  # the learning rate of the last step taken


def progress(job: Job, state: TrainState) -> float:
    if job.max_steps is not None:
        return state.step / job.max_steps
    return state.elapsed / job.budget_s


def lr_at(job: Job, state: TrainState) -> float:
    """Linear warmup, then cosine over the budget (time or steps) down to MIN_LR_RATIO."""
    warm = min(1.0, (state.step + 1) / job.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress(job, state), 1.0)))
    return job.peak_lr * warm * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cos)


def batch_at(windows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Batch number `step` of a per-epoch shuffle: a pure function of step, so resume is exact."""
    per_epoch = len(windows) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(windows)} windows do not fill one batch of {batch_size}")
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(
        seed * 1_000_003 + epoch))
    return windows[order[index * batch_size:(index + 1) * batch_size]]  # [B, T]


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D), which only scale."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def save_checkpoint(path: Path, model, opt, state: TrainState, meta: dict) -> None:
    """Atomic (write then rename): a stop mid-save leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
            "meta": meta, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
    torch.save(blob, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def restore_checkpoint(path: Path, model, opt, meta: dict) -> TrainState:
    blob = torch.load(path, map_location="cpu", weights_only=False)
    if blob["meta"] != meta:
        diff = {k: (blob["meta"].get(k), v) for k, v in meta.items() if blob["meta"].get(k) != v}
        raise RuntimeError(f"{path} was made with other settings (saved, now): {diff}; "
                           "rerun with the original flags, or --fresh to start over")
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    random.setstate(blob["py_rng"])
    return TrainState(**blob["state"])


def start_state(ctx: Ctx, job: Job, model, opt, meta: dict) -> TrainState:
    """Fresh state, or the checkpoint's under --resume; never silently drops a checkpoint."""
    path = ctx.work / f"{job.name}.pt"
    if path.is_file() and ctx.args.fresh:
        path.unlink()
    if path.is_file() and not ctx.args.resume:
        raise FileExistsError(f"{path} exists: pass --resume to continue it or --fresh to "
                              "discard it")
    state = restore_checkpoint(path, model, opt, meta) if path.is_file() else TrainState()
    if path.is_file():
        print(f"[{job.name}] resumed at step {state.step} ({state.elapsed / 60:.1f} min done)")
    state.commands.append(ctx.command)
    return state


LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def train_step(job: Job, model, opt, loss_fn: LossFn, data: Data, state: TrainState) -> float:
    state.lr = lr_at(job, state)
    for group in opt.param_groups:
        group["lr"] = state.lr
    batch = batch_at(data.train, state.step, job.batch_size, job.seed)
    loss = loss_fn(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    state.step += 1
    state.tokens += batch.numel()
    return loss.item()


def log_point(job: Job, model, data: Data, state: TrainState, losses: list[float]) -> None:
    """Append one loss-curve row (mean train loss since the last row, held-out every so often)."""
    row = {"step": state.step, "train_loss": sum(losses) / len(losses), "heldout_loss": None,
           "tokens_seen": state.tokens, "elapsed_s": round(state.elapsed, 1),
           "lr": state.lr}
    if state.step % job.eval_every == 0 or progress(job, state) >= 1.0:
        row["heldout_loss"] = heldout_loss.mean_token_loss(model, data.heldout, progress=False)[0]
        tqdm.write(f"[{job.name}] step {state.step} train {row['train_loss']:.3f} held-out "
                   f"{row['heldout_loss']:.3f} tokens {state.tokens} "
                   f"{state.elapsed / 60:.1f} min")
    state.curve.append(row)
    losses.clear()


def progress_bar(job: Job, state: TrainState) -> tqdm:
    # in a log file, one line every 30 s instead of a redraw per step
    interval = 0.5 if sys.stderr.isatty() else 30.0
    if job.max_steps is not None:
        return tqdm(total=job.max_steps, initial=state.step, desc=job.name, unit="step",
                    mininterval=interval)
    return tqdm(total=int(job.budget_s), initial=int(state.elapsed), desc=job.name, unit="s",
                mininterval=interval)


def fit(ctx: Ctx, job: Job, model, loss_fn: LossFn, data: Data, meta: dict) -> TrainState:
    """One training loop for target and draft: budgeted, checkpointed, resumable."""
    opt = make_optimizer(model, job.peak_lr)
    state = start_state(ctx, job, model, opt, meta)
    path, losses = ctx.work / f"{job.name}.pt", []
    bar, last_save = progress_bar(job, state), time.monotonic()
    clock = time.monotonic() - state.elapsed
    while not state.done:
        losses.append(train_step(job, model, opt, loss_fn, data, state))
        state.elapsed = time.monotonic() - clock
        state.done = progress(job, state) >= 1.0
        bar.update(state.step - bar.n if job.max_steps else int(state.elapsed) - bar.n)
        bar.set_postfix(step=state.step, loss=f"{losses[-1]:.3f}",
                        tok_s=f"{state.tokens / max(state.elapsed, 1e-9):.0f}", refresh=False)
        if state.step % job.log_every == 0 or state.done:
            log_point(job, model, data, state, losses)
        if state.done or time.monotonic() - last_save > job.ckpt_s:
            save_checkpoint(path, model, opt, state, meta)
            last_save = time.monotonic()
    bar.close()
    return state


# ----------------------------------------------------------------------------- export, cards


def export(model, tokenizer, folder: Path, recipe: Recipe) -> dict:
    """float16 safetensors + tokenizer files, then the held-out measure of what was saved."""
    folder.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.float16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    metrics = heldout_loss.measure(folder, recipe.final_eval_tokens, recipe.seq_len)
    return {**metrics, "model": folder.name}  # no build-machine path in shipped files


@dataclass
class Card:
    """What a model card says; filled by the target and draft stages."""

    name: str
    summary: str
    model: torch.nn.Module
    corpus: dict
    job: Job
    state: TrainState
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
            f"- file-list sha256 (relative paths + content hashes, `selfspec.data."
            f"stdlib_manifest_sha256()`): `{corpus['stdlib_manifest_sha256']}`",
            f"- split by file (sha256 of the relative path, 1 bucket in {HELDOUT_BUCKETS} held "
            f"out): {corpus['train_files']} train files, {corpus['heldout_files']} held-out "
            f"files; trained on {corpus['files_used_for_training']} files",
            f"- tokenizer: byte-level BPE (`tokenizers`), `{EOS_TOKEN}` as bos/eos/pad; "
            "documents joined with eos"]


def training_lines(card: Card, recipe: Recipe) -> list[str]:
    job, st = card.job, card.state
    budget = (f"{job.max_steps} steps" if job.max_steps is not None
              else f"{job.budget_s / 60:.0f} min of training time")
    return [*card.training_notes,
            f"- {st.step} steps x batch {job.batch_size} x {recipe.seq_len} tokens: "
            f"{st.tokens:,} tokens seen ({st.tokens / max(st.elapsed, 1e-9):.0f} tok/s)",
            f"- AdamW (betas 0.9/0.95, wd 0.1), peak lr {job.peak_lr:g}, {job.warmup_steps} "
            f"warmup steps, cosine to {MIN_LR_RATIO:g}x over a budget of {budget}; "
            "grad clip 1.0; fp32",
            f"- training time {st.elapsed / 60:.1f} min over {len(st.commands)} session(s); "
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
    commands = [f"    {c}" for c in card.state.commands]
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
    curve = {"model": card.name, "final": card.metrics, "steps": card.state.step,
             "tokens_seen": card.state.tokens, "elapsed_s": round(card.state.elapsed, 1),
             "curve": card.state.curve}
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


def run_meta(job: Job, spec: ModelSpec, tokenizer_file: Path, extra: dict) -> dict:
    """What a checkpoint must agree with to be resumed (budgets may change, sizes may not)."""
    tok_sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    return {"spec": asdict(spec), "seed": job.seed, "batch_size": job.batch_size,
            "peak_lr": job.peak_lr, "max_steps": job.max_steps, "tokenizer_sha256": tok_sha,
            **extra}


def causal_lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def stage_target(ctx: Ctx) -> None:
    t0, folder = time.monotonic(), ctx.out / "target"
    if ctx.args.resume and finished(folder) and (ctx.work / "target.pt").is_file():
        print(f"[target] kept finished {folder} (--resume)")
        return
    tokenizer, corpus = load_tokenizer(ctx)
    job, spec = job_for(ctx, "target"), ctx.recipe.target
    model = new_model(spec, tokenizer, job.seed)
    print(f"[target] {n_params(model):,} parameters, {spec}")
    meta = run_meta(job, spec, ctx.out / "tokenizer" / "tokenizer.json", {})
    state = fit(ctx, job, model, causal_lm_loss, load_data(ctx, tokenizer), meta)
    metrics = export(model, tokenizer, folder, ctx.recipe)
    card = Card("selfspec-tiny", "selfspec's default target: a small Llama-family code model "
                "trained from scratch on the Python standard library, with no model hub.",
                model, corpus, job, state, metrics, ["- objective: next-token cross entropy "
                "on packed windows, from a random init"], time.monotonic() - t0)
    write_card_and_curve(folder, card, ctx.recipe)
    print(f"[target] held-out loss {metrics['heldout_loss']:.4f} "
          f"(ppl {metrics['perplexity']:.2f}) -> {folder}")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 ids: torch.Tensor, hard_weight: float) -> torch.Tensor:
    """KL(teacher || student) per token, optionally mixed with the hard next-token loss."""
    s = F.log_softmax(student_logits.float(), dim=-1).flatten(0, 1)  # [B*T, V]
    t = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, 1)  # [B*T, V]
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
    if hard_weight == 0.0:
        return kl
    ce = F.cross_entropy(student_logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return (1.0 - hard_weight) * kl + hard_weight * ce


def distill_loss_fn(teacher: torch.nn.Module, hard_weight: float) -> LossFn:
    def loss_fn(model, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch).logits  # [B, T, V]
        return distill_loss(model(input_ids=batch).logits, teacher_logits, batch, hard_weight)

    return loss_fn


def load_teacher(ctx: Ctx) -> tuple[torch.nn.Module, dict]:
    """The shipped target (its fp16 weights in fp32) and its measured held-out numbers."""
    folder = ctx.out / "target"
    if not finished(folder):
        raise FileNotFoundError(f"no finished target in {folder}: run --stage target first")
    teacher = heldout_loss.load_model(folder)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher, json.loads((folder / "loss_curve.json").read_text())["final"]


def compare_lines(draft: dict, target: dict) -> tuple[bool, str]:
    weaker = draft["heldout_loss"] > target["heldout_loss"]
    verdict = "weaker than the target, as a baseline draft must be" if weaker else (
        "NOT weaker than the target: the baseline is unfair, train the target longer")
    return weaker, (f"- draft held-out loss {draft['heldout_loss']:.4f} vs target "
                    f"{target['heldout_loss']:.4f}: {verdict}")


def stage_draft(ctx: Ctx) -> None:
    t0, folder = time.monotonic(), ctx.out / "draft"
    if ctx.args.resume and finished(folder) and (ctx.work / "draft.pt").is_file():
        print(f"[draft] kept finished {folder} (--resume)")
        return
    tokenizer, corpus = load_tokenizer(ctx)
    teacher, target_metrics = load_teacher(ctx)
    job, spec = job_for(ctx, "draft"), ctx.recipe.draft
    model = new_model(spec, tokenizer, job.seed)
    print(f"[draft] {n_params(model):,} parameters, {spec}; teacher {n_params(teacher):,}")
    meta = run_meta(job, spec, ctx.out / "tokenizer" / "tokenizer.json",
                    {"hard_weight": ctx.args.hard_weight})
    loss_fn = distill_loss_fn(teacher, ctx.args.hard_weight)
    state = fit(ctx, job, model, loss_fn, load_data(ctx, tokenizer), meta)
    metrics = export(model, tokenizer, folder, ctx.recipe)
    weaker, comparison = compare_lines(metrics, target_metrics)
    notes = [f"- distilled from selfspec-tiny (`../target`, {n_params(teacher):,} parameters): "
             f"loss = {1 - ctx.args.hard_weight:g} x KL(target || draft) on the target's "
             f"softmax + {ctx.args.hard_weight:g} x next-token cross entropy; the curve's "
             "train loss is that mix", comparison]
    card = Card("selfspec-tiny-draft", "The small-draft-model baseline for selfspec-tiny: same "
                "tokenizer, distilled from the target so that it imitates it.", model, corpus,
                job, state, metrics, notes, time.monotonic() - t0)
    write_card_and_curve(folder, card, ctx.recipe)
    print(f"[draft] {comparison[2:]} -> {folder}")
    if not weaker:
        print("[draft] WARNING: the draft is not weaker than the target", file=sys.stderr)


STAGES = {"tokenizer": [stage_tokenizer], "target": [stage_target], "draft": [stage_draft],
          "all": [stage_tokenizer, stage_target, stage_draft]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=sorted(STAGES), default="all")
    p.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    p.add_argument("--target-minutes", type=float, default=70.0,
                   help="training-time budget of the target (summed over resumes)")
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
    sys.exit(exit_on_user_error(main))
