"""Does a row's result depend on the bucket it runs in? The diagnosis of a static step that is
not lossless (`scripts/invariance.py`), as written, compiled, and compiled with
inductor's emulated precision casts, in static steps (replayed CUDA graphs on CUDA):

- each bucket's rows (full, and padded: 3 in 4, 5 in 8, 9 in 16) against themselves fed
  alone, at each cache length: the first layer where a row moves, its logits, argmax flips
  and their top-2 gaps;
- each op of each layer (norm, q/k/v, RoPE, attention, o_proj, second norm, MLP; compiled:
  its two stages) fed the same rows together and alone: which ops depend on their rows;
- plain greedy decoding against the oracle's verification of its answer (chains of k): the
  first token where they part, its bucket, cache length and top-2 gap.

    python scripts/bucket_invariance.py --out bucket_invariance.json        # random-7b, CUDA
    python scripts/bucket_invariance.py --modes eager compiled --buckets 2 4 8 \
        --cache-lengths 16 40 --new-tokens 24 device=cpu model.dtype=fp32 \
        model.arch.hidden_size=64 model.arch.intermediate_size=128 model.arch.num_layers=2 \
        model.arch.num_heads=4 model.arch.num_kv_heads=4 model.arch.vocab_size=256

Arguments after the options are overrides of conf/bench_decode.yaml (default model=random-7b
device=cuda). Prints one verdict per mode; the JSON holds every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from invariance import MODES, diagnose

from selfspec.cli import exit_on_user_error
from selfspec.from_config.common import CONF_DIR, set_threads
from selfspec.from_config.models import random_models
from selfspec.measure.results import machine_facts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--buckets", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--cache-lengths", nargs="+", type=int, default=[64, 512, 600])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-lengths", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path("outputs/bucket_invariance.json"))
    parser.add_argument("overrides", nargs="*", help="conf/bench_decode.yaml overrides")
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench_decode", overrides=["model=random-7b", "device=cuda",
                                                 *args.overrides])
    set_threads(cfg)
    target = random_models(cfg)[0]
    device = target.embed_tokens.weight.device
    generator = torch.Generator().manual_seed(int(cfg.seed))
    prompt = torch.randint(target.config.vocab_size, (1, max(args.cache_lengths)),
                           generator=generator).to(device)
    tokens = torch.randint(target.config.vocab_size, (1, max(args.buckets)),
                           generator=generator).to(device)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {}
    for mode in args.modes:  # the file rewritten after each: a run cut short keeps the rest
        report |= diagnose(target, prompt, tokens, modes=[mode], buckets=args.buckets,
                           cache_lengths=args.cache_lengths, new_tokens=args.new_tokens,
                           draft_lengths=args.draft_lengths)
        args.out.write_text(json.dumps({
            "model": cfg.model.name, "dtype": str(target.embed_tokens.weight.dtype),
            "settings": settings, "modes": report, "machine": machine_facts()}, indent=1) + "\n")
        found = report[mode]
        print(f"{mode}: {found['verdict']} ({found['seconds']:.0f} s, of which "
              f"{found['setup_seconds']:.0f} s compiling and capturing)", flush=True)
    print(f"figures in {args.out}")


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
