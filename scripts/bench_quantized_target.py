"""Plain decoding of a target and of its int8 and int4 weight-only copies (`model.quantize`),
interleaved prompt by prompt in one process: tokens/s of each, and their ratio to the
target's own dtype (fp32 on the CPU, bf16 on a GPU), each copy in its device's layout
(`selfspec.model.quantized.layout_for`).

    python scripts/bench_quantized_target.py --model smollm2-135m --prompts 8 \
        --new-tokens 128 --out docs/results/quantized/plain_decoding.json
    python scripts/bench_quantized_target.py --model random-7b --device cuda --prompts 1 \
        --new-tokens 128                # Llama-2-7B's shape, random weights and prompts, bf16

A model with random weights decodes random prompts of --prompt-tokens ids. The machine may be
shared: compare the arms within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec import SamplingParams
from selfspec.cli import exit_on_user_error
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.models import load_target, load_tokenizer
from selfspec.from_config.prompts import encode_prompt_texts, sweep_prompt_texts
from selfspec.measure.passes import BenchSettings, run_passes
from selfspec.measure.peers import OurDecoder
from selfspec.measure.results import machine_facts
from selfspec.model.quantized import quantized_copy


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="mt_bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="the random prompts' length, for a model with random weights")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="conf/sweep.yaml overrides, e.g. "
                        "model.arch.num_layers=2")
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("sweep", overrides=[f"model={args.model}", f"data={args.data}",
                                          f"device={args.device}", *args.overrides])
    target = load_target(cfg)
    prompts = _prompts(cfg, target, args)
    own = str(target.embed_tokens.weight.dtype).removeprefix("torch.").replace("bfloat", "bf")
    own = own.replace("float", "fp")
    arms = {own: target, "int8": quantized_copy(target, 8), "int4": quantized_copy(target, 4)}
    layouts = {name: model.lm_head.layout.name for name, model in arms.items() if name != own}
    settings = BenchSettings(max_new_tokens=args.new_tokens, repeats=args.repeats,
                             stop_ids=tuple(target.config.eos_token_ids)
                             if not cfg.model.get("random_weights") else ())
    passes = run_passes([OurDecoder(model) for model in arms.values()], prompts,
                        SamplingParams(), settings)
    speeds = {name: statistics.median(p.tokens_per_s) for name, p in zip(arms, passes,
                                                                        strict=True)}
    same = {name: p.outputs == passes[0].outputs for name, p in zip(arms, passes, strict=True)}
    result = {"model": args.model, "device": str(target.embed_tokens.weight.device),
              "dtype": own, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "tokens_per_s": speeds,
              f"over_{own}": {name: s / speeds[own] for name, s in speeds.items()},
              f"same_greedy_output_as_{own}": same, "layouts": layouts,
              "machine": machine_facts()}
    for name, speed in speeds.items():
        print(f"{name:>5}: {speed:6.1f} tokens/s, x{speed / speeds[own]:.2f} {own}'s; greedy "
              f"output {'the same as' if same[name] else 'differs from'} {own}'s"
              + (f" ({layouts[name]})" if name in layouts else ""))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


def _prompts(cfg, target, args) -> list[list[int]]:
    """The data's prompts, tokenized; random ids for a model with random weights."""
    if cfg.model.get("random_weights"):
        generator = torch.Generator().manual_seed(0)
        return torch.randint(target.config.vocab_size, (args.prompts, args.prompt_tokens),
                             generator=generator).tolist()
    tokenizer = load_tokenizer(target.source)
    texts = sweep_prompt_texts(cfg.data, args.prompts)
    return [p.ids for p in encode_prompt_texts(cfg.data, texts, tokenizer)]


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
