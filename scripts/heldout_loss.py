"""Held-out loss and perplexity of causal LMs on the held-out stdlib split.

    python scripts/heldout_loss.py selfspec/assets/tiny/target selfspec/assets/tiny/draft

Deterministic: the first ``--max-tokens`` tokens of the held-out files (sorted, joined with
eos, see ``selfspec.training.data``), cut into windows of ``--seq-len``; every token of a window but
the first is predicted. Models are evaluated in float32 whatever dtype they were saved in.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from selfspec.cli import exit_on_user_error
from selfspec.corpus import stdlib_files
from selfspec.from_config.models import load_tokenizer
from selfspec.training.data import pack_token_stream, token_stream

DEFAULT_MAX_TOKENS = 200_000
DEFAULT_SEQ_LEN = 256


def heldout_windows(tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS,
                    seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """The fixed evaluation set: LongTensor [N, seq_len] from the held-out stdlib files."""
    ids = token_stream(tokenizer, stdlib_files("heldout"), max_tokens=max_tokens)
    return pack_token_stream(ids, seq_len)


@torch.no_grad()
def mean_token_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16,
                    progress: bool = True) -> tuple[float, int]:
    """Mean next-token cross entropy (nats) over all predicted tokens, and their count."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc="held-out", leave=False,
                      disable=not progress):
        ids = windows[start:start + batch_size]  # [B, T]
        logits = model(input_ids=ids).logits.float()  # [B, T, V]
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                 reduction="sum").item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count, count


def load_model(folder: Path) -> torch.nn.Module:
    """A saved causal LM in float32 (fp16 weights are upcast: fp16 matmuls crawl on CPU)."""
    from transformers import AutoModelForCausalLM

    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a saved model folder")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def measure(folder: Path, max_tokens: int = DEFAULT_MAX_TOKENS,
            seq_len: int = DEFAULT_SEQ_LEN) -> dict:
    """Held-out loss, perplexity and token count of one model folder (with its tokenizer)."""
    model = load_model(folder)  # checks the folder first
    tokenizer = load_tokenizer(folder)
    windows = heldout_windows(tokenizer, max_tokens, seq_len)
    loss, count = mean_token_loss(model, windows)
    return {"model": str(folder), "heldout_loss": loss, "perplexity": math.exp(loss),
            "tokens": count, "seq_len": seq_len}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="saved model folders")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="evaluate the first N held-out tokens")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(f, args.max_tokens, args.seq_len) for f in args.folders]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['model']}: held-out loss {r['heldout_loss']:.4f}  "
                  f"perplexity {r['perplexity']:.2f}  ({r['tokens']} tokens)")
    return results


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
