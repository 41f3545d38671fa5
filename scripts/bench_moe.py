"""A mixture-of-experts target against a dense one of the same active parameters, on this
machine: the forward of N new tokens through each, c(N), and the distinct experts a forward of
N tokens touches per layer, for N = 1..64; the JSON and, beside it, their figure (.png).

    python scripts/bench_moe.py --out docs/results/moe_cpu/moe_costs.json
    python scripts/bench_moe.py --hidden 256 --expert-width 256 --repeats 2 \
        --out docs/results/moe_cpu/moe_costs.json   # what docs/models.md reports

The MoE target is a random Qwen3-MoE (`--experts` experts of width `--expert-width`, top
`--top-k`, renormalised); the dense one is a random Qwen3 of the same shape whose MLP is
top_k x expert_width wide, so a token multiplies as many weights in both. Three profiles
(`selfspec.measure.costs.measure_cost_profile`): the MoE target eagerly (its eager dispatch,
grouped by expert), the MoE target in static steps (its static dispatch; each N runs in its
bucket, padded to a power of two), and the dense target eagerly. Figures are medians over
rounds; timings from a machine whose cores other work shares are rough.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.measure.costs import measure_cost_profile
from selfspec.measure.plots import moe_costs_figure
from selfspec.measure.results import machine_facts
from selfspec.model import ModelConfig, Transformer


def targets(args: argparse.Namespace) -> tuple[Transformer, Transformer]:
    """(the random MoE target, the random dense one of its active parameters)."""
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                 num_heads=8, num_kv_heads=4, head_dim=args.hidden // 8,
                 max_position_embeddings=4096)
    moe = ModelConfig.of_family(model_type="qwen3_moe", **shape,
                                intermediate_size=args.top_k * args.expert_width,
                                num_experts=args.experts, num_experts_per_tok=args.top_k,
                                expert_intermediate_size=args.expert_width)
    dense = ModelConfig.of_family(model_type="qwen3", **shape,
                                  intermediate_size=args.top_k * args.expert_width)
    torch.manual_seed(args.seed)
    return Transformer(moe).eval(), Transformer(dense).eval()


def params(model: Transformer) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cache-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    moe, dense = targets(args)
    lengths = range(1, args.max_tokens + 1)
    options = dict(cache_length=args.cache_length, repeats=args.repeats, warmup=args.warmup,
                   seed=args.seed)
    profiles = {"moe_eager": measure_cost_profile(moe, lengths, **options),
                "moe_static": measure_cost_profile(moe, lengths, cuda_graphs=True, **options),
                "dense": measure_cost_profile(dense, lengths, **options)}
    seconds = {name: p.seconds for name, p in profiles.items()}
    figures = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": {"moe": params(moe), "dense": params(dense),
                       "moe_active": params(dense) + args.layers * args.experts * args.hidden},
        "forward_ms": {name: {n: 1000 * s for n, s in sec.items()}
                       for name, sec in seconds.items()},
        "moe_eager_over_dense": {n: seconds["moe_eager"][n] / seconds["dense"][n]
                                 for n in lengths},
        "moe_static_over_eager": {n: seconds["moe_static"][n] / seconds["moe_eager"][n]
                                  for n in lengths},
        "c": {name: p.as_dict()["c"] for name, p in profiles.items()},
        "experts_touched": profiles["moe_eager"].experts_touched,
        "machine": machine_facts(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    labels = {"moe_eager": "MoE, eager dispatch", "moe_static": "MoE, static dispatch",
              "dense": "dense, same active parameters"}
    moe_costs_figure({labels[name]: c for name, c in figures["c"].items()},
                     figures["experts_touched"], args.experts, args.top_k,
                     f"a random Qwen3-MoE ({args.experts} experts, top {args.top_k}) against "
                     f"a dense target of its active parameters").savefig(
        args.out.with_suffix(".png"), dpi=110)
    print(f"MoE {figures['parameters']['moe']:,} parameters "
          f"({args.experts} experts, top {args.top_k}); dense "
          f"{figures['parameters']['dense']:,}")
    print("   N  moe eager ms  static ms  dense ms  eager/dense  c_moe  c_dense  experts")
    for n in lengths:
        print(f"{n:>4}  {figures['forward_ms']['moe_eager'][n]:>12.2f}  "
              f"{figures['forward_ms']['moe_static'][n]:>9.2f}  "
              f"{figures['forward_ms']['dense'][n]:>8.2f}  "
              f"{figures['moe_eager_over_dense'][n]:>11.2f}  "
              f"{figures['c']['moe_eager'][n]:>5.2f}  {figures['c']['dense'][n]:>7.2f}  "
              f"{figures['experts_touched'][n]:>7.2f}")
    print(f"figures in {args.out}")


if __name__ == "__main__":
    main()
