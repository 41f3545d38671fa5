"""Check that every method's greedy output equals plain greedy decoding, prompt by prompt.

    python eval/lossless.py
    python eval/lossless.py methods=[small_model,ngram,hf_assisted] num_draft_tokens=[1,4]

Our drafters are compared with our plain greedy decoding, the Hugging Face peers with HF's
plain greedy `generate`. Prints one line per method and draft length and every mismatch with
its prompt id; exits 1 on any mismatch, 2 on a configuration error.
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig

from selfspec import build
from selfspec.bench import greedy_outputs, lossless_mismatches
from selfspec.peers import quiet_transformers


@hydra.main(config_path="../conf", config_name="lossless", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def run(cfg: DictConfig) -> int:
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    try:
        plan = build.plan_sweep(cfg, int(cfg.num_prompts), greedy_only=True)
        models = build.load_sweep_models(cfg, plan.grid.methods)
        tokenizer = build.load_tokenizer(models.target.source)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    quiet_transformers()
    encoded = build.encode_sweep_prompts(cfg.data, plan.prompts, tokenizer)
    prompts = [(p.prompt.id, p.ids) for p in encoded]
    stops, n = build.stop_ids(cfg, models.target, tokenizer), int(cfg.max_new_tokens)
    references, failures = {}, 0
    for point in plan.grid.points():
        method = build.build_method(models, point.method, point.draft_length)
        if method.baseline_name not in references:  # plain greedy, once per library
            references[method.baseline_name] = greedy_outputs(
                method.baseline, [ids for _, ids in prompts], n, stops)
        found = lossless_mismatches(method, prompts, references[method.baseline_name], n, stops)
        print(f"{'MISMATCH' if found else 'ok':<8} {method.name} k={method.draft_length}: "
              f"{len(prompts) - len(found)}/{len(prompts)} prompts equal {method.baseline_name}")
        for mismatch in found:
            print(f"  {mismatch.describe()}")
        failures += len(found)
    print(f"{failures} mismatch(es)" if failures else "lossless: every output equals plain greedy")
    return 1 if failures else 0


if __name__ == "__main__":
    main()
