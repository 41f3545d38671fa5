"""Where a plain decoding step's time goes at 1 and 8 rows, on the CPU (docs/serving.md).

    python scripts/batched_step_split.py --model ~/.cache/selfspec/models/smollm2-135m \\
        --out docs/results/batched_step_split/split.json

For each row count: the wall time of a step (decoding `--tokens` new tokens after a prefill
of 41-token prompts, the prefill left out by subtracting a run of one new token), then
torch's profiler over the same decoding split into the layers' products (oneDNN's packed
product or torch.mm), attention, and every other op; and, for each weight shape of the
model, each product form's time per call with the weight read from memory
(`cpu_linear._streamed_seconds`), the forms `Linear` chooses among.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from selfspec import Transformer, generate
from selfspec.model import cpu_linear

PRODUCTS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def prompts(rows: int) -> list[list[int]]:
    return [[1, *range(100 + 37 * i, 140 + 37 * i)] for i in range(rows)]


def decode(model: Transformer, rows: int, tokens: int) -> None:
    batch = prompts(rows)
    generate(model, batch if rows > 1 else batch[0], max_new_tokens=tokens)


def step_ms(model: Transformer, rows: int, tokens: int) -> float:
    """A decoding step's wall time, the prefill's taken out."""
    decode(model, rows, 4)  # warm: forms chosen, packed copies made
    start = time.perf_counter()
    decode(model, rows, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    decode(model, rows, tokens + 1)
    return (time.perf_counter() - start - prefill) / tokens * 1000


def op_split(model: Transformer, rows: int, tokens: int) -> dict[str, float]:
    """Self CPU ms a step by kind of op, the prefill's profile subtracted."""
    def profiled(new_tokens: int) -> dict[str, float]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode(model, rows, new_tokens)
        split = {"products": 0.0, "attention": 0.0, "other": 0.0}
        for event in prof.key_averages():
            kind = ("products" if event.key in PRODUCTS else
                    "attention" if event.key == ATTENTION else "other")
            split[kind] += event.self_cpu_time_total / 1000
        return split

    prefill, whole = profiled(1), profiled(tokens + 1)
    return {kind: (whole[kind] - prefill[kind]) / tokens for kind in whole}


def product_forms(model: Transformer, rows_list: tuple[int, ...]) -> list[dict]:
    shapes = sorted({tuple(m.weight.shape) for m in model.modules()
                     if isinstance(m, torch.nn.Linear)}, reverse=True)
    found = []
    for shape in shapes:
        weight = torch.randn(*shape)
        copies = cpu_linear.streamed_copies(weight)
        for rows in rows_list:
            seconds = cpu_linear._streamed_seconds(weight, rows)
            found.append({"shape": list(shape), "rows": rows,
                          "us_per_call": {form: s / copies * 1e6 for form, s in seconds.items()}})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a converted model folder")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = Transformer.from_pretrained(args.model.expanduser()).eval()
    steps = {}
    for rows in (1, 8):
        steps[rows] = {"step_ms": step_ms(model, rows, args.tokens),
                       "profiled_ms": op_split(model, rows, args.tokens)}
        print(rows, "rows:", {k: round(v, 1) if isinstance(v, float) else
                              {a: round(b, 1) for a, b in v.items()}
                              for k, v in steps[rows].items()}, flush=True)
    report = {"command": "python scripts/batched_step_split.py --model "
                         f"{args.model} --tokens {args.tokens} --threads {args.threads} "
                         f"--out {args.out}",
              "threads": args.threads, "tokens": args.tokens, "steps": steps,
              "product_forms": product_forms(model, (1, 8))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
