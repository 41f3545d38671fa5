"""Target forwards over N new tokens with the few-row CPU products of `cpu_linear.Linear`
(oneDNN over a packed weight from 3 rows on, W @ x.T below) against W @ x.T alone and plain
`x @ W.T`, interleaved in one process.

    python scripts/bench_linear.py --out docs/results/linear/linear.json
    python scripts/bench_linear.py --model smollm2-135m --lengths 1 2 3 4 5 8 16 64

Each round measures the cost profile once per arm (`selfspec.measure.costs.measure_cost_profile`);
the figures are medians over rounds of the milliseconds of one forward, and c(N) of each arm
over its own one-token forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec.cli import exit_on_user_error
from selfspec.from_config.models import load_target
from selfspec.measure.costs import measure_cost_profile
from selfspec.model import cpu_linear as model_module

CONF = Path(__file__).resolve().parents[1] / "conf"
# (FEW_ROWS_ON_CPU, PACKED_FROM_ROWS) of each arm.
ARMS = {"few_rows": (model_module.FEW_ROWS_ON_CPU, model_module.PACKED_FROM_ROWS),
        "W_xT": (model_module.FEW_ROWS_ON_CPU, model_module.FEW_ROWS_ON_CPU + 1),
        "x_WT": (0, 0)}


def profile_arms(target, lengths: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per forward length for each arm, the arms alternating round by round."""
    times: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in lengths} for arm in ARMS}
    for _ in range(rounds):
        for arm, (rows, packed_from) in ARMS.items():
            model_module.FEW_ROWS_ON_CPU, model_module.PACKED_FROM_ROWS = rows, packed_from
            profile = measure_cost_profile(target, lengths, repeats=3, warmup=1)
            for n in lengths:
                times[arm][n].append(1000 * profile.seconds[n])
    model_module.FEW_ROWS_ON_CPU, model_module.PACKED_FROM_ROWS = ARMS["few_rows"]
    return {arm: {n: statistics.median(t) for n, t in by_n.items()} for arm, by_n in times.items()}


def report(name: str, ms: dict[str, dict[int, float]]) -> dict:
    print(f"\n{name}: ms per forward (c(N))")
    print(f"{'N':>4} " + " ".join(f"{arm:>18}" for arm in ms))
    for n in ms["few_rows"]:
        cells = [f"{by_n[n]:9.2f} ({by_n[n] / by_n[1]:.2f})" for by_n in ms.values()]
        print(f"{n:>4} " + " ".join(f"{cell:>18}" for cell in cells))
    return {arm: {"ms": by_n, "c": {n: t / by_n[1] for n, t in by_n.items()}}
            for arm, by_n in ms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["tiny"], help="conf/model names")
    parser.add_argument("--lengths", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"threads": torch.get_num_threads(), "rows_limit": model_module.FEW_ROWS_ON_CPU,
               "packed_from_rows": model_module.PACKED_FROM_ROWS}
    with initialize_config_dir(str(CONF), version_base=None):
        for name in args.model:
            cfg = compose("generate", overrides=[f"model={name}"])
            target = load_target(cfg).eval()
            results[name] = report(name, profile_arms(target, sorted(set(args.lengths)),
                                                      args.rounds))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    exit_on_user_error(main)
