"""Shared test helpers: a goodness-of-fit check for statistical exactness tests, the comparison
of weights trained by Adam along two float paths, tiny models, and the heads, drafters, data and
published checkpoint folders that tests in several folders build."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from scipy.stats import chi2

# Packages a machine may lack (the GPU machines lack both): their tests skip, and the trainers
# keep their JSON-lines record alone.
HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, args: Sequence[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run a repository script in this process as `python script args...` would, sparing a
    test the seconds of a new interpreter; returns (exit status, stdout, stderr)."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # restored afterwards (the boundary sets it)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(sys, "argv", [str(REPO / script), *args])
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    # the script's @hydra.main starts Hydra afresh; a test's open compose context comes back
    composing = Singleton._instances.pop(GlobalHydra, None)
    code, threads = 0, torch.get_num_threads()
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    finally:
        torch.set_num_threads(threads)  # a script may set its own (threads=...)
        Singleton._instances.pop(GlobalHydra, None)
        if composing is not None:
            Singleton._instances[GlobalHydra] = composing
    out, err = capsys.readouterr()
    return code, out, err


def suite_threads() -> int:
    """The torch threads of the test suite (SELFSPEC_TEST_THREADS, default 1), shared by the
    processes of a test that starts several."""
    return int(os.environ.get("SELFSPEC_TEST_THREADS", "1"))


def covering(*axes: Sequence) -> list:
    """The cross product of `axes` as pytest params, all but one diagonal marked slow: the
    quick run still tries every value of every axis once, the complete run every combination.
    For a test's stacked parametrizations whose product is too dear for the quick run."""
    import itertools

    import pytest

    width = max(len(axis) for axis in axes)
    quick = {tuple(i % len(axis) for axis in axes) for i in range(width)}
    return [pytest.param(*(axis[i] for axis, i in zip(axes, index, strict=True)),
                         marks=() if index in quick else pytest.mark.slow)
            for index in itertools.product(*(range(len(axis)) for axis in axes))]


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
    return tiny_model("llama", seed, vocab, layers, hidden, std)


FAMILIES = ("llama", "qwen3", "gemma3")  # the targets every drafter is checked on
MORE_FAMILIES = ("gemma2", "olmo2", "granite", "phi3")  # soft-capping, post-norms, multipliers,
# LongRoPE past its original context (16 positions here) and partial rotary
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
WINDOW = 4  # the sliding families' window: shorter than every sequence the tests decode
FAMILY_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42]]  # repeats: lookup drafts


@functools.cache
def family_model(family: str, vocab: int = 64, hidden: int = 32, std: float = 0.2):
    """The seeded random target of a family that the every-family tests decode and train on:
    4 layers (cached: read-only to its users)."""
    from selfspec import Transformer

    return Transformer.from_hf(tiny_model(family, 0, vocab=vocab, layers=4, hidden=hidden,
                                          std=std)).eval()


