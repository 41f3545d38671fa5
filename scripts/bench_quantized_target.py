"""Plain decoding of a target and of its int8 and int4 weight-only copies (`model.quantize`),
interleaved prompt by prompt in one process: tokens/s of each, and their ratio to fp32.

    python scripts/bench_quantized_target.py --model smollm2-135m --prompts 8 \
        --new-tokens 128 --out docs/results/quantized/plain_decoding.json

The machine may be shared: compare the arms within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec import SamplingParams, from_config
from selfspec.cli import exit_on_user_error
from selfspec.measure.passes import BenchSettings, run_passes
from selfspec.measure.peers import OurDecoder
from selfspec.model.quantized import quantized_copy


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="mt_bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=str(from_config.CONF_DIR), version_base="1.3"):
        cfg = compose("sweep", overrides=[f"model={args.model}", f"data={args.data}"])
    target = from_config.load_target(cfg)
    tokenizer = from_config.load_tokenizer(target.source)
    texts = from_config.sweep_prompt_texts(cfg.data, args.prompts)
    prompts = [p.ids for p in from_config.encode_prompt_texts(cfg.data, texts, tokenizer)]
    arms = {"fp32": target, "int8": quantized_copy(target, 8), "int4": quantized_copy(target, 4)}
    settings = BenchSettings(max_new_tokens=args.new_tokens, repeats=args.repeats,
                             stop_ids=tuple(target.config.eos_token_ids))
    passes = run_passes([OurDecoder(model) for model in arms.values()], prompts,
                        SamplingParams(), settings)
    speeds = {name: statistics.median(p.tokens_per_s) for name, p in zip(arms, passes,
                                                                        strict=True)}
    same = {name: p.outputs == passes[0].outputs for name, p in zip(arms, passes, strict=True)}
    result = {"model": args.model, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "tokens_per_s": speeds,
              "over_fp32": {name: s / speeds["fp32"] for name, s in speeds.items()},
              "same_greedy_output_as_fp32": same}
    for name, speed in speeds.items():
        print(f"{name:>5}: {speed:6.1f} tokens/s, x{speed / speeds['fp32']:.2f} fp32's; "
              f"greedy output {'the same as' if same[name] else 'differs from'} fp32's")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
