"""The decode loop of an earlier revision against today's, interleaved in one process.

    python scripts/loop_before_after.py HEADS_EXPORT --before 9d765f4 --out before_after.json

Loads `selfspec/decode.py` as it was at `--before` (git show) beside the current one and times
plain decoding and Medusa drafting (the default report's tree: top-2 products, 8 nodes) under
both, prompt by prompt and repeat by repeat, on the first `--prompts` HumanEval prompts of
`--target` (the tiny target by default). Each speedup is over plain decoding by the same loop.
The earlier arm also builds a new `Tree` every step, as that revision did.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from selfspec.cli import exit_on_user_error
from selfspec.drafters import MedusaProductDrafter
from selfspec.from_config.models import load_tokenizer
from selfspec.heads import load_head
from selfspec.measure.passes import BenchSettings, run_passes
from selfspec.measure.prompts import encode_prompts, humaneval_prompts
from selfspec.metrics import describe_split
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams
from selfspec.tree import Tree

REPO = Path(__file__).resolve().parents[1]


def decode_module_at(revision: str):
    """selfspec/decode.py as it was at `revision`, imported under another name."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:selfspec/decode.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "decode_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("selfspec_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@contextmanager
def trees_built_every_step():
    """Tree.from_parents without its cache of recurring shapes (the earlier behaviour)."""
    cached = Tree.__dict__["from_parents"]
    Tree.from_parents = classmethod(lambda cls, parents: cls._build_from_parents(
        tuple(int(p) for p in parents)))
    try:
        yield
    finally:
        Tree.from_parents = cached


class LoopDecoder:
    """One revision's `generate` as a bench decoder (see selfspec.measure.peers.OurDecoder)."""

    measures_draft_time = True

    def __init__(self, generate, target: Transformer, drafter, before: bool):
        self.generate, self.target, self.drafter, self.before = generate, target, drafter, before

    def __call__(self, prompt, sampling, max_new_tokens, seed, stop_ids):
        start = time.perf_counter()
        if self.before:
            with trees_built_every_step():
                result = self._run(prompt, sampling, max_new_tokens)
        else:
            result = self._run(prompt, sampling, max_new_tokens)
        result.stats.wall_time_s = time.perf_counter() - start
        return result

    def _run(self, prompt, sampling, max_new_tokens):
        return self.generate(self.target, list(prompt), drafter=self.drafter, sampling=sampling,
                             max_new_tokens=max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", type=Path, help="a train/medusa.py export folder")
    parser.add_argument("--target", type=Path, default=REPO / "selfspec/assets/tiny/target",
                        help="the target the heads were trained for (default: the tiny one)")
    parser.add_argument("--before", required=True, help="the earlier revision (git)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    figures = exit_on_user_error(measure, args)
    print(json.dumps({k: v for k, v in figures.items() if k != "time_split"}, indent=1))
    for name, split in figures["time_split"].items():
        print(f"{name}: {describe_split(split)}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


def measure(args) -> dict:
    from selfspec import decode

    target = Transformer.from_pretrained(args.target)
    heads = load_head(args.heads, target=target)
    prompts = encode_prompts(humaneval_prompts()[: args.prompts], load_tokenizer(target.source),
                             1024, False)
    ids = [p.ids for p in prompts]
    drafter = MedusaProductDrafter(heads, top_k=2, max_nodes=8)
    old = decode_module_at(args.before)
    arms = {"plain_before": LoopDecoder(old.generate, target, None, True),
            "medusa_before": LoopDecoder(old.generate, target, drafter, True),
            "plain_after": LoopDecoder(decode.generate, target, None, False),
            "medusa_after": LoopDecoder(decode.generate, target, drafter, False)}
    settings = BenchSettings(max_new_tokens=args.new_tokens, repeats=args.repeats)
    passes = dict(zip(arms, run_passes(list(arms.values()), ids, SamplingParams(), settings),
                      strict=True))
    speed = {name: statistics.median(p.tokens_per_s) for name, p in passes.items()}
    outputs = [p.outputs for p in passes.values()]
    return {
        "before": args.before, "prompts": len(ids), "new_tokens": args.new_tokens,
        "repeats": args.repeats, "threads": args.threads, "tokens_per_s": speed,
        "tau": {name: passes[name].stats.tau for name in ("medusa_before", "medusa_after")},
        "speedup_before": speed["medusa_before"] / speed["plain_before"],
        "speedup_after": speed["medusa_after"] / speed["plain_after"],
        "lossless": all(o == outputs[0] for o in outputs),
        "time_split": {name: p.stats.time_split for name, p in passes.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
