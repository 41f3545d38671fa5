"""A target's one-token (and two-token) forward with `cpu_linear.linear` as it is, against
the same forward with a single row doubled by `repeat` (how `linear` doubled it before it
used `cat`), the arms alternating round by round in one process.

    python scripts/bench_one_row.py --model smollm2-135m --out docs/results/linear/one_row.json

The figures are medians over rounds of the milliseconds of one forward over a cache of
--cache-length random tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.from_config.models import load_target
from selfspec.model import cpu_linear as model_module

CONF = Path(__file__).resolve().parents[1] / "conf"
CURRENT = model_module.linear


def linear_repeating_one_row(x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with a single CPU row doubled by repeat; every other case as `linear`."""
    out_features, in_features = weight.shape
    if x.numel() != in_features or not model_module._few_rows_on_cpu(x, 1):
        return CURRENT(x, weight, bias)
    out = (weight @ x.reshape(1, in_features).repeat(2, 1).t())[:, :1].t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


ARMS = {"cat": CURRENT, "repeat": linear_repeating_one_row}


@torch.inference_mode()
def profile_arms(target, rows: list[int], rounds: int, cache_length: int) -> dict:
    device = target.embed_tokens.weight.device
    cache = target.new_cache(max_slots=cache_length + max(rows))
    vocab = target.config.vocab_size
    target(torch.randint(vocab, (1, cache_length), device=device),
           torch.arange(cache_length, device=device), cache)
    times = {arm: {n: [] for n in rows} for arm in ARMS}
    for _ in range(rounds):
        for arm, function in ARMS.items():
            model_module.linear = function
            for n in rows:
                tokens = torch.randint(vocab, (1, n), device=device)
                positions = torch.arange(cache_length, cache_length + n, device=device)
                laps = []
                for _ in range(5):
                    start = time.perf_counter()
                    target(tokens, positions, cache)
                    laps.append(time.perf_counter() - start)
                    cache.truncate(cache_length)
                times[arm][n].append(1000 * statistics.median(laps))
    model_module.linear = CURRENT
    return {arm: {n: statistics.median(t) for n, t in by_n.items()} for arm, by_n in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a conf/model name")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cache-length", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with initialize_config_dir(str(CONF), version_base=None):
        target = load_target(compose("generate", overrides=[f"model={args.model}"])).eval()
    ms = profile_arms(target, sorted(set(args.rows)), args.rounds, args.cache_length)
    print(f"{args.model}: ms per forward, median of {args.rounds} rounds")
    for n in ms["cat"]:
        print(f"  {n} row(s): cat {ms['cat'][n]:.1f}, repeat {ms['repeat'][n]:.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results = {"model": args.model, "threads": torch.get_num_threads(),
                   "cache_length": args.cache_length, "rounds": args.rounds, "ms": ms}
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
