"""The random-weights preset of each family of 2026 through eval/bench_decode.py, one process
each, their figures gathered into one JSON (the GPU check's `families` part): plain tokens/s,
c(N), and whether the oracle's chains and EAGLE-2's tree stay lossless on latent attention,
chunked attention, a Gemma 4 decoder, a recurrent hybrid and a target's own MTP module.

    python scripts/bench_families.py --out families.json [--device cuda] [--presets ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("random-mtp", "random-deepseek-v3", "random-llama4", "random-gemma4",
           "random-hybrid")
# What each preset's own module drafts beside the oracle (its cost row), where it has one.
METHODS = {"random-mtp": "[mtp]", "random-deepseek-v3": "[mtp]", "random-hybrid": "[mtp]"}


def bench(preset: str, device: str, new_tokens: int, folder: Path) -> dict:
    """One preset's bench_decode.json (the oracle's chains of 1 and 4 and EAGLE-2's tree)."""
    command = [sys.executable, str(ROOT / "eval" / "bench_decode.py"), f"model={preset}",
               f"device={device}", "num_prompts=1", "repeats=1", "prompt_tokens=128",
               f"new_tokens={new_tokens}", "cost_lengths=[1,2,4,8,16,32,64]",
               "draft_lengths=[1,4]", "oracle_trees=[eagle2]",
               f"methods={METHODS.get(preset, '[]')}", f"hydra.run.dir={folder}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads((folder / "bench_decode.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    figures = {}
    with tempfile.TemporaryDirectory() as work:
        for preset in args.presets:  # each written at once: a timeout keeps what finished
            figures[preset] = bench(preset, args.device, args.new_tokens, Path(work) / preset)
            args.out.write_text(json.dumps({"presets": figures}, indent=1) + "\n")
            print(preset, summary(figures[preset]), flush=True)
    return 0 if all("error" not in f for f in figures.values()) else 1


def summary(figures: dict) -> str:
    """One preset's line: plain tokens/s and whether every oracle row stayed lossless."""
    if "error" in figures:
        return f"error: {figures['error']}"
    rows = figures["oracle"] + figures.get("oracle_trees", []) + figures.get("methods", [])
    parted = sum(1 for r in rows if not r["lossless"])
    return (f"plain {figures['plain_tokens_per_s']:.1f} tok/s, "
            + ("lossless" if not parted else f"NOT lossless in {parted}"))


if __name__ == "__main__":
    raise SystemExit(main())
