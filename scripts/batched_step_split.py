"""Where a plain decoding step's time goes at 1 and 8 rows, on the CPU (docs/serving.md).

    python scripts/batched_step_split.py --model ~/.cache/selfspec/models/smollm2-135m \\
        --out docs/results/batched_step_split/split.json
    python scripts/batched_step_split.py --model ~/.cache/selfspec/models/smollm2-135m \\
        --prompts anchor --tokens 128 --out docs/results/batched_step_split/anchor.json

For each row count: the wall time of a step (decoding `--tokens` new tokens after a prefill
of the prompts, the prefill left out by subtracting a run of one new token), then
torch's profiler over the same decoding split into the layers' products (oneDNN's packed
product or torch.mm), attention, and every other op; and, for each weight shape of the
model, each product form's time per call with the weight read from memory
(`cpu_linear._streamed_seconds`), the forms `Linear` chooses among.

--prompts: `equal`, 8 prompts of 41 tokens each (a row count of 1 decodes the first); or
`anchor`, the 8 MT-bench prompts of scripts/vllm_anchor.py, of different lengths, the batch
of 8 against each prompt decoded alone (timed, not profiled), with the prefill's wall time
beside the step's; and where `scripts/peers.sh vllm` has built vLLM's venv, vLLM's plain
decoding of the same prompts at the same batches split alike (one new token, then --tokens + 1:
the difference over --tokens is its step), each run one engine of scripts/vllm_anchor.py's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from selfspec import Transformer, generate
from selfspec.model import cpu_linear

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".peers/vllm/venv/bin/python"
PRODUCTS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def equal_prompts(rows: int) -> list[list[int]]:
    return [[1, *range(100 + 37 * i, 140 + 37 * i)] for i in range(rows)]


def anchor_prompts() -> list[list[int]]:
    """scripts/vllm_anchor.py's prompts: the sweep's 8 MT-bench prompts as it encodes them."""
    from vllm_anchor import prompt_ids  # this script's folder is on sys.path

    return prompt_ids(argparse.Namespace(prompts=8))


def vllm_split(prompts: list[list[int]], tokens: int, threads: int) -> dict:
    """vLLM's plain decoding of prompts at 1 and 8 rows, split as `step_ms` splits ours."""
    import tempfile

    from vllm_anchor import TARGET, serve

    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for batch in (1, 8):
            runs = {n: serve({"model": str(TARGET), "prompts": prompts, "max_tokens": n,
                              "batch": batch, "speculative_config": None},
                             Path(folder), f"plain_{batch}_{n}", threads)
                    for n in (1, tokens + 1)}
            if any("error" in run for run in runs.values()):
                return {"error": [run["error"] for run in runs.values() if "error" in run]}
            groups = len(prompts) // batch
            prefill, whole = (runs[n]["seconds"] / groups for n in (1, tokens + 1))
            found[str(batch)] = {"step_ms": (whole - prefill) / tokens * 1000,
                                 "prefill_ms": prefill * 1000,
                                 "tokens_per_s": runs[tokens + 1]["tokens_per_s"]}
    return found


def decode(model: Transformer, batch: list[list[int]], tokens: int) -> None:
    """batch decoded together (one prompt: alone), tokens new tokens a row, EOS ignored."""
    generate(model, batch if len(batch) > 1 else batch[0], max_new_tokens=tokens)


def step_ms(model: Transformer, batch: list[list[int]], tokens: int) -> dict[str, float]:
    """A decoding step's wall time, the prefill's (a run of one new token) taken out."""
    decode(model, batch, 4)  # warm: forms chosen, packed copies made
    start = time.perf_counter()
    decode(model, batch, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    decode(model, batch, tokens + 1)
    whole = time.perf_counter() - start
    return {"step_ms": (whole - prefill) / tokens * 1000, "prefill_ms": prefill * 1000,
            "tokens_per_s": len(batch) * (tokens + 1) / whole}


def op_split(model: Transformer, batch: list[list[int]], tokens: int) -> dict[str, float]:
    """Self CPU ms a step by kind of op, the prefill's profile subtracted."""
    def profiled(new_tokens: int) -> dict[str, float]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode(model, batch, new_tokens)
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
    parser.add_argument("--prompts", choices=("equal", "anchor"), default="equal")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = Transformer.from_pretrained(args.model.expanduser()).eval()
    prompts = equal_prompts(8) if args.prompts == "equal" else anchor_prompts()
    batches = {"1": [prompts[:1]], "8": [prompts]}
    if args.prompts == "anchor":  # each prompt alone, then the 8 together
        batches["1"] = [[prompt] for prompt in prompts]
    steps = {}
    for rows, runs in batches.items():
        # the profiler's split of one prompt alone is the equal prompts' (and takes a minute
        # a prompt to tally), so the anchor's prompts alone are timed, not profiled
        profiled = len(runs) == 1
        measured = [step_ms(model, batch, args.tokens) | ({"profiled_ms": op_split(
            model, batch, args.tokens)} if profiled else {}) for batch in runs]
        steps[rows] = _mean(measured)
        print(rows, "rows:", json.dumps(steps[rows]), flush=True)
    report = {"command": "python scripts/batched_step_split.py --model "
                         f"{args.model} --prompts {args.prompts} --tokens {args.tokens} "
                         f"--threads {args.threads} --out {args.out}",
              "threads": args.threads, "tokens": args.tokens,
              "prompt_lengths": [len(p) for p in prompts], "steps": steps,
              **({"vllm_steps": vllm_split(prompts, args.tokens, args.threads)}
                 if args.prompts == "anchor" and VLLM_PYTHON.exists() else {}),
              "product_forms": product_forms(model, (1, 8))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


def _mean(runs: list[dict]) -> dict:
    """The mean of each figure over runs (nested dicts alike)."""
    return {key: (_mean([run[key] for run in runs]) if isinstance(runs[0][key], dict)
                  else sum(run[key] for run in runs) / len(runs)) for key in runs[0]}


if __name__ == "__main__":
    main()