def family_config(family: str, vocab: int = 64, layers: int = 2, hidden: int = 32, **extra):
    """A `transformers` config of a family shaped like its published models, scaled down:
    Qwen3 with head_dim apart from hidden / heads; Gemma 3 with one KV head (as the 270M
    model), a window of WINDOW tokens on its even layers and a RoPE each (the full layers'
    scaled linearly, as Gemma 3 4B's), and a query_pre_attn_scalar of its own; Gemma 2 with
    soft-capping that bites at this size; OLMo 2, Granite (multipliers) and Phi-3 (partial
    rotary, LongRoPE switching at position 16). The mixtures of experts: Qwen3-MoE as
    Qwen3-30B-A3B (128 experts, top 8, narrow experts, norm_topk_prob) cut to 8 experts,
    top 2, and its first layer dense (mlp_only_layers) unless one layer; Mixtral (8 experts,
    top 2) with a window of WINDOW tokens on every layer; gpt-oss (sinks, biases, YaRN,
    window and full layers alternating) with 8 experts, top 2, a window of WINDOW tokens and
    a swiglu_limit low enough to clamp. DeepSeek-V3: latent attention (both low-rank
    products), YaRN scaling the softmax too, 8 experts in 4 groups (top 2 from the best 2
    groups) with two shared experts, its first layer dense. Llama 4: chunks of WINDOW tokens
    on its RoPE layers, its fourth layer without RoPE and its queries' temperature tuned
    from position 3 on, 4 experts (top 2) and a shared one on every other layer."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=256,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention"
                   for i in range(layers)]
    gemma = dict(head_dim=16, sliding_window=WINDOW, layer_types=alternating,
                 query_pre_attn_scalar=12, tie_word_embeddings=True)
    rotary = int(hidden // 4 * 0.5) // 2
    configs = {
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=2),
        "qwen3": lambda: tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=16),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, **gemma, num_key_value_heads=1,
                                              rope_parameters={
                                                  "full_attention": {"rope_type": "linear",
                                                                     "factor": 2.0,
                                                                     "rope_theta": 1e6},
                                                  "sliding_attention": {"rope_type": "default",
                                                                        "rope_theta": 1e4}}),
        "gemma2": lambda: tf.Gemma2Config(**common, **gemma, num_key_value_heads=2,
                                          attn_logit_softcapping=2.0,
                                          final_logit_softcapping=4.0),
        "olmo2": lambda: tf.Olmo2Config(**common, num_key_value_heads=2),
        "granite": lambda: tf.GraniteConfig(**common, num_key_value_heads=2,
                                            embedding_multiplier=4.0, residual_multiplier=0.5,
                                            attention_multiplier=0.2, logits_scaling=2.0),
        "phi3": lambda: tf.Phi3Config(**{**common, "max_position_embeddings": 64},
                                      num_key_value_heads=2, original_max_position_embeddings=16,
                                      rope_parameters={
                                          "rope_type": "longrope", "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5,
                                          "short_factor": [1.0 + i / 4 for i in range(rotary)],
                                          "long_factor": [2.0 + i for i in range(rotary)]}),
    }
    moe = dict(num_experts_per_tok=2)
    configs |= {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **common, **moe, num_key_value_heads=2, head_dim=16, num_experts=8,
            moe_intermediate_size=hidden // 2, norm_topk_prob=True,
            mlp_only_layers=[0] if layers > 1 else []),
        "mixtral": lambda: tf.MixtralConfig(**common, **moe, num_key_value_heads=2,
                                            num_local_experts=8, sliding_window=WINDOW),
        "gpt_oss": lambda: tf.GptOssConfig(
            **common, **moe, num_key_value_heads=2, head_dim=16, num_local_experts=8,
            sliding_window=WINDOW, layer_types=alternating, swiglu_limit=1.0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 1e4,
                             "original_max_position_embeddings": 64}),
    }
    configs["deepseek_v3"] = lambda: tf.DeepseekV3Config(  # MLA, YaRN with mscale_all_dim
        **common, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8,
        qk_nope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=hidden // 2, n_shared_experts=2,
        first_k_dense_replace=1, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 1.0,
            "mscale_all_dim": 0.8, "original_max_position_embeddings": 64})
    configs["llama4"] = lambda: tf.Llama4TextConfig(  # chunks of 4, NoPE every 4th layer
        **{**common, "intermediate_size": hidden // 2}, intermediate_size_mlp=2 * hidden,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        interleave_moe_layer_step=2, attention_chunk_size=WINDOW, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    config = configs[family]()
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32,
               std: float = 0.2, **extra):
    """A seeded random `transformers` model of a family (`family_config`); weights of std
    `std` (norm weights around their unit gain) make its laws peaky."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch.manual_seed(seed)
    config = family_config(family, vocab, layers, hidden, **extra)
    config._attn_implementation = "eager"
    # The class itself, not AutoModelForCausalLM.from_config: that one partitions the weights
    # under a ZeRO-3 run (the distributed tests build their target inside one).
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).float().eval()
    unit = 0.0 if family.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(unit if "norm" in name else 0.0, std)
    return model


def random_preset(name: str, weights: bool):
    """The TargetSpec of conf/model/{name}.yaml (seed 3)."""
    from omegaconf import OmegaConf

    from selfspec.from_config.models import target_spec

    conf = Path(__file__).resolve().parents[1] / "conf" / "model" / f"{name}.yaml"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf), "device": "cpu", "seed": 3})
    return target_spec(cfg, weights)


def first_layers(hf_model, layers: int = 1):
    """A copy of a `transformers` Llama keeping its first `layers` layers (shared embeddings
    and head): a draft that often agrees with it."""
    import copy

    shallow = copy.deepcopy(hf_model)
    shallow.model.layers = shallow.model.layers[:layers]
    shallow.config.num_hidden_layers = layers
    return shallow


SAMPLING_PROMPT = [2, 3, 4, 2, 3, 4, 2, 3]
# The draws of a default-run law test where a verifier without its residual update was
# measured to fail below p = 1e-6 at this size (estimated from the chi-square statistic of the
# full-size run under that planted bug); the others keep their full size.
FAST_LAW_SAMPLES = 500


