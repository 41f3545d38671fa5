"""Generate a few continuations with plain decoding and with a drafter; print tau, the speedup
and the share of repeated 4-grams in the answers (a loop that repeats itself drafts easily: a
speedup on such text says little about a drafter).

    python eval/generate.py                                   # tiny target, small draft model
    python eval/generate.py drafter=ngram sampling=t1 data=stdlib_heldout
    python eval/generate.py model=smollm2-135m drafter=medusa medusa_heads=shipped

The prompts suit the target unless data= says otherwise (data=auto): MT-bench questions for a
chat model (model.chat), HumanEval for the others.
    python eval/generate.py drafter=eagle eagle_head=<train/eagle.py run>/checkpoints/step_N/export
    python eval/generate.py drafter=dflash dflash_head=<train/dflash.py run>/checkpoints/best/export

drafter: any method of selfspec (small_model, ngram, medusa, ngram+medusa, eagle, dflash,
early_exit; the registry in selfspec/from_config/methods/), or none; its settings are
conf/drafters.yaml's.
    python eval/generate.py model=llama2-70b dry_run=true num_gpus=8   # plan only, no weights
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from selfspec.cli import hydra_entry_point
from selfspec.decode import GenerationResult, generate
from selfspec.from_config.generation import drafter_and_target, generation_settings
from selfspec.from_config.models import load_target, load_tokenizer, model_plan, resolve_model_path
from selfspec.from_config.prompts import encode_prompt_texts, prompt_set, prompts
from selfspec.measure.passes import repeated_ngram_share
from selfspec.metrics import GenerationStats


@hydra_entry_point("generate")
def main(cfg: DictConfig) -> None:
    if cfg.dry_run:
        print(model_plan(cfg).format())
        return
    settings, choice = generation_settings(cfg)  # checked before any model loads
    data = prompt_set(cfg)
    texts = prompts(data)
    drafter, target = drafter_and_target(cfg, load_target(cfg), choice)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model))
    questions = encode_prompt_texts(data, texts, tokenizer, target)
    eos = list(target.config.eos_token_ids) or tokenizer.eos_token_id

    def run(ids: list[int], drafter, max_new_tokens: int) -> GenerationResult:
        generator = torch.Generator(target.embed_tokens.weight.device).manual_seed(settings.seed)
        return generate(target, ids, drafter=drafter, sampling=settings.sampling,
                        eos_token_id=eos, max_new_tokens=max_new_tokens, generator=generator)

    for d in (None, drafter):  # warm-up: one-off costs stay out of the timed runs
        run(questions[0].ids, d, 4)
    plains, specs = GenerationStats(), GenerationStats()
    answers = []
    print(f"{len(questions)} {data.name} prompts, {settings.max_new_tokens} new tokens each")
    for encoded in questions:
        plain, spec = (run(encoded.ids, d, settings.max_new_tokens) for d in (None, drafter))
        print(f"=== {encoded.prompt.id}\n{tokenizer.decode(spec.tokens)}\n--- "
              f"{summary(plain.stats, spec.stats, [spec.tokens])}")
        plains.merge(plain.stats)
        specs.merge(spec.stats)
        answers.append(spec.tokens)
    print(f"=== all {len(questions)} prompts: {summary(plains, specs, answers)}")


def summary(plain: GenerationStats, spec: GenerationStats, answers: list[list[int]]) -> str:
    """tau, both speeds and their ratio, and the share of repeated 4-grams in the answers."""
    speedup = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
    return (f"tau {spec.tau:.2f}, {spec.tokens_per_s:.1f} vs {plain.tokens_per_s:.1f} tokens/s "
            f"(x{speedup:.2f} over plain decoding), repeated 4-grams "
            f"{repeated_ngram_share(answers, 4):.2f}")


if __name__ == "__main__":
    main()
