"""Train a head with speculators' own trainer on a selfspec feature store's rows, with
selfspec's trainer settings, and load the result into selfspec for its evaluators.

    python scripts/peer_train.py eagle3 --store features/smollm2-eagle \
        --target ~/.cache/selfspec/models/smollm2-135m --out runs/speculators-eagle3 --steps 600
    python scripts/peer_train.py dflash --store features/smollm2-dflash --target ... --out ...
    python scripts/peer_train.py eagle3 ... --data-only   # the data and the flags, no training
    python scripts/peer_train.py dflash --peer specforge --store ... --target ... --out ...

1. The store's training rows, then its held-out rows, are written in speculators' offline layout
   (`selfspec.training.speculators_data`; the store must hold the fused streams and the
   target's last layer, `store.layers=[...,L]`); EAGLE-3's draft vocabulary is the one
   selfspec's trainer picks from the same rows, as speculators' d2t/t2d files.
2. speculators trains in its own venv (scripts/peers.sh speculators) through
   scripts/speculators_cpu_train.py, with the quick trainer's settings of selfspec's
   train/eagle.py (eagle.version=3) or train/dflash.py: AdamW (no weight decay) at `--lr`
   with `--warmup` linear warmup steps then cosine decay to zero over `--steps`, gradients
   clipped at 1, `--batch` rows a step. EAGLE-3: one decoder layer sized like the target's,
   the same fused layers and draft vocabulary, the training-time test of `--ttt-steps` steps
   decayed by `--ttt-decay`, forward KL to the target's law. DFlash: `--num-layers` Qwen3
   layers with q/k norms, blocks of `--block-size`, `--anchors` blocks a row (speculators
   counts them a step: batch x anchors), slot k weighing exp(-(k - 1) / `--gamma`),
   cross-entropy, the rows' rarest token as the mask (or `--mask-token-id`), the target's LM
   head. The heads take the shape selfspec loads: no extra norms, full attention, the
   target's embedding frozen.
   With `--peer specforge` (DFlash only: SpecForge's EAGLE-3 loss is a Triton kernel), the
   rows go in SpecForge's offline layout (`selfspec.training.specforge_data`) and SpecForge's
   own trainer learns from them in its venv (scripts/peers.sh specforge) through
   scripts/specforge_cpu_train.py, with the same settings (AdamW without weight decay, linear
   warmup then cosine, clipping at 1, `--anchors` blocks a row, the same decay and mask);
   the draft's config is selfspec's `--to dflash` layout of a head of that shape.
3. The last checkpoint is loaded by `selfspec.heads.load_head` and written as a selfspec
   export (`--out`/export, what selfspec's evaluators read); `summary.json` in --out holds
   both folders, speculators' logged losses, its training tokens/s (rows x seq_len a step, as
   selfspec's trainer counts `tokens_seen`, over the steps' time in speculators' own step
   profile, from fetching the batch to the optimizer's step) and the command that replays it
   on held-out prompts (eval/replay.py, the evaluator of selfspec's own heads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".peers" / "speculators" / "venv" / "bin" / "python"
CPU_TRAIN = ROOT / "scripts" / "speculators_cpu_train.py"
SPECFORGE_PYTHON = ROOT / ".peers" / "specforge" / "venv" / "bin" / "python"
SPECFORGE_TRAIN = ROOT / "scripts" / "specforge_cpu_train.py"
REPLAY_METHOD = {"eagle3": ("eagle", "eagle_head"), "dflash": ("dflash", "dflash_head")}


@dataclass(frozen=True)
class Settings:
    """The settings of selfspec's trainers that speculators is given: the shared ones
    (conf/trainer/quick.yaml, conf/optim/adamw.yaml), EAGLE-3's (conf/train_eagle.yaml) and
    DFlash's (conf/train_dflash.yaml)."""

    steps: int = 200
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 20
    seed: int = 0
    ttt_steps: int = 7  # EAGLE-3
    ttt_decay: float = 0.8
    draft_vocab_size: int = 1024
    num_layers: int = 1  # DFlash
    block_size: int = 9
    anchors: int = 16
    gamma: float = 4.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(REPLAY_METHOD), help="the head the peer trains")
    p.add_argument("--peer", choices=["speculators", "specforge"], default="speculators",
                   help="whose trainer (SpecForge: DFlash only)")
    p.add_argument("--store", required=True, help="a finished selfspec feature store")
    p.add_argument("--target", required=True, help="the target's transformers folder")
    p.add_argument("--out", required=True, help="where the data, checkpoints and summary go")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="the fused layers (HF hidden_states ids); default: the trainer's")
    p.add_argument("--max-rows", type=int, default=None, help="the first N training rows")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="DFlash's mask token; default: the training rows' rarest")
    for name, value in asdict(Settings()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--threads", type=int, default=None, help="torch threads (OMP_NUM_THREADS)")
    p.add_argument("--data-only", action="store_true",
                   help="write the data and speculators' command line (--out/speculators_flags"
                        ".txt), and stop: to train elsewhere, e.g. on a GPU")
    return p.parse_args(argv)


def epochs_for(steps: int, train_rows: int, batch: int) -> int:
    """Passes speculators needs for `steps` steps of `batch` rows. It stops at --max-steps
    only after a step, so a pass begun after the last step would still take one: exactly
    enough passes, no more."""
    return math.ceil(steps / math.ceil(train_rows / batch))


def common_flags(s: Settings, data, verifier: Path, out: Path) -> list[str]:
    """speculators' command line for `data` (OfflineRows) and the settings both heads share."""
    return [
        "--verifier-name-or-path", str(verifier), "--data-path", str(data.folder),
        "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
        "--seed", str(s.seed), "--target-layer-ids", *map(str, data.layers),
        # the CPU: attention, loss and dtypes that run without an accelerator, no workers
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise",
        # selfspec's training: rows, steps, optimizer, schedule (clipping: 1, as speculators')
        "--total-seq-len", str(s.batch * data.seq_len),
        "--train-data-ratio", repr(data.train_ratio), "--max-steps", str(s.steps),
        "--epochs", str(epochs_for(s.steps, data.train_rows, s.batch)),
        "--optimizer", "adamw", "--lr", repr(s.lr), "--weight-decay", "0",
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(s.warmup),
        "--log-freq", "1", "--checkpoint-freq", "1",
    ]


def eagle3_flags(s: Settings, vocab: tuple[Path, Path], vocab_size: int) -> list[str]:
    """selfspec's EAGLE-3 head and loss: one full-attention layer without speculators' extra
    norms, its draft vocabulary, the training-time test, forward KL."""
    return [
        "--speculator-type", "eagle3", "--num-layers", "1", "--full-attention-indices", "0",
        "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
        "--draft-vocab-size", str(s.draft_vocab_size),
        "--d2t-path", str(vocab[0]), "--t2d-path", str(vocab[1]),
        "--mask-token-id", str(vocab_size - 1),  # unused by EAGLE-3; saves a tokenizer lookup
        "--ttt-steps", str(s.ttt_steps), "--ttt-step-loss-decay", repr(s.ttt_decay),
        "--loss-fn", "kl_div",
    ]


def dflash_flags(s: Settings, mask_token_id: int) -> list[str]:
    """selfspec's DFlash head and loss: full-attention Qwen3 layers, the anchor token not
    predicted, `anchors` blocks a row (speculators draws them a packed step), slot k weighing
    exp(-(k - 1) / gamma), cross-entropy, the full vocabulary."""
    return [
        "--speculator-type", "dflash", "--num-layers", str(s.num_layers),
        "--full-attention-indices", *map(str, range(s.num_layers)),
        "--block-size", str(s.block_size), "--no-sample-from-anchor",
        "--max-anchors", str(s.anchors * s.batch), "--mask-token-id", str(mask_token_id),
        "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", repr(s.gamma),
        "--loss-fn", "ce",
    ]


def train_with_speculators(flags: list[str], out: Path, threads: int | None) -> list[dict]:
    """Run speculators' trainer in its venv; its logged training steps."""
    if not PEER_PYTHON.is_file():
        raise FileNotFoundError(f"speculators' venv is absent ({PEER_PYTHON}): build it with "
                                f"scripts/peers.sh speculators")
    metrics = out / "speculators_metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    done = subprocess.run([str(PEER_PYTHON), str(CPU_TRAIN), str(metrics), *flags], env=env,
                          capture_output=True, text=True)
    (out / "speculators.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"speculators' trainer failed (exit {done.returncode}); its log: "
                           f"{out / 'speculators.log'}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if "train" in r]


def last_checkpoint(out: Path) -> Path:
    """The folder of speculators' last saved epoch (checkpoints/<epoch>/)."""
    epochs = sorted((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()),
                    key=lambda p: int(p.name))
    if not epochs:
        raise FileNotFoundError(f"speculators saved no checkpoint under {out / 'checkpoints'}")
    return epochs[-1]


def with_specforge(args: argparse.Namespace, s: Settings, target, target_folder: Path, store,
                   layers: tuple[int, ...], out: Path) -> dict:
    """DFlash by SpecForge's own trainer on the store's training rows; its head loaded and
    written as a selfspec export; the summary."""

    from selfspec.heads import DFlashConfig, DFlashHead, load_head
    from selfspec.heads.draft_vocab import rarest_token, token_counts
    from selfspec.heads.export import export_head
    from selfspec.heads.io import describe_target, save_head
    from selfspec.training.specforge_data import write_specforge_dflash_rows
    from selfspec.training.speculators_data import store_rows

    if not SPECFORGE_PYTHON.is_file():
        raise FileNotFoundError(f"SpecForge's venv is absent ({SPECFORGE_PYTHON}): build it "
                                f"with scripts/peers.sh specforge")
    mask = args.mask_token_id
    if mask is None:  # as selfspec's trainer picks it
        mask = rarest_token(token_counts(store_rows(store, args.max_rows).tokens,
                                         target.config.vocab_size))
    rows = write_specforge_dflash_rows(store, out / "features", layers, args.max_rows)
    shape = DFlashConfig.for_target(target.config, mask_token_id=mask, num_layers=s.num_layers,
                                    block_size=s.block_size, target_layers=layers)
    export_head(DFlashHead(shape), "dflash", out / "draft", base_model=str(target_folder),
                target_layers_count=target.config.num_layers)  # its config.json: the shape
    settings = {"target": str(target_folder), "features": str(out / "features"),
                "draft_config": str(out / "draft" / "config.json"), "out": str(out),
                "steps": s.steps, "batch": s.batch, "lr": s.lr, "warmup": s.warmup,
                "anchors": s.anchors, "gamma": s.gamma, "seq_len": store.index.seq_len,
                "seed": s.seed, "max_grad_norm": 1.0}
    (out / "specforge_settings.json").write_text(json.dumps(settings, indent=1))
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    start = time.perf_counter()
    done = subprocess.run([str(SPECFORGE_PYTHON), str(SPECFORGE_TRAIN),
                           str(out / "specforge_settings.json")], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"SpecForge's trainer failed (exit {done.returncode}); its log: "
                           f"{out / 'specforge.log'}\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in
             (out / "specforge_metrics.jsonl").read_text().splitlines()]
    if len(steps) != s.steps:
        raise RuntimeError(f"SpecForge logged {len(steps)} training steps, not the {s.steps} "
                           f"asked for: see {out / 'specforge.log'}")
    head = load_head(out / "dflash", target=target, allow_other_base=True)
    export = save_head(out / "export", head, head.config, describe_target(target))
    seconds = sum(step["perf/optimizer_step_time_s"] for step in steps)  # its wall a step
    summary = {
        "kind": args.kind, "peer": "specforge", "head": str(out / "dflash"),
        "export": str(export), "loaded_as": type(head).__name__, "settings": asdict(s),
        "layers": list(layers), "mask_token_id": mask, "train_rows": rows,
        "seq_len": store.index.seq_len, "losses": [step["loss"] for step in steps]}
    return write_summary(out, args, s, summary, seconds, wall)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)

    from selfspec import Transformer
    from selfspec.heads import dflash, eagle, load_head
    from selfspec.heads.draft_vocab import rarest_token, token_counts
    from selfspec.heads.io import describe_target, save_head
    from selfspec.training.features import FeatureStore
    from selfspec.training.speculators_data import (
        store_rows,
        write_draft_vocab,
        write_offline_rows,
    )

    s = Settings(**{k: getattr(args, k) for k in asdict(Settings())})
    if args.peer == "specforge" and args.kind != "dflash":
        raise ValueError("SpecForge's EAGLE-3 loss launches a Triton kernel, which needs a GPU: "
                         "train dflash with --peer specforge, or eagle3 with --peer speculators")
    out, target_folder = Path(args.out), Path(args.target).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = Transformer.from_pretrained(target_folder).eval()
    config = target.config
    default = (eagle.default_target_layers(config.num_layers) if args.kind == "eagle3"
               else dflash.default_target_layers(config.num_layers))
    layers = tuple(args.layers or default)
    store = FeatureStore(args.store)
    if args.peer == "specforge":
        return with_specforge(args, s, target, target_folder, store, layers, out)
    data = write_offline_rows(store, out / "data", layers, config.num_layers, args.kind,
                              args.max_rows)
    flags = common_flags(s, data, target_folder, out)
    if args.kind == "eagle3":
        vocab = write_draft_vocab(store, out / "data", config.vocab_size, s.draft_vocab_size,
                                  args.max_rows)
        flags += eagle3_flags(s, vocab, config.vocab_size)
    else:
        mask = args.mask_token_id
        if mask is None:  # as selfspec's trainer picks it
            mask = rarest_token(token_counts(store_rows(store, args.max_rows).tokens,
                                             config.vocab_size))
        flags += dflash_flags(s, mask)
    (out / "speculators_flags.txt").write_text(" ".join(flags) + "\n")
    if args.data_only:
        print(f"speculators' data: {data.folder}\nits flags: {out / 'speculators_flags.txt'}")
        return {"data": str(data.folder), "flags": flags}
    start = time.perf_counter()
    steps = train_with_speculators(flags, out, args.threads)
    wall = time.perf_counter() - start
    if len(steps) != s.steps:
        raise RuntimeError(f"speculators logged {len(steps)} training steps, not the {s.steps} "
                           f"asked for: see {out / 'speculators.log'}")
    folder = last_checkpoint(out)
    head = load_head(folder, target=target, allow_other_base=True)
    # selfspec's evaluators read a selfspec export: the head as loaded, written once more
    export = save_head(out / "export", head, head.config, describe_target(target))
    seconds = sum(step["profile"]["step_ms"] for step in steps) / 1000  # fetch to optimizer
    summary = {
        "kind": args.kind, "head": str(folder), "export": str(export),
        "loaded_as": type(head).__name__,
        "settings": asdict(s), "layers": list(layers), "train_rows": data.train_rows,
        "heldout_rows": data.heldout_rows, "seq_len": data.seq_len,
        "losses": [step["train"]["loss"] for step in steps]}
    return write_summary(out, args, s, summary, seconds, wall)


def write_summary(out: Path, args: argparse.Namespace, s: Settings, summary: dict,
                  seconds: float, wall: float) -> dict:
    """A peer's run summary completed with what every run reports and written to
    out/summary.json: training tokens/s counted as selfspec's trainer counts them (tokens_seen:
    rows x seq_len a step) over `seconds`, the peer's own time for its steps; the wall time,
    the threads, and the command that replays the export."""
    import torch

    method, head_setting = REPLAY_METHOD[args.kind]
    summary |= {
        "tokens_per_s": s.steps * s.batch * summary["seq_len"] / seconds,
        "wall_s": wall, "torch_threads": args.threads or torch.get_num_threads(),
        "replay": f"python eval/replay.py model=<the target> 'methods=[{method}]' "
                  f"{head_setting}={summary['export']} data=mt_bench num_prompts=80",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=1))
    return summary


if __name__ == "__main__":
    from selfspec.cli import exit_on_user_error

    exit_on_user_error(main, sys.argv[1:])
