"""Check that every method's greedy output equals plain greedy decoding, prompt by prompt.

    python eval/lossless.py
    python eval/lossless.py methods=[small_model,ngram,hf_assisted] num_draft_tokens=[1,4]

Our drafters are compared with our plain greedy decoding, the Hugging Face peers with HF's
plain greedy `generate`. Prints one line per method and draft length and every mismatch with
its prompt id and plain decoding's top-2 logit gap there. In fp32 every difference is a
failure; in bf16/fp16 one within the dtype's near-tie tolerance
(`selfspec.measure.divergence.near_tie_tolerance`) is reported as a numeric near-tie apart from
real failures. Exits 1 on a real failure, 2 on
a configuration error.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.from_config.common import positive_int, set_threads
from selfspec.from_config.models import load_tokenizer
from selfspec.from_config.prompts import encode_prompt_texts, stop_ids
from selfspec.from_config.sweeps import build_method, load_sweep_models, plan_sweep
from selfspec.measure.lossless import greedy_outputs, lossless_mismatches
from selfspec.measure.peers import quiet_transformers


@hydra_entry_point("lossless")
def main(cfg: DictConfig) -> None:
    if run(cfg):
        sys.exit(1)  # a mismatch: not an input error, so not status 2


def run(cfg: DictConfig) -> int:
    """Every method's greedy output against plain greedy; returns the number of mismatches."""
    set_threads(cfg)
    plan = plan_sweep(cfg, int(cfg.num_prompts), greedy_only=True)
    n = positive_int(cfg, "max_new_tokens")
    models = load_sweep_models(cfg, plan.grid.variants)
    tokenizer = load_tokenizer(models.target.source)
    quiet_transformers()
    encoded = encode_prompt_texts(cfg.data, plan.prompts, tokenizer, models.target)
    prompts = [(p.prompt.id, p.ids) for p in encoded]
    stops = stop_ids(cfg, models.target, tokenizer)
    references, failures, ties = {}, 0, 0
    for point in plan.grid.points():
        method = build_method(models, point.variant, point.draft_length)
        if method.baseline_name not in references:  # plain greedy, once per library
            references[method.baseline_name] = greedy_outputs(
                method.baseline, [ids for _, ids in prompts], n, stops)
        found = lossless_mismatches(method, prompts, references[method.baseline_name], n, stops)
        real = [m for m in found if not m.near_tie]
        label = "MISMATCH" if real else "near-tie" if found else "ok"
        print(f"{label:<8} {method.name} k={method.draft_length}: "
              f"{len(prompts) - len(found)}/{len(prompts)} prompts equal {method.baseline_name}")
        for mismatch in found:
            print(f"  {mismatch.describe()}")
        failures, ties = failures + len(real), ties + len(found) - len(real)
    print(f"{failures} mismatch(es), {ties} numeric near-tie(s) of the dtype (not failures)"
          if failures or ties else "lossless: every output equals plain greedy")
    return failures


if __name__ == "__main__":
    main()