def law_samples(request, full: int = 1000) -> int:
    """The draws of a parametrized law test: FAST_LAW_SAMPLES for the default run's case,
    `full` for the cases marked slow (the complete run's)."""
    return full if request.node.get_closest_marker("slow") else FAST_LAW_SAMPLES


def assert_drafted_sampling_is_exact(target, drafter, params, samples: int = 1000,
                                     cuda_graphs: bool | None = None) -> None:
    """Generate two tokens `samples` times through `drafter` (fixed seed) and check their
    joint law against the target's exact one (chi-square, P_VALUE_FLOOR); at least a tenth of
    the runs must take both tokens from one step, so the drafts were really in play.
    cuda_graphs: as `generate`'s (True: static steps, and static drafting). On the
    target's device."""
    from selfspec import generate

    g = torch.Generator(device=target.embed_tokens.weight.device).manual_seed(0)
    counts, two_from_one_step = Counter(), 0
    for _ in range(samples):
        out = generate(target, SAMPLING_PROMPT, drafter=drafter, sampling=params,
                       max_new_tokens=2, generator=g, cuda_graphs=cuda_graphs)
        counts[tuple(out.tokens)] += 1
        two_from_one_step += out.stats.steps == 1
    assert two_from_one_step > samples / 10, two_from_one_step
    law = exact_two_token_law(target, SAMPLING_PROMPT, params)
    assert fit_pvalue(counts, law, samples) > P_VALUE_FLOOR


def seeded_lookahead(target, **settings):
    """A lookahead drafter whose pool starts with the target's likeliest two-token paths after
    SAMPLING_PROMPT, so that the first step's draft is in play (the law tests look at two
    tokens)."""
    from selfspec.drafters.lookahead import LookaheadDrafter

    class SeededLookahead(LookaheadDrafter):
        def begin(self, setup) -> None:
            super().begin(setup)
            for gram in grams:
                self._pool.add(gram)

    device, vocab = target.embed_tokens.weight.device, target.config.vocab_size
    with torch.inference_mode():
        logits = target(torch.tensor([SAMPLING_PROMPT], device=device),
                        torch.arange(len(SAMPLING_PROMPT), device=device)).logits[0, -1]
    grams = [(SAMPLING_PROMPT[-1], a, (a * 7 + 1) % vocab) for a in logits.topk(3).indices.tolist()]
    return SeededLookahead(**settings)


def lookup_of_its_answer(target, **settings):
    """An n-gram drafter whose corpus holds the target's greedy answer to SAMPLING_PROMPT (so
    its drafts are in play after it; the context alone knows the rest)."""
    from selfspec import generate
    from selfspec.drafters import LookupCorpus, NgramDrafter

    greedy = generate(target, SAMPLING_PROMPT, max_new_tokens=4).tokens
    return NgramDrafter(corpus=LookupCorpus([SAMPLING_PROMPT + greedy, greedy + greedy]),
                        **settings)


def exact_two_token_law(target, prompt: list[int], params) -> dict:
    """The target model's exact law of its next two tokens after `prompt`, warped by params."""
    from selfspec.sampling import logits_to_probs

    device = target.embed_tokens.weight.device

    def law_after(ids):
        logits = target(torch.tensor([ids], device=device),
                        torch.arange(len(ids), device=device)).logits[0, -1]
        return logits_to_probs(logits, params).cpu()

    with torch.inference_mode():
        return joint_two_token_law(law_after(prompt), lambda t1: law_after(prompt + [t1]))


def committed_context(target, head, history: list[int]):
    """The DraftContext after a plain forward over history[:-1] (the root history[-1] not
    fed), with the target states `head.config.target_layers` asks for."""
    from selfspec.drafters import DraftContext
    from selfspec.drafters.base import TargetFeatures

    tokens = torch.tensor(history)
    with torch.no_grad():
        out = target(tokens[None, :-1], torch.arange(len(history) - 1),
                     return_hidden=head.config.target_layers)
    features = TargetFeatures(tokens[:-1], out.last_hidden[0], tuple(h[0] for h in out.hidden))
    return DraftContext(tokens, features)


def continuation_rows(continuations: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """{prompt tuple: new tokens} as rows padded with 0 [B, T] and their mask [B, T]."""
    rows = [list(prompt) + tokens for prompt, tokens in continuations.items()]
    length = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows]).bool()
    return tokens, mask


