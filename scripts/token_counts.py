"""Write a finished training run's token counts beside each of its head exports.

    python scripts/token_counts.py outputs/medusa/<run>

The trainers keep the counts of their training rows' supervised tokens beside every export
(`token_counts.safetensors`): what `scripts/export_heads.py --draft-vocab K` narrows Medusa heads
by and `eagle.draft_vocab=K` drafts over. This rebuilds them for runs trained before that, from
the run's recorded config: the same rows, so the same counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from selfspec.cli import exit_on_user_error
from selfspec.from_config.models import load_target, load_tokenizer
from selfspec.from_config.training import training_rows
from selfspec.heads.draft_vocab import COUNTS_FILE, save_token_counts, token_counts
from selfspec.training.checkpoints import RUN_CONFIG


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder of train/medusa.py or train/eagle.py")
    args = parser.parse_args(argv)
    recorded = args.run / RUN_CONFIG
    exports = sorted(args.run.glob("checkpoints/*/export"))
    if not recorded.is_file() or not exports:
        raise FileNotFoundError(f"{args.run}: no {RUN_CONFIG} and head exports there; give the "
                                f"folder of a training run (hydra.run.dir)")
    cfg = OmegaConf.create(json.loads(recorded.read_text()))
    target = load_target(cfg)
    train, _ = training_rows(cfg, load_tokenizer(target.source), target)
    counts = token_counts(train.tokens, target.config.vocab_size, train.loss_mask)
    for export in exports:
        save_token_counts(export, counts)
        print(f"wrote {export / COUNTS_FILE}")


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
