"""Shared test helpers: a goodness-of-fit check for statistical exactness tests, the comparison
of weights trained by Adam along two float paths, tiny models."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from scipy.stats import chi2


def suite_threads() -> int:
    """The torch threads of the test suite (SELFSPEC_TEST_THREADS, default 1), shared by the
    processes of a test that starts several."""
    return int(os.environ.get("SELFSPEC_TEST_THREADS", "1"))


P_VALUE_FLOOR = 1e-3  # a fixed seed makes each test deterministic; this bounds its false alarms
FLOAT_NOISE = 1e-6  # rounding alone moves a trained fp32 weight of size <= 1 by ~1e-7
MAX_MOVED_SHARE = 0.01  # elements allowed beyond FLOAT_NOISE (gradients that were ~0 once)


def fit_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Chi-square p-value of observed outcome counts against expected probabilities.

    Outcomes with zero expected probability must never be observed (a hard failure, returned
    as p = 0). Cells with tiny expectations are pooled so the chi-square approximation holds.
    """
    if any(expected.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, prob in sorted(expected.items(), key=lambda kv: -kv[1]):
        if prob <= 0:
            continue
        obs, exp = counts.get(key, 0), prob * n
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat, df = stat + (obs - exp) ** 2 / exp, df + 1
    if pooled_exp > 0:
        stat, df = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
    return float(chi2.sf(stat, max(df, 1)))


def joint_two_token_law(first: torch.Tensor, second_given) -> dict:
    """Exact law of (t1, t2): first [V] probabilities, second_given(t1) -> [V]."""
    law = {}
    for t1 in torch.nonzero(first > 0).flatten().tolist():
        row = second_given(t1)
        for t2 in torch.nonzero(row > 0).flatten().tolist():
            law[(t1, t2)] = float(first[t1]) * float(row[t2])
    return law


def tiny_llama(seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32, std: float = 0.2):
    """A seeded random `transformers` Llama; weights of std `std` make its laws peaky."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    return model


def first_layers(hf_model, layers: int = 1):
    """A copy of a `transformers` Llama keeping its first `layers` layers (shared embeddings
    and head): a draft that often agrees with it."""
    import copy

    shallow = copy.deepcopy(hf_model)
    shallow.model.layers = shallow.model.layers[:layers]
    shallow.config.num_hidden_layers = layers
    return shallow


SAMPLING_PROMPT = [2, 3, 4, 2, 3, 4, 2, 3]


def assert_drafted_sampling_is_exact(target, drafter, params, samples: int = 1000) -> None:
    """Generate two tokens `samples` times through `drafter` (fixed seed) and check their
    joint law against the target's exact one (chi-square, P_VALUE_FLOOR); at least a tenth of
    the runs must take both tokens from one step, so the drafts were really in play."""
    from selfspec import generate

    g = torch.Generator().manual_seed(0)
    counts, two_from_one_step = Counter(), 0
    for _ in range(samples):
        out = generate(target, SAMPLING_PROMPT, drafter=drafter, sampling=params,
                       max_new_tokens=2, generator=g)
        counts[tuple(out.tokens)] += 1
        two_from_one_step += out.stats.steps == 1
    assert two_from_one_step > samples / 10, two_from_one_step
    law = exact_two_token_law(target, SAMPLING_PROMPT, params)
    assert fit_pvalue(counts, law, samples) > P_VALUE_FLOOR


def exact_two_token_law(target, prompt: list[int], params) -> dict:
    """The target model's exact law of its next two tokens after `prompt`, warped by params."""
    from selfspec.sampling import logits_to_probs

    def law_after(ids):
        logits = target(torch.tensor([ids]), torch.arange(len(ids))).logits[0, -1]
        return logits_to_probs(logits, params)

    with torch.inference_mode():
        return joint_two_token_law(law_after(prompt), lambda t1: law_after(prompt + [t1]))


def fit_medusa_heads(target, continuations: dict, num_heads: int = 4, steps: int = 30):
    """Medusa heads fit (AdamW, full batch) to the target's own greedy continuations, given as
    {prompt tuple: new tokens}; returns (heads in eval mode, the last step's metrics)."""
    from selfspec.heads import MedusaConfig, MedusaHeads
    from selfspec.losses import medusa_loss

    rows = [list(prompt) + tokens for prompt, tokens in continuations.items()]
    length = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])  # [B, T]
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows]).bool()
    with torch.no_grad():
        hidden = target(tokens, torch.arange(length)).last_hidden  # [B, T, H]
    torch.manual_seed(0)
    config = target.config
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=num_heads))
    heads.init_from_lm_head(target.lm_head.weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        out = medusa_loss(heads(hidden), tokens, mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return heads.eval(), out.metrics


def fit_eagle_head(target, continuations: dict, version: int = 1, steps: int = 60, **config):
    """An EAGLE head fit (AdamW, full batch) to the target's own greedy continuations, given as
    {prompt tuple: new tokens}; EAGLE-3 heads (version 3) get their draft vocabulary from those
    rows and train with a 3-step training-time test. Returns (head in eval mode, metrics)."""
    from selfspec.heads import EagleConfig, EagleHead, draft_vocabulary
    from selfspec.objectives import Eagle3Objective, EagleObjective

    rows = [list(prompt) + tokens for prompt, tokens in continuations.items()]
    length = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])  # [B, T]
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows]).bool()
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.config, version, **config))
    if version == 3:
        vocab = draft_vocabulary(tokens, target.config.vocab_size, head.config.draft_vocab_size,
                                 mask)
        head.set_draft_vocab(vocab).init_from_target(target)
        objective = Eagle3Objective(target, head, steps=3)
    else:
        objective = EagleObjective(target, head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(steps):
        out = objective(tokens, mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return head.eval(), out.metrics


# ---- weights trained by Adam along two float paths ------------------------------------------
#
# Two runs that differ only in float rounding (process count, ZeRO partitioning, threads) do not
# give the same weights to any fixed atol. Adam's step for an element is lr_t * m_t / sqrt(v_t)
# (bias-corrected): about lr_t * sign(g) whatever |g|, so an element whose gradient is within
# rounding of zero at some step moves by up to ~lr_t, one way in one run and the other way in
# the other. What is guaranteed:
#
# 1. A bound on every element. With m_t = (1-b1) sum_j b1^j g_{t-j} and v_t = (1-b2) sum_j
#    b2^j g_{t-j}^2, Cauchy-Schwarz on b1^j g = (b1^j / b2^(j/2)) (b2^(j/2) g) gives
#    |m_hat / sqrt(v_hat)| <= C_t = (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2))
#    * sqrt(sum_{j<t} (b1^2/b2)^j), so no step moves an element by more than lr_t * C_t
#    (eps only shrinks it; C_1 = 1, C_4 ~ 1.007 at 0.9/0.999). Decoupled weight decay scales
#    the difference of two runs from the same start by (1 - lr_t wd) <= 1, so the runs differ
#    per element by at most 2 * sum_t lr_t C_t. It is loose (an export one step late passes).
# 2. Power. Rounding changes a gradient by ~1e-7 of the typical gradient size G, which moves
#    the step lr * m_hat / sqrt(v_hat) by ~lr * 1e-7 * G / |g|: beyond FLOAT_NOISE (at lr ~1e-3)
#    only where |g| < ~1e-4 G at some step. Few elements of a tensor with generic gradients are
#    that close to zero (an exactly-zero gradient takes the same zero step in both runs), so
#    at most MAX_MOVED_SHARE of the elements may differ by more than FLOAT_NOISE; a stale or
#    partial export moves nearly all of them.


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """C_t: the largest |m_hat / sqrt(v_hat)| Adam can reach at step t (1-based)."""
    b1, b2 = betas
    geometric = sum((b1 * b1 / b2) ** j for j in range(t))
    return (1 - b1) / (1 - b1**t) * math.sqrt((1 - b2**t) / (1 - b2)) * math.sqrt(geometric)


def assert_same_adam_training(
    got: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    lr_per_step: Sequence[float],
    betas: tuple[float, float] = (0.9, 0.999),
) -> None:
    """Weights from the same start and data trained by Adam(W) at these per-step learning rates
    (the largest of any group they belong to) agree as far as float rounding allows (above)."""
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    bound = 2 * sum(lr * adam_step_bound(t, betas) for t, lr in enumerate(lr_per_step, 1))
    diffs = {k: (got[k].double() - expected[k].double()).abs().flatten() for k in expected}
    worst = max(diffs, key=lambda k: float(diffs[k].max()))
    assert float(diffs[worst].max()) <= bound + FLOAT_NOISE, (
        f"{worst} differs by {float(diffs[worst].max()):.3g}: beyond what Adam allows "
        f"({bound:.3g})")
    moved = {k: int((d > FLOAT_NOISE).sum()) for k, d in diffs.items()}
    total = sum(d.numel() for d in diffs.values())
    most = ", ".join(f"{moved[k]} in {k}" for k in sorted(moved, key=moved.get)[-3:])
    assert sum(moved.values()) <= MAX_MOVED_SHARE * total, (
        f"{sum(moved.values())} of {total} elements differ by more than {FLOAT_NOISE:g} "
        f"(at most {MAX_MOVED_SHARE:.0%} may), most in: {most}")


def run_trainer(name: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python train/<name>.py overrides...` in a subprocess, W&B offline."""
    entry = Path(__file__).resolve().parents[1] / "train" / f"{name}.py"
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, str(entry), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def sweep_variant(cfg, label: str):
    """The sweep row of cfg named `label` (e.g. ngram/corpus/tree5), as its variant object."""
    from selfspec.from_config import plan_sweep

    return plan_sweep(cfg, 1, greedy_only=True).grid.variant(label)


EVAL = Path(__file__).resolve().parents[1] / "eval"


def load_entry(name: str):
    """An eval/ entry point as a module (eval/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"eval_{name}", EVAL / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def toy(quick_build: Path, draft: str = "draft") -> list[str]:
    return ["model=local", f"model.path={quick_build / 'target'}",
            f"model.draft.path={quick_build / draft}", "progress=false"]
