"""tau and accepted share per depth of one EAGLE head over several draft shapes, greedy, on
the final-evaluation prompts of `train/eagle.py` (counts, not timings: exact on any machine).

    python scripts/eagle_shapes.py HEAD_FOLDER --out docs/results/eagle_shapes/e1.json
    python scripts/eagle_shapes.py HEAD_FOLDER --shapes chain4 8/3/2 16/5/2 --prompts 8

A shape is `chainN` (a static chain of N, as EAGLE-1 drafts) or `total/depth/top_k` (an EAGLE-2
dynamic tree). The accepted share at depth d is the share of steps that accepted d tokens or
more.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from tqdm import tqdm

from selfspec.cli import exit_on_user_error
from selfspec.decode import generate
from selfspec.drafters import EagleDrafter
from selfspec.from_config.methods.eagle import load_eagle
from selfspec.from_config.models import load_target
from selfspec.from_config.training import final_eval_prompts
from selfspec.metrics import GenerationStats
from selfspec.tree import Tree

CONF = Path(__file__).resolve().parents[1] / "conf"
SHAPES = ["chain1", "chain2", "chain4", "8/3/2", "16/5/2", "16/4/4", "32/6/4"]


def drafter_for(head, shape: str) -> EagleDrafter:
    """The drafter a shape names: chainN, or total/depth/top_k."""
    if shape.startswith("chain"):
        return EagleDrafter(head, tree=Tree.chain(int(shape.removeprefix("chain"))))
    try:
        total, depth, top_k = (int(part) for part in shape.split("/"))
    except ValueError:
        raise ValueError(f"eagle_shapes: shape {shape!r} is neither chainN nor "
                         f"total/depth/top_k (e.g. 16/5/2)") from None
    return EagleDrafter(head, total_tokens=total, depth=depth, top_k=top_k)


def measure(head_folder: str, shapes: list[str], num_prompts: int, new_tokens: int) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("train_eagle", overrides=[f"final_eval.num_prompts={num_prompts}"])
    target = load_target(cfg)
    head = load_eagle(head_folder, target)
    prompts = final_eval_prompts(cfg, target)
    rows = []
    for shape in tqdm(shapes, desc="shapes"):
        drafter, stats = drafter_for(head, shape), GenerationStats()
        for prompt in prompts:
            stats.merge(generate(target, prompt, drafter=drafter, max_new_tokens=new_tokens).stats)
        rows.append({"shape": shape, "tau": stats.tau,
                     "accepted_share_by_depth": stats.acceptance_by_position})
    return {"head": str(head_folder), "prompts": num_prompts, "new_tokens": new_tokens,
            "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", help="an export folder of train/eagle.py")
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    figures = measure(args.head, args.shapes, args.prompts, args.new_tokens)
    for row in figures["rows"]:
        depths = ", ".join(f"{share:.2f}" for share in row["accepted_share_by_depth"])
        print(f"{row['shape']:>8}  tau {row['tau']:.2f}  accepted share by depth: {depths}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    exit_on_user_error(main)
