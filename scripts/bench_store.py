"""What a feature store saves: tokens/s of self-distillation generating corpus rows with and
without storing their states, of building a store afterwards, and of training steps of each
head from a store against online training (the target run at every step).

    python scripts/bench_store.py --model smollm2-135m --rows 16 --seq-len 512 \
        --override medusa:medusa.num_heads=2 --override medusa:medusa.draft_vocab_size=8192 \
        --override eagle3:eagle.draft_vocab_size=8192 \
        --override early_exit:early_exit.exit_layers=[10] --out docs/results/store/bench_store.json

Each pair of arms alternates round by round in one process; the figures are medians over
--rounds rounds. Training arms run each method's objective as its trainer composes it (its
config, with the overrides given), on random rows, --batch rows a step. The machine may be
shared: compare arms within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.cli import exit_on_user_error
from selfspec.errors import SelfspecError
from selfspec.from_config.methods import CurveVariant, curve_variants, trainer
from selfspec.from_config.methods.entry import TrainingRun
from selfspec.from_config.models import load_target
from selfspec.model import Transformer
from selfspec.training import data
from selfspec.training.features import (
    FeatureStore,
    StoredFeatures,
    StoreWriter,
    build_store,
    data_key,
    store_spec,
)
from selfspec.training.rows import TokenRows

CONF = Path(__file__).resolve().parents[1] / "conf"
VARIANTS: dict[str, CurveVariant] = curve_variants()  # each method's trainer and overrides
MEASURED = [name for name, v in VARIANTS.items()  # --methods' default: each trainer's
            if name in trainer(v.trainer).store_bench]  # `store_bench`


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    overrides = method_overrides(args.override)
    configs = {name: config(name, args, overrides.get(name, [])) for name in args.methods}
    target = load_target(next(iter(configs.values())))
    rows = random_rows(target, args.rows, args.seq_len)
    layers = needed_layers(configs, target, rows)
    with tempfile.TemporaryDirectory() as folder:
        report = {"model": args.model, "threads": args.threads, "rows": args.rows,
                  "seq_len": args.seq_len, "dtype": args.dtype, "layers": list(layers),
                  "generation": generation(target, rows, args, layers, Path(folder)),
                  "store_build": store_build(target, rows, args, layers, Path(folder)),
                  "training": {name: training(name, cfg, target, rows, args,
                                              Path(folder) / "store")
                               for name, cfg in configs.items()}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return report


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a conf/model name")
    parser.add_argument("--model-path", help="model=local's folder")
    parser.add_argument("--methods", nargs="+", default=MEASURED, choices=list(VARIANTS))
    parser.add_argument("--override", action="append", default=[],
                        help="METHOD:KEY=VALUE, a config override of one method's trainer")
    parser.add_argument("--rows", type=int, default=16, help="rows generated and stored")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="generation: each row's prompt; the target writes the rest")
    parser.add_argument("--batch", type=int, default=4, help="training rows a step")
    parser.add_argument("--steps", type=int, default=3, help="training steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here")
    return parser.parse_args(argv)


def method_overrides(items: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for item in items:
        method, _, override = item.partition(":")
        if method not in VARIANTS or "=" not in override:
            raise SelfspecError(f"--override {item!r}: give METHOD:KEY=VALUE with METHOD one "
                                f"of {', '.join(VARIANTS)}")
        found.setdefault(method, []).append(override)
    return found


def config(method: str, args: argparse.Namespace, extra: list[str]):
    variant = VARIANTS[method]
    model = [f"model={args.model}"] + ([f"model.path={args.model_path}"] if args.model_path
                                       else [])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(trainer(variant.trainer).config,
                       overrides=[*model, *variant.overrides, *extra, "run_dir=/tmp/unused"])


def random_rows(target: Transformer, count: int, length: int) -> TokenRows:
    tokens = torch.randint(0, target.config.vocab_size, (count, length),
                           generator=torch.Generator().manual_seed(0))
    return TokenRows(tokens, torch.ones_like(tokens))


def needed_layers(configs: dict, target: Transformer, rows: TokenRows) -> tuple[int, ...]:
    """The residual streams the methods' modules read (each trainer's `streams`), sorted."""
    layers: set[int] = set()
    for name, cfg in configs.items():
        entry = trainer(VARIANTS[name].trainer)
        layers |= set(entry.streams(entry.module(cfg, target, rows)))
    return tuple(sorted(layers))


def alternate(arms: dict[str, Callable[[], int]], rounds: int) -> dict[str, float]:
    """Tokens/s of each arm (a call returns the tokens it processed): the median over rounds,
    the arms alternating within each round."""
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            start = time.perf_counter()
            tokens = arm()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: round(statistics.median(r), 1) for name, r in rates.items()}


def generation(target, rows: TokenRows, args, layers, folder: Path) -> dict:
    """Greedy corpus continuations (self_distill_rows' generation), plain and storing."""
    prompts, new = rows.tokens[:, : args.prompt_tokens], args.seq_len - args.prompt_tokens
    mask = torch.ones_like(rows.tokens)
    writer = StoreWriter(folder / "generated", store_spec(target, layers, args.dtype, "bench"))
    counter = iter(range(10**6))

    def plain() -> int:
        data._greedy_continuations(target, prompts, new)
        return prompts.shape[0] * new

    def storing() -> int:
        tokens, states = data._greedy_continuations(target, prompts, new, layers)
        writer.write(f"bench-{next(counter)}", TokenRows(tokens, mask), states)
        return prompts.shape[0] * new

    rates = alternate({"plain": plain, "storing": storing}, args.rounds)
    return {"new_tokens_per_s": rates, "storing_over_plain": round(
        rates["storing"] / rates["plain"], 3)}


def store_build(target, rows: TokenRows, args, layers, folder: Path) -> dict:
    """A store built afterwards, in teacher-forced batches (the rows' tokens per second)."""
    writer = StoreWriter(folder / "store", store_spec(target, layers, args.dtype,
                                                      data_key(rows.tokens)))
    start = time.perf_counter()
    writer.finish(build_store(target, rows, writer, prefix="train", batch_size=args.batch,
                              progress=False))
    seconds = time.perf_counter() - start
    size = sum(s.bytes for s in FeatureStore(writer.folder).index.shards)
    return {"tokens_per_s": round(rows.tokens.numel() / seconds, 1),
            "bytes_per_token": round(size / rows.tokens.numel(), 1)}


def objective(method: str, cfg, target: Transformer, rows: TokenRows, features):
    """The method's training objective over a fresh module, composed as its trainer composes
    it (`TrainerEntry.module` and `objective`)."""
    entry = trainer(VARIANTS[method].trainer)
    run = TrainingRun(cfg, target, None, rows, entry.module(cfg, target, rows))
    return entry.objective(run, features)


def training(name: str, cfg, target: Transformer, rows: TokenRows, args, store: Path) -> dict:
    """Training steps (forward, backward, AdamW) of one method, online and from the store."""
    layers = needed_layers({name: cfg}, target, rows)
    arms = {}
    for arm, features in (("online", None),
                          ("from_store", StoredFeatures(FeatureStore(store), layers))):
        trained = objective(name, cfg, target, rows, features).train()
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad])
        arms[arm] = steps(trained, optimizer, rows, args)
    rates = alternate(arms, args.rounds)
    return {"tokens_per_s": rates, "store_over_online": round(
        rates["from_store"] / rates["online"], 3)}


def steps(trained, optimizer, rows: TokenRows, args) -> Callable[[], int]:
    def run() -> int:
        for step in range(args.steps):
            batch = rows.select(torch.arange(step * args.batch, (step + 1) * args.batch)
                                % len(rows))
            out = trained(batch.tokens, batch.loss_mask)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        return args.steps * args.batch * rows.tokens.shape[1]

    return run


if __name__ == "__main__":
    exit_on_user_error(main)
