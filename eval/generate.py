"""Generate a few continuations with plain decoding and with a drafter; print tau and speedup.

    python eval/generate.py                                   # tiny target, small draft model
    python eval/generate.py drafter=ngram sampling=t1 data=stdlib_heldout
    python eval/generate.py model=llama2-70b dry_run=true num_gpus=8   # plan only, no weights
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig

from selfspec import build
from selfspec.decode import GenerationResult, generate


@hydra.main(config_path="../conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.dry_run:
        print(build.model_plan(cfg).format())
        return
    try:  # configuration and availability errors carry their fix: no traceback
        target = build.load_target(cfg)
        drafter = build.build_drafter(cfg, target)
        tokenizer = load_tokenizer(target.source)
        prompts = build.load_prompts(cfg.data, tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sampling = build.sampling_params(cfg.sampling)
    eos = list(target.config.eos_token_ids) or tokenizer.eos_token_id

    def run(ids: list[int], drafter, max_new_tokens: int) -> GenerationResult:
        return generate(target, ids, drafter=drafter, sampling=sampling, eos_token_id=eos,
                        max_new_tokens=max_new_tokens,
                        generator=torch.Generator().manual_seed(cfg.seed))

    for d in (None, drafter):  # warm-up: one-off costs stay out of the timed runs
        run(prompts[0].ids, d, 4)
    for encoded in prompts:
        plain, spec = (run(encoded.ids, d, cfg.max_new_tokens) for d in (None, drafter))
        report(encoded.prompt.id, tokenizer.decode(spec.tokens), plain, spec)


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer  # a slow import: only once the weights are there

    return AutoTokenizer.from_pretrained(folder)


def report(prompt_id: str, text: str, plain: GenerationResult, spec: GenerationResult) -> None:
    speedup = spec.stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0
    print(f"=== {prompt_id}\n{text}\n--- tau {spec.stats.tau:.2f}, "
          f"{spec.stats.tokens_per_s:.1f} vs {plain.stats.tokens_per_s:.1f} tokens/s "
          f"(x{speedup:.2f} over plain decoding)")


if __name__ == "__main__":
    main()