def adam_fit(loss, parameters, steps: int, lr: float = 1e-2):
    """`steps` AdamW steps on loss() (a LossOutput); returns the last step's output."""
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    for _ in range(steps):
        out = loss()
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return out


def fit_medusa_heads(target, continuations: dict, num_heads: int = 4, steps: int = 30):
    """Medusa heads fit (AdamW, full batch) to the target's own greedy continuations, given as
    {prompt tuple: new tokens}; returns (heads in eval mode, the last step's metrics)."""
    from selfspec.heads import MedusaConfig, MedusaHeads
    from selfspec.heads.medusa import medusa_loss

    tokens, mask = continuation_rows(continuations)
    with torch.no_grad():
        hidden = target(tokens, torch.arange(tokens.shape[1])).last_hidden  # [B, T, H]
    torch.manual_seed(0)
    config = target.config
    heads = MedusaHeads(MedusaConfig(config.hidden_size, config.vocab_size, num_heads=num_heads))
    heads.init_from_lm_head(target.lm_head.weight)
    out = adam_fit(lambda: medusa_loss(heads(hidden), tokens, mask), heads.parameters(), steps)
    return heads.eval(), out.metrics


def fit_eagle_head(target, continuations: dict, version: int = 1, steps: int = 60, **config):
    """An EAGLE head fit (AdamW, full batch) to the target's own greedy continuations, given as
    {prompt tuple: new tokens}; EAGLE-3 heads (version 3) get their draft vocabulary from those
    rows and train with a 3-step training-time test. Returns (head in eval mode, metrics)."""
    from selfspec.from_config.methods.eagle import Eagle3Objective, EagleObjective
    from selfspec.heads import EagleConfig, EagleHead, draft_vocabulary

    tokens, mask = continuation_rows(continuations)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target.config, version, **config))
    if version == 3:
        vocab = draft_vocabulary(tokens, target.config.vocab_size, head.config.draft_vocab_size,
                                 mask)
        head.set_draft_vocab(vocab).init_from_target(target)
        objective = Eagle3Objective(target, head, steps=3)
    else:
        objective = EagleObjective(target, head)
    out = adam_fit(lambda: objective(tokens, mask), head.parameters(), steps)
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


# A trainer run of a few steps whose loss must fall: logged every step, at full rate at once.
LEARNS = ("trainer.log_every=1", "optim.lr=1e-2", "optim.warmup_steps=0")


def assert_the_loss_falls(run_dir: Path, train_share: float, heldout_share: float | None = None
                          ) -> None:
    """A trainer's run learned: the mean of its last three logged training losses lies at least
    `train_share` (a fraction) below the mean of its first three (batches differ: one step's
    loss is noisy), and its last held-out loss at least `heldout_share` below the first
    evaluation's (the same rows each time)."""
    from selfspec.tracking import read_metrics

    records = read_metrics(run_dir)
    train = [r["loss"] for r in records if "loss" in r]
    assert len(train) >= 4 and sum(train[-3:]) < (1 - train_share) * sum(train[:3]), train
    if heldout_share is not None:
        heldout = [r["eval/loss"] for r in records if "eval/loss" in r]
        assert len(heldout) >= 2 and heldout[-1] < (1 - heldout_share) * heldout[0], heldout


def sweep_variant(cfg, label: str):
    """The sweep row of cfg named `label` (e.g. ngram/corpus/tree5), as its variant object."""
    from selfspec.from_config.sweeps import plan_sweep

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


# ---- tiny Hugging Face models of each family, and parity with them --------------------------


HF_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    attn_implementation="eager",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_model(name: str) -> torch.nn.Module:
    """A seeded tiny HF model (llama, llama3, mistral or qwen2) with weights large enough that
    logits are far from zero."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    models = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**HF_TINY)),
        "llama3": lambda: LlamaForCausalLM(
            LlamaConfig(
                **HF_TINY,
                num_key_value_heads=2,
                rope_scaling=LLAMA3_ROPE,
                head_dim=16,  # != hidden / heads; wavelengths 6 (kept), 20 (blended), 63+ (scaled)
                max_position_embeddings=256,
            )
        ),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**HF_TINY, num_key_value_heads=2)),
        "qwen2": lambda: Qwen2ForCausalLM(
            Qwen2Config(**HF_TINY, num_key_value_heads=2, tie_word_embeddings=True)
        ),
    }
    torch.manual_seed(0)
    model = models[name]().float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.2)
    return model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The HF model's float logits for `tokens`, all attended."""
    mask = torch.ones_like(tokens)
    return model(input_ids=tokens, attention_mask=mask).logits.float()


