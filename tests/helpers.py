"""Shared test helpers: a goodness-of-fit check for statistical exactness tests."""

from __future__ import annotations

from collections import Counter

import torch
from scipy.stats import chi2

P_VALUE_FLOOR = 1e-3  # a fixed seed makes each test deterministic; this bounds its false alarms


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
