"""Does a row's result depend on the bucket it runs in? Runs one decode step of
`model=random-7b` (bf16, CUDA) as the last row-0 token alone and in buckets of 2 and 4, static
steps as written and compiled (with and without inductor's emulated precision casts), and
prints how far the row's hidden states and logits moved, and its argmax.

    python scripts/bucket_invariance.py

If a row's logits depend on its bucket, greedy verification can break a near-tie the other
way from one-token decoding. Its output: docs/results/gpu/h200_compiled_step_checks.txt.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from selfspec import from_config
from selfspec.step import StaticSteps

LAYERS = (1, 2, 16, 32)


def row_in_buckets(target, prompt: torch.Tensor, tokens: torch.Tensor) -> dict:
    """The first row's output in buckets of 1, 2 and 4, after the same prefill."""
    steps = StaticSteps(target, 512)
    length = prompt.shape[1] - 1
    outputs = {}
    with torch.inference_mode():
        target(prompt[:, :-1], torch.arange(length, device="cuda"), steps.cache)
        for n in (1, 2, 4):
            steps.cache.truncate(length)
            rows = torch.cat([prompt[:, -1:], tokens[:, : n - 1]], dim=1)
            outputs[n] = steps.forward(rows, length + torch.arange(n, device="cuda"), None,
                                       layers=LAYERS)
    return outputs


def main() -> None:
    from torch._inductor import config as inductor

    with initialize_config_dir(str(Path("conf").resolve()), version_base=None):
        cfg = compose("bench_decode", overrides=["model=random-7b", "device=cuda"])
    target = from_config.random_models(cfg)[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(target.config.vocab_size, (1, 64), generator=generator).cuda()
    tokens = torch.randint(target.config.vocab_size, (1, 4), generator=generator).cuda()
    for compiled, emulate in ((False, False), (True, False), (True, True)):
        inductor.emulate_precision_casts = emulate
        torch._dynamo.reset()
        target.compile_steps = compiled
        outputs = row_in_buckets(target, prompt, tokens)
        alone = outputs[1]
        for n in (2, 4):
            moved = [(layer, (outputs[n].hidden[i][:, 0] - alone.hidden[i][:, 0]).abs().max()
                      .item()) for i, layer in enumerate(LAYERS)]
            logits, reference = outputs[n].logits[0, 0], alone.logits[0, 0]
            print(f"compiled={compiled} emulate={emulate} bucket {n} vs 1: hidden diffs {moved}, "
                  f"logit max diff {(logits - reference).abs().max().item():.4g}, argmax "
                  f"{logits.argmax().item()} vs {reference.argmax().item()}, ties at max "
                  f"{(reference == reference.max()).sum().item()}", flush=True)


if __name__ == "__main__":
    main()