def assert_hf_parity(ours, hf: torch.nn.Module, seq_len: int) -> torch.Tensor:
    """Our model's logits equal the HF model's (1e-4) on random tokens; returns the tokens."""
    vocab, g = HF_TINY["vocab_size"], torch.Generator().manual_seed(1)
    tokens = torch.randint(vocab, (2, seq_len), generator=g)
    with torch.no_grad():
        logits = ours(tokens, torch.arange(seq_len)).logits
    expected = hf_logits(hf, tokens)
    assert expected.abs().max() > 1.0  # a meaningful comparison, not near-zero logits
    assert (logits - expected).abs().max() < 1e-4
    return tokens


# ---- heads with random or fitted weights ----------------------------------------------------


def random_medusa_heads(config, seed: int, std: float = 0.2):
    """Medusa heads with every weight random (blocks too, so the residual path is exercised)."""
    from selfspec.heads import MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, std)
    return heads.eval()


def reduced_medusa_heads(target, kept: list[int], num_heads: int = 4):
    """Fresh Medusa heads for the target that score only the token ids `kept`."""
    from selfspec.heads import MedusaConfig, MedusaHeads
    from selfspec.heads.draft_vocab import draft_vocabulary

    config = MedusaConfig(target.config.hidden_size, target.config.vocab_size,
                          num_heads=num_heads, draft_vocab_size=len(kept))
    vocab = draft_vocabulary(torch.tensor(kept), target.config.vocab_size, len(kept))
    return MedusaHeads(config).set_draft_vocab(vocab).init_from_lm_head(target.lm_head.weight)


EAGLE3_LAYERS = (0, 1, 2)  # EAGLE-3's fused streams on a 2-layer toy target


def eagle_head_config(target, version: int, **overrides):
    """The EAGLE-`version` head config for the target (EAGLE-3: 48 draft tokens, EAGLE3_LAYERS)."""
    from selfspec.heads import EagleConfig

    extra = {"draft_vocab_size": 48, "target_layers": EAGLE3_LAYERS} if version == 3 else {}
    return EagleConfig.for_target(target.config, version, **(extra | overrides))


def random_eagle_head(config, seed: int, std: float = 0.2):
    """An EAGLE head with every weight random (norms around 1) and, for EAGLE-3, a draft vocabulary
    of every other id first."""
    from selfspec.heads import EagleHead, draft_vocabulary

    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    if config.version == 3:
        vocab = config.vocab_size
        ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])
        head.set_draft_vocab(draft_vocabulary(ids[: config.draft_vocab_size], config.vocab_size,
                                              config.draft_vocab_size))
    return head.eval()


def dflash_head_config(target, **overrides):
    """A DFlash head config for the target: one layer, blocks of 5, the last id as the mask,
    the streams 0, 1 and 2 (the toy target has two layers)."""
    from selfspec.heads import DFlashConfig

    options = {"mask_token_id": target.config.vocab_size - 1, "block_size": 5,
               "target_layers": (0, 1, 2)} | overrides
    return DFlashConfig.for_target(target.config, **options)


def random_dflash_head(config, seed: int, std: float = 0.2):
    """A DFlash head with every weight random (norms around 1) and, with a draft vocabulary,
    every other id first."""
    from selfspec.heads import DFlashHead, draft_vocabulary

    torch.manual_seed(seed)
    head = DFlashHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    if config.draft_vocab_size is not None:
        vocab = config.vocab_size
        ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])
        head.set_draft_vocab(draft_vocabulary(ids[: config.draft_vocab_size], vocab,
                                              config.draft_vocab_size))
    return head.eval()


def fit_dflash_head(target, continuations: dict, steps: int = 60, anchors: int = 16, **config):
    """A DFlash head fit (AdamW, full batch, cross-entropy) to the target's own greedy
    continuations, given as {prompt tuple: new tokens}. Returns (head in eval mode, metrics)."""
    from selfspec.from_config.methods.dflash import DFlashObjective
    from selfspec.heads import DFlashHead

    tokens, mask = continuation_rows(continuations)
    torch.manual_seed(0)
    head = DFlashHead(dflash_head_config(target, **config)).init_from_target(target)
    objective = DFlashObjective(target, head, anchors=anchors)
    out = adam_fit(lambda: objective(tokens, mask), head.parameters(), steps)
    return head.eval(), out.metrics


