"""MTP targets for the tests, and the MTP forwards re-expressed in plain torch from vLLM's
`deepseek_mtp.py` (DeepSeek-V3's NextN layers), `qwen3_next_mtp.py` (Qwen3-Next's `mtp.*`) and
`mimo_mtp.py` (MiMo's `model.mtp_layers.*`), reading the checkpoint's tensors under their own
names: what selfspec's `MtpModule`, `mtp_forward` and `mtp_logits` are checked against.

The decoder layer inside is written out for the families the tests use (Llama, Qwen2's q/k/v
biases, Qwen3's per-head q/k norms, and Qwen3-Next's full-attention layer, which its MTP
module is: (1 + w) norms, an output gate per head from q_proj, partial RoPE): pre-norms,
default RoPE, causal grouped attention, SwiGLU; no cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]


def mtp_target(layout: str, seed: int = 0, *, family: str | None = None, modules: int = 1,
               vocab: int = 64, hidden: int = 32, layers: int = 2, std: float = 0.2, **arch):
    """A small target with `modules` MTP modules of `layout` ("nextn": a Llama; "mtp": a
    Qwen3; "mimo": a Qwen2; modules=0: none), every weight but the norms' normal of std
    `std` (peaky laws), seeded."""
    from selfspec.model import ModelConfig, Transformer

    family = family or {"mtp": "qwen3", "mimo": "qwen2"}.get(layout, "llama")
    config = ModelConfig.of_family(
        model_type=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
        mtp_modules=modules, mtp_layout=layout if modules else None, **arch)
    generator = torch.Generator().manual_seed(seed)
    target = Transformer(config)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:  # norms near their identity, yet not it: a wrong norm is seen
                identity = 0.0 if config.norm_scale == "one_plus_weight" else 1.0
                param.copy_(identity + 0.1 * torch.randn(param.shape, generator=generator))
    return target.eval()


# ---- the reference --------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centred: bool = False
             ) -> torch.Tensor:
    """centred: the weight is stored around 0 and scales by (1 + w) (Qwen3-Next's norms)."""
    x = x.float()
    return (1 + weight if centred else weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                  + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, share: float = 1.0
         ) -> torch.Tensor:
    """x [T, heads, D] rotated by the default RoPE (halves rotated) at positions [T]: its first
    `share` of each head's dimensions, the rest as they are."""
    rotary = int(x.shape[-1] * share)
    if rotary < x.shape[-1]:
        return torch.cat([rope(x[..., :rotary], positions, theta), x[..., rotary:]], dim=-1)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (positions[:, None].double() * inv[None]).float()  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    first, second = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


def project(a: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    """a times the weight `name`.weight, plus its bias where the checkpoint has one."""
    out = a @ w[name + ".weight"].T
    return out + w[name + ".bias"] if name + ".bias" in w else out


def decoder_layer(w: Weights, prefix: str, x: torch.Tensor, positions: torch.Tensor, config
                  ) -> torch.Tensor:
    """One pre-norm decoder layer over x [T, h], causal, its weights at `prefix`."""
    t, heads, kv, d = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    eps, centred = config.rms_norm_eps, config.norm_scale == "one_plus_weight"

    def norm(y, name):
        return rms_norm(y, w[prefix + name], eps, centred)

    a = norm(x, "input_layernorm.weight")
    q = project(a, w, prefix + "self_attn.q_proj")
    gate = None
    if config.attention_output_gate:  # each head's queries, then its gate
        q, gate = q.view(t, heads, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(t, heads * d)
    q = q.reshape(t, heads, d)
    k = project(a, w, prefix + "self_attn.k_proj").view(t, kv, d)
    v = project(a, w, prefix + "self_attn.v_proj").view(t, kv, d)
    if config.qk_norm == "head":
        q, k = norm(q, "self_attn.q_norm.weight"), norm(k, "self_attn.k_norm.weight")
    share = config.partial_rotary_factor
    q, k = rope(q, positions, config.rope_theta, share), rope(k, positions, config.rope_theta,
                                                                share)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    attended = torch.einsum("hts,shd->thd", weights, v).reshape(t, heads * d)
    if gate is not None:
        attended = attended * torch.sigmoid(gate)
    x = x + attended @ w[prefix + "self_attn.o_proj.weight"].T
    m = norm(x, "post_attention_layernorm.weight")
    gate, up = m @ w[prefix + "mlp.gate_proj.weight"].T, m @ w[prefix + "mlp.up_proj.weight"].T
    return x + (F.silu(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


def nextn_forward(w: Weights, config, index: int, next_tokens: torch.Tensor,
                  hidden: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's NextN layer `index` (checkpoint layer num_layers + index): tokens t+1 [T]
    and hidden states [T, h] at positions [T] -> (the state handed to the next step, logits).
    The embedding is the copy the first NextN layer holds; position 0's is zeroed; the output
    is handed on un-normed and scored through shared_head's norm and head."""
    eps, first = config.rms_norm_eps, config.num_layers
    prefix = f"model.layers.{first + index}."
    embeds = w[f"model.layers.{first}.embed_tokens.weight"][next_tokens].clone()
    embeds[positions == 0] = 0
    both = torch.cat([rms_norm(embeds, w[prefix + "enorm.weight"], eps),
                      rms_norm(hidden, w[prefix + "hnorm.weight"], eps)], dim=-1)
    out = decoder_layer(w, prefix, both @ w[prefix + "eh_proj.weight"].T, positions, config)
    logits = rms_norm(out, w[prefix + "shared_head.norm.weight"], eps) \
        @ w[prefix + "shared_head.head.weight"].T
    return out, logits


def qwen_mtp_forward(w: Weights, config, next_tokens: torch.Tensor, hidden: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's `mtp` module: the target's embedding, pre-fc norms of the embedding and the
    hidden state (in that order in the concatenation), fc, layer 0, and `mtp.norm`, whose
    output is both handed on and scored by the target's LM head."""
    eps, centred = config.rms_norm_eps, config.norm_scale == "one_plus_weight"
    embeds = w["model.embed_tokens.weight"][next_tokens]
    both = torch.cat([rms_norm(embeds, w["mtp.pre_fc_norm_embedding.weight"], eps, centred),
                      rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps, centred)], dim=-1)
    x = decoder_layer(w, "mtp.layers.0.", both @ w["mtp.fc.weight"].T, positions, config)
    out = rms_norm(x, w["mtp.norm.weight"], eps, centred)
    return out, out @ w["lm_head.weight"].T


def mimo_forward(w: Weights, config, index: int, next_tokens: torch.Tensor,
                 hidden: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """MiMo's module `index` (`model.mtp_layers.{index}.*`): the target's embedding, position
    0's zeroed, the normed hidden state first in the concatenation (token_layernorm,
    hidden_layernorm, input_proj), the block, and final_layernorm, whose output is both
    handed on and scored by the target's LM head."""
    eps, prefix = config.rms_norm_eps, f"model.mtp_layers.{index}."
    embeds = w["model.embed_tokens.weight"][next_tokens].clone()
    embeds[positions == 0] = 0
    both = torch.cat([rms_norm(hidden, w[prefix + "hidden_layernorm.weight"], eps),
                      rms_norm(embeds, w[prefix + "token_layernorm.weight"], eps)], dim=-1)
    x = decoder_layer(w, prefix, both @ w[prefix + "input_proj.weight"].T, positions, config)
    out = rms_norm(x, w[prefix + "final_layernorm.weight"], eps)
    return out, out @ w["lm_head.weight"].T


# A tiny Qwen3-Next: three Gated DeltaNet layers, then a gated full-attention layer
QWEN3_NEXT = {"family": "qwen3_next", "layers": 4, "partial_rotary_factor": 0.25,
              "layer_types": ("linear_attention",) * 3 + ("full_attention",),
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
              "linear_value_head_dim": 6}