def random_exit(target, exit_layer: int, kind: str, seed: int = 1, std: float = 0.2):
    """An exit with every weight random (norms around 1); the norm exit has none."""
    from selfspec.heads import ExitConfig, ExitHead

    torch.manual_seed(seed)
    head = ExitHead(ExitConfig.for_target(target.config, exit_layer, kind))
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
    return head.eval()


def fit_exits(target, continuations: dict, layers=(1, 2, 3), steps: int = 40):
    """Adapter exits at `layers` fit together (AdamW, full batch) to the target's own greedy
    continuations; returns ({E: head in eval mode}, the last step's metrics)."""
    from selfspec.from_config.methods.early_exit import EarlyExitObjective
    from selfspec.heads import ExitConfig, ExitHead

    tokens, mask = continuation_rows(continuations)
    torch.manual_seed(0)
    heads = [ExitHead(ExitConfig.for_target(target.config, e)).init_from_target(target)
             for e in layers]
    objective = EarlyExitObjective(target, heads)
    out = adam_fit(lambda: objective(tokens, mask), objective.heads.parameters(), steps)
    return {head.exit_layer: head.eval() for head in heads}, out.metrics


# ---- Medusa-2: LoRA adapters on the toy target ----------------------------------------------


def perturbed_lora(model, seed: int = 0, std: float = 0.05):
    """Random adapter B matrices (fresh ones are zero), so the adapted target differs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)
    return model


def medusa2_objective(seed: int = 1):
    """A Medusa-2 objective: 2 fresh heads and rank-4 adapters on the toy target."""
    from selfspec import Transformer
    from selfspec.from_config.methods.medusa import Medusa2Objective
    from selfspec.heads import MedusaConfig, MedusaHeads
    from selfspec.model.lora import LoraSettings, add_lora

    base = Transformer.from_hf(tiny_llama(0))
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(32, 64, num_heads=2)).init_from_lm_head(base.lm_head.weight)
    return Medusa2Objective(add_lora(base, LoraSettings(rank=4)), heads)


# ---- a tree drafter and the sampled law of decoding through a drafter -----------------------


class TopRankTreeDrafter:
    """Test drafter for tree verification: node i is the choices[i][-1]-th most likely token of
    a draft model after the node's path (one uncached forward per node: fine at this size)."""

    target_layers = ()

    def __init__(self, model, paths: list[list[int]]):
        from selfspec import Tree

        self.model, self.tree = model, Tree.from_paths(paths)
        self.max_nodes = self.tree.num_nodes

    def begin(self, setup) -> None:
        pass

    @torch.inference_mode()
    def propose(self, context):
        from selfspec.drafters import Draft

        tokens: list[int] = []
        for node, parent in enumerate(self.tree.parents):
            path = [tokens[i] for i in self.tree.path_to(parent)] if parent >= 0 else []
            ids = context.tokens.tolist() + path
            logits = self.model(torch.tensor([ids]), torch.arange(len(ids))).logits[0, -1]
            order = torch.sort(logits, descending=True, stable=True).indices
            tokens.append(int(order[self.tree.choices[node][-1]]))
        return Draft(self.tree, torch.tensor(tokens))


def sampled_pvalue(target, drafter, params, samples: int = 1500) -> float:
    """Fit of the first two sampled tokens to the target's exact law (`samples` runs)."""
    from selfspec import generate

    prompt = [2, 3, 4, 2, 3, 4, 2, 3]
    g = torch.Generator().manual_seed(0)
    counts, accepted = Counter(), 0
    for _ in range(samples):
        out = generate(
            target, prompt, drafter=drafter, sampling=params, max_new_tokens=2, generator=g
        )
        counts[tuple(out.tokens)] += 1
        accepted += out.stats.accepted
    assert accepted > samples / 10  # the drafter's tokens were really in play
    return fit_pvalue(counts, exact_two_token_law(target, prompt, params), samples)


# ---- data and models for the trainers -------------------------------------------------------


def sharegpt_file(folder: Path) -> Path:
    """Toy chat data: the loss must fall on the assistant's code only."""
    records = [
        {"conversations": [
            {"from": "human", "value": f"Write a function that adds {i}."},
            {"from": "gpt", "value": f"def add_{i}(x):\n    return x + {i}\n"},
        ]}
        for i in range(60)
    ]
    path = folder / "chat.json"
    path.write_text(json.dumps(records))
    return path


def three_layer_target(quick_build: Path, folder: Path) -> Path:
    """A random 3-layer Llama with the toy tokenizer (the toy target has one layer: no E)."""
    return family_target(quick_build, folder, "llama", layers=3)


def family_target(quick_build: Path, folder: Path, family: str, layers: int = 4) -> Path:
    """A random model of a family (`tiny_model`) with the toy tokenizer, saved as a folder."""
    vocab = json.loads((quick_build / "target" / "config.json").read_text())["vocab_size"]
    model = tiny_model(family, 0, vocab=vocab, layers=layers)
    model.config.max_position_embeddings = 2048  # room for HumanEval prompts
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (quick_build / "target" / name).is_file():
            shutil.copy(quick_build / "target" / name, folder / name)
    return folder


# ---- the conf/ tree and a small model folder ------------------------------------------------


def group_options(group: str) -> list[str]:
    """The option names of a conf/ config group."""
    from selfspec.from_config.common import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# A 2-layer model small enough to save and load in milliseconds.
SMALL_ARCH = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2}
SMALL_OVERRIDES = [f"model.arch.{k}={v}" for k, v in SMALL_ARCH.items()]


# ---- published head folders, built from the published facts ---------------------------------


# The toy target they are built for: 8 layers, so EAGLE-3's defaults are (2, 4, 5).
PUBLISHED_H, PUBLISHED_V, PUBLISHED_LAYERS = 32, 64, 8
FP16 = torch.float16
PUBLISHED_DRAFT_V = 24  # an EAGLE-3 head's draft tokens
PUBLISHED_PROMPTS = [[3, 9, 4, 17, 5], [8, 8, 8, 2, 40, 41, 42, 8, 8]]
PUBLISHED_CHAIN = [[0], [0, 0], [0, 0, 0]]


def assert_lossless(target, plain, make_drafter):
    """Greedy decoding through make_drafter() equals `plain` ({prompt: tokens}) and drafts."""
    from selfspec import generate

    for prompt, expected in plain.items():
        result = generate(target, list(prompt), drafter=make_drafter(), max_new_tokens=20)
        assert result.tokens == expected
        assert result.stats.drafted > 0


def rand(*shape, seed, dtype=FP16, std=0.2):
    """Seeded random weights of `shape`, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def same_state(a: dict, b: dict) -> None:
    """The two state dicts hold the same tensors, bit for bit and dtype for dtype."""
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def medusa_reference_folder(folder, *, heads=3, layers=1, lm_head=True, stated_heads=None,
                            base="org/toy-target", suffix=".pt"):
    """A reference Medusa folder: one ResBlock per head under every {i}.{j} (one module applied
    num_layers times), then the LM head {i}.{num_layers}.weight."""
    state = {}
    for i in range(heads):
        w, b = rand(PUBLISHED_H, PUBLISHED_H, seed=10 + i), rand(PUBLISHED_H, seed=20 + i)
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"] = w, b
        if lm_head:
            state[f"{i}.{layers}.weight"] = rand(PUBLISHED_V, PUBLISHED_H, seed=30 + i, std=1.0)
    folder.mkdir()
    if suffix == ".pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file({k: v.clone() for k, v in state.items()},
                  str(folder / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": stated_heads or heads, "medusa_num_layers": layers,
              "base_model_name_or_path": base}
    if not lm_head:
        config["version"] = "2"
    (folder / "config.json").write_text(json.dumps(config))
    return state


def trained_like_medusa(config, seed: int = 1):
    """Medusa heads of `config` with every weight random, as trained ones are."""
    from selfspec.heads import MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads.eval()


def llama_head_config(**extra) -> dict:
    """The config.json of a published one-layer Llama head (EAGLE), with `extra` keys."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": PUBLISHED_H, "intermediate_size": 48, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": PUBLISHED_V,
            "torch_dtype": "float16", **extra}


def layer_state(prefix: str, attn_in: int, seed: int) -> dict:
    """A published head's decoder layer under `prefix`, its attention reading `attn_in`."""
    h, kv = PUBLISHED_H, 2 * (PUBLISHED_H // 4)
    shapes = {"self_attn.q_proj.weight": (h, attn_in), "self_attn.k_proj.weight": (kv, attn_in),
              "self_attn.v_proj.weight": (kv, attn_in), "self_attn.o_proj.weight": (h, h),
              "mlp.gate_proj.weight": (48, h), "mlp.up_proj.weight": (48, h),
              "mlp.down_proj.weight": (h, 48)}
    state = {f"{prefix}.{k}": rand(*s, seed=seed + n) for n, (k, s) in enumerate(shapes.items())}
    state[f"{prefix}.post_attention_layernorm.weight"] = (1 + rand(h, seed=seed + 50)).to(FP16)
    return state


def eagle1_folder(folder, *, bias=True, target=None):
    """A published EAGLE-1 folder; returns its state without the embedding copy."""
    h = PUBLISHED_H
    state = {"fc.weight": rand(h, 2 * h, seed=1), **layer_state("layers.0", h, 100)}
    if bias:
        state["fc.bias"] = rand(h, seed=2)
    if target is not None:  # released heads may carry a copy of the target's embedding
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(FP16)
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(llama_head_config(bias=bias)))
    return {k: v for k, v in state.items() if k != "embed_tokens.weight"}


def eagle3_folder(folder, config_extra=None):
    """A published EAGLE-3 folder whose draft vocabulary is every other target token."""
    h, draft_v = PUBLISHED_H, PUBLISHED_DRAFT_V
    ids = torch.arange(0, 2 * draft_v, 2)  # every other target token
    t2d = torch.zeros(PUBLISHED_V, dtype=torch.bool)
    t2d[ids] = True
    state = {"fc.weight": rand(h, 3 * h, seed=3), **layer_state("midlayer", 2 * h, 200),
             "midlayer.hidden_norm.weight": (1 + rand(h, seed=4)).to(FP16),
             "midlayer.input_layernorm.weight": (1 + rand(h, seed=5)).to(FP16),
             "norm.weight": (1 + rand(h, seed=6)).to(FP16),
             "lm_head.weight": rand(draft_v, h, seed=7, std=1.0),
             "d2t": ids - torch.arange(draft_v), "t2d": t2d}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    config = llama_head_config(architectures=["LlamaForCausalLMEagle3"],
                               draft_vocab_size=PUBLISHED_DRAFT_V, target_hidden_size=PUBLISHED_H,
                               **(config_extra or {}))
    (folder / "config.json").write_text(json.dumps(config))
    return state


def host_reads_per_step(target, make, prompt, sampling=None) -> float:
    """Host reads a decode step makes (`selfspec.devices.HostReads`), make() giving the drafter
    (None: plain decoding) under static steps: two generations of different lengths,
    differenced, so that what a generation reads once (its prompt's checks) drops out.
    sampling: a SamplingParams (default greedy), drawn from a seeded generator."""
    from selfspec import SamplingParams, generate
    from selfspec.devices import HostReads

    counts, sampling = [], sampling or SamplingParams()
    device = target.embed_tokens.weight.device
    for new_tokens in (12, 24):
        drafter = make()
        options = {"drafter": drafter, "max_new_tokens": new_tokens, "cuda_graphs": True,
                   "sampling": sampling}
        generate(target, prompt, generator=torch.Generator(device=device).manual_seed(0),
                 **options)  # set up: shapes checked, graphs captured on CUDA
        with HostReads() as reads:
            result = generate(target, prompt,
                              generator=torch.Generator(device=device).manual_seed(0),
                              **options)
        counts.append((reads.count, result.stats.loop_steps))
    (reads_short, steps_short), (reads_long, steps_long) = counts
    assert steps_long > steps_short
    return (reads_long - reads_short) / (steps_long - steps_short)


def train_and_heldout_store(target, folder: Path, layers, train_rows: int = 6,
                            heldout_rows: int = 2, length: int = 12):
    """A finished fp32 feature store of `target` with shards of random training rows and
    held-out rows (`train-*`, `heldout-*`, as train/store.py writes them); the first three
    tokens of each row are unsupervised."""
    from selfspec.training.features import FeatureStore, StoreWriter, build_store, store_spec
    from selfspec.training.rows import TokenRows

    n = train_rows + heldout_rows
    tokens = torch.randint(2, target.config.vocab_size, (n, length),
                           generator=torch.Generator().manual_seed(5))
    rows = TokenRows(tokens, (torch.arange(length) >= 3).long().expand(n, length).clone())
    writer = StoreWriter(folder, store_spec(target, layers, "fp32", "rows"))
    names = [*build_store(target, rows.select(torch.arange(train_rows)), writer, prefix="train",
                          rows_per_shard=4, progress=False),
             *build_store(target, rows.select(torch.arange(train_rows, n)), writer,
                          prefix="heldout", progress=False)]
    assert writer.finish(names) is not None
    return FeatureStore(folder), rows
