"""The architecture of a decoder-only model, read from a Hugging Face config.json and written
back to one. Every difference between the families selfspec reads is a field here, and the one
decoder (`selfspec.model.transformer`) honours each of them; no family has a model file.

- llama, mistral: the base (pre-norms, SwiGLU, RoPE default, linear, llama3 or yarn);
  Mistral's window covers every layer.
- qwen2: q/k/v bias without an o bias.
- qwen3: per-head RMSNorm on q and k (`qk_norm="head"`), `head_dim` apart from
  hidden / heads.
- gemma3_text: `(1 + w)` norms, four norms a layer (`post_norms`), the embedding scaled by
  sqrt(hidden), GELU-tanh gates, q/k norms, `layer_types` of sliding and full attention with
  a RoPE each, `attention_scale` from `query_pre_attn_scalar`, tied embeddings.
- gemma2: Gemma 3 without q/k norms and with one RoPE, plus attention and final logit
  soft-capping.
- gemma4_text: Gemma 3's layer with plain `w` norms (in fp32), a softmax scale of 1 (the q/k
  norms set it), values RMS-normed without a weight (`v_norm`), a learned scalar on each
  layer's output (`layer_scalars`), the full layers' proportional RoPE (a share of each head's
  frequency pairs rotated, the rest left) over heads of their own width with keys doubling
  as values and K/V heads of their own (`full_head_dim`, `value_from_key`, `full_kv_heads`:
  transformers' `global_head_dim`, `attention_k_eq_v`, `num_global_key_value_heads`), final
  logit soft-capping.
- olmo2: no pre-norms (norms after attention and MLP), q/k norm over the whole projection.
- granite: embedding, residual, attention and logit multipliers.
- phi3: fused `qkv_proj` and `gate_up_proj` in the checkpoint, `longrope`,
  `partial_rotary_factor`.
- mixtral: Mistral with a mixture of experts in every layer (top-k softmax routing).
- qwen3_moe: Qwen3 with experts of their own width, routing renormalised over the top k
  only when `norm_topk_prob`, dense layers among the sparse ones (`decoder_sparse_step`,
  `mlp_only_layers`), one window for every layer when `use_sliding_window`.
- gpt_oss: attention sinks and biases, sliding layers alternating with full ones, YaRN,
  a router with a bias, experts with biases and the clamped gated activation.
- qwen3_next: a hybrid: Gated DeltaNet linear-attention layers (`layer_types`'
  "linear_attention", `selfspec.model.recurrent`, their widths the `linear_*` fields) among
  full-attention layers whose output is gated (`attention_output_gate`), `(1 + w)` norms,
  per-head q/k norms, partial RoPE; dense MLPs or Qwen3-MoE's mixture of experts with a
  shared expert beside the routed ones (`shared_expert_intermediate_size`).
- bamba: a Mamba-2 hybrid (IBM's Bamba): Mamba-2 layers (`recurrent_mixer="mamba2"`,
  `selfspec.model.mamba`, their widths the `mamba_*` fields) with Llama-style attention
  layers among them (config.json's `attn_layer_indices`), half of each head rotated.
- qwen3_5_text: Qwen3.5's decoder, Qwen3-Next's layers with the linear attention's input
  products split four ways (`linear_split_projections`) and dense MLPs; its multimodal RoPE
  is the plain one over text.
- llama4_text: Llama 4's decoder: RoPE over adjacent pairs on most layers, chunked local
  attention there (`attention_chunk_size`), every fourth layer without RoPE (`no_rope_layers`)
  and full, its queries' temperature tuned by position there, an L2 norm of q and k on the
  RoPE layers (`qk_norm="l2"`), a mixture of experts whose sigmoid weights scale each expert's
  input (`router_scoring="sigmoid_input"`) beside an ungated shared expert, dense layers
  among the sparse ones (`interleave_moe_layer_step`, `moe_layers`).
- deepseek_v3: multi-head latent attention (MLA: `kv_lora_rank` > 0, a compressed latent and
  one roped key cached per token, `selfspec.model.mla`), interleaved RoPE, a mixture of
  experts with sigmoid routing over groups (`router_scoring`, `router_groups`), a routed
  scaling factor and ungated shared experts, its first layers dense.

Multi-token prediction (MTP) modules after the last layer are configuration too
(`mtp_modules`, `mtp_layout`): DeepSeek-V3's NextN layers (config.json's
`num_nextn_predict_layers`; GLM-4.5 ships the same layout, MiMo its own under the same key,
told apart by the checkpoint's names) or Qwen3-Next's and Qwen3.5's `mtp.*`
(`mtp_num_hidden_layers`); `selfspec.model.transformer.MtpModule` builds them and
`selfspec.model.checkpoint` maps each layout's names.

The mixture of experts (`selfspec.model.moe`) replaces a layer's MLP in the layers of
`moe_layers`: num_experts experts of expert_intermediate_size, num_experts_per_tok of them
per token.

Fields a family's config.json does not carry (its class implies them: Gemma's norms, Qwen3's
q/k norms) come from `FAMILIES`; `to_hf` refuses a config its model_type cannot express.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from selfspec.checks import is_count

# What each family's class implies beyond what its config.json says (every other field is
# read from config.json). Keys are ModelConfig fields.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": "head"},
    "gemma3_text": {"norm_scale": "one_plus_weight", "post_norms": True, "qk_norm": "head"},
    "gemma2": {"norm_scale": "one_plus_weight", "post_norms": True},
    "gemma4_text": {"norm_scale": "weight_fp32", "post_norms": True, "qk_norm": "head",
                    "v_norm": True, "layer_scalars": True},
    "olmo2": {"norm_scale": "weight_fp32", "pre_norms": False, "post_norms": True,
              "qk_norm": "projection"},
    "granite": {},
    "phi3": {},
    "mixtral": {},
    "qwen3_moe": {"qk_norm": "head"},
    "gpt_oss": {"norm_scale": "weight_fp32", "router_bias": True, "expert_bias": True,
                "expert_act": "clamped_swiglu", "attention_sinks": True},
    "qwen3_next": {"norm_scale": "one_plus_weight", "qk_norm": "head",
                   "attention_output_gate": True},
    "qwen3_5_text": {"norm_scale": "one_plus_weight", "qk_norm": "head",
                     "attention_output_gate": True, "linear_split_projections": True},
    "bamba": {"recurrent_mixer": "mamba2"},
    "deepseek_v3": {"router_scoring": "sigmoid", "shared_expert_gate": False},
    "llama4_text": {"router_scoring": "sigmoid_input", "shared_expert_gate": False,
                    "rope_interleave": True},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma4_text": "Gemma4ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                 "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "bamba": "BambaForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "llama4_text": "Llama4ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
NORM_SCALES = ("weight", "weight_fp32", "one_plus_weight")
QK_NORMS = (None, "head", "projection", "l2")
# DeepSeek-V3's NextN layers after the last decoder layer, Qwen3-Next's `mtp.*` modules, or
# MiMo's `model.mtp_layers.*`
MTP_LAYOUTS = ("nextn", "mtp", "mimo")
# config.json's count of each layout's modules (MiMo's is NextN's key: the names tell them apart)
_MTP_KEYS = {"nextn": "num_nextn_predict_layers", "mtp": "mtp_num_hidden_layers",
             "mimo": "num_nextn_predict_layers"}
EXPERT_ACTS = ("silu", "clamped_swiglu")  # SwiGLU, or gpt-oss's clamped gate times (up + 1)
# the router's scores: Mixtral's, DeepSeek-V3's, Llama 4's (its weights scale the input)
ROUTER_SCORINGS = ("softmax", "sigmoid", "sigmoid_input")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "chunked_attention")
# The widths of the Gated DeltaNet layers, as config.json names them (our fields: the same)
# image-text models whose text decoder is read alone (the vision tower's weights are not kept)
IMAGE_TEXT = {"qwen3_5": "qwen3_5_text"}
HYBRID = ("qwen3_next", "qwen3_5_text", "bamba")  # families with recurrent layers
RECURRENT_MIXERS = ("gated_deltanet", "mamba2")
# Mamba-2's widths, as config.json names them (our fields: the same)
MAMBA_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
              "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias")
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim")
GEMMA4 = "gemma4_text"
GEMMA = ("gemma3_text", "gemma2", GEMMA4)  # their embedding is scaled by sqrt(hidden)
LOCAL_ROPE = ("gemma3_text", GEMMA4)  # a RoPE of their own for the sliding layers
WHOLE_WINDOW = ("mistral", "phi3", "mixtral", "qwen3_moe")  # one window for every layer
WINDOWED = (*GEMMA, *WHOLE_WINDOW, "qwen2", "qwen3", "gpt_oss")  # they read sliding_window
# the families with a mixture of experts
MOE = ("mixtral", "qwen3_moe", "gpt_oss", "qwen3_next", "deepseek_v3", "llama4_text")
QWEN_MOE = ("qwen3_moe", "qwen3_next")  # Qwen's keys: moe_intermediate_size, dense layers
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
# transformers' windows where config.json has no sliding_window key
_DEFAULT_WINDOWS = {"gemma3_text": 4096, "gemma2": 4096, "mistral": 4096, "qwen3_moe": 4096,
                    "gpt_oss": 128, GEMMA4: 512}
# gpt-oss's class's RoPE where config.json has none
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
_ROPE_KEYS = {  # what each RoPE scaling type needs (the optional keys are kept when given)
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast",
                           "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("factor", "attention_factor")),
    # Gemma 4's full layers: the first partial_rotary_factor of each head's frequency pairs
    # rotate (over the whole head_dim's spectrum), the others stay still
    "proportional": (("partial_rotary_factor",), ("factor",)),
}


def unsupported_model_type(model_type: Any) -> str:
    return (f"unsupported model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters (names follow ours; `from_hf` maps HF's config.json).

    rope_scaling: None or {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...}.
    attention_bias: bias on q/k/v (Qwen2; Llama when its config says so).
    attention_out_bias: bias on o_proj (Llama's attention_bias covers it; Qwen2 has none).
    hidden_act: the MLP's gate activation, "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma).
    norm_scale: how an RMSNorm scales: "weight" (w times the normalised input cast back to its
        dtype: Llama), "weight_fp32" (w times it in fp32, then cast: OLMo 2) or
        "one_plus_weight" ((1 + w) in fp32: Gemma, whose norm weights are stored around 0).
    pre_norms: a norm before attention (`input_layernorm`) and before the MLP.
    post_norms: a norm on the attention's and on the MLP's output before each residual add
        (Gemma with pre_norms: four norms a layer; OLMo 2 without).
    qk_norm: an RMSNorm on the queries and keys before RoPE: "head" (over each head's
        head_dim: Qwen3, Gemma 3), "projection" (over the whole q or k projection: OLMo 2),
        "l2" (over each head, without a weight, on the RoPE layers only: Llama 4).
    embedding_multiplier: the embedding is multiplied by it, rounded to the model's dtype
        (Gemma: sqrt(hidden_size); Granite: its embedding_multiplier).
    residual_multiplier: each block's output is multiplied by it before the residual add.
    attention_scale: the softmax scale (None: head_dim ** -0.5; Gemma:
        query_pre_attn_scalar ** -0.5; Granite: attention_multiplier).
    attn_logit_softcapping, final_logit_softcapping: scores s become cap * tanh(s / cap).
    logits_scaling: the logits are divided by it (Granite).
    sliding_window: the window W of the sliding layers: a query at position p sees keys at
        positions > p - W (and its tree ancestors among them).
    layer_types: one of LAYER_TYPES per layer (empty: every layer full, or every layer sliding
        when sliding_window is set, as Mistral's); "linear_attention" is a Gated DeltaNet
        layer (Qwen3-Next), whose state the cache keeps beside the K/V
        (`selfspec.model.recurrent_cache`).
    local_rope_theta, local_rope_scaling: the RoPE of the sliding layers where it differs from
        the full ones' (Gemma 3: base 10k locally, 1M globally).
    partial_rotary_factor: the share of each head's dimensions RoPE rotates (the first ones).
    attention_sinks: a learned logit per head in each softmax's denominator (gpt-oss).
    num_experts: experts per sparse layer (0: every layer dense); num_experts_per_tok: the
        top k each token is routed to.
    expert_intermediate_size: an expert's width (None: intermediate_size, which is the dense
        layers' width: Qwen3-MoE's differ).
    norm_topk_prob: the top k's weights are a softmax over their logits (renormalised over the
        top k: Mixtral, gpt-oss); False: their softmax over every expert (Qwen3-MoE without it).
    decoder_sparse_step, mlp_only_layers: layer i is sparse when (i + 1) % step == 0 and it
        is not one of mlp_only_layers (Qwen3-MoE).
    router_bias, expert_bias: a bias on the router's logits, on each expert's products
        (gpt-oss).
    expert_act: "silu" (SwiGLU) or "clamped_swiglu" (gpt-oss: the gate clamped above by
        swiglu_limit, the up by +-swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
    mtp_modules: multi-token-prediction modules after the last layer (0: none), each the
        norms of an embedding and of a hidden state, a projection of their concatenation, one
        decoder layer of the target's kind (`selfspec.model.transformer.MtpModule`).
    mtp_layout: their checkpoint layout, one of MTP_LAYOUTS (None without modules): "nextn"
        (DeepSeek-V3, GLM-4.5: `model.layers.{L + i}.*`, an own final norm and LM head each),
        "mtp" (Qwen3-Next, Qwen3.5: `mtp.*`, the target's LM head) or "mimo" (MiMo:
        `model.mtp_layers.{i}.*`, the target's LM head).
    attention_output_gate: q_proj also gives a gate per head and dimension; the attention's
        output is multiplied by its sigmoid before o_proj (Qwen3-Next).
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
        linear_conv_kernel_dim: the widths of the linear-attention layers (0 without them).
    linear_split_projections: their input products as Qwen3.5 lays them out (in_proj_qkv,
        in_proj_z, in_proj_b, in_proj_a) rather than Qwen3-Next's two grouped by key head.
    recurrent_mixer: what a "linear_attention" layer is, one of RECURRENT_MIXERS: Gated
        DeltaNet (Qwen3-Next, Qwen3.5) or Mamba-2 (Bamba).
    mamba_n_heads, mamba_d_head, mamba_n_groups, mamba_d_state, mamba_d_conv,
        mamba_conv_bias, mamba_proj_bias: a Mamba-2 layer's heads, head width, groups of B and
        C, state per head dimension, convolution kernel, and biases.
    shared_expert_intermediate_size: the width of a mixture of experts' shared expert, which
        every token runs beside its routed ones, gated by a sigmoid (Qwen3-Next; 0: none).
    shared_expert_gate: whether that sigmoid gate exists (DeepSeek-V3's shared experts,
        `n_shared_experts` of them side by side as one MLP, have none).
    router_scoring: "softmax" (the top k of the router's logits, as norm_topk_prob says) or
        "sigmoid" (DeepSeek-V3: experts chosen by their sigmoid plus a learned correction bias,
        among the router_top_groups best of router_groups groups, each group scored by its two
        best; weighted by their sigmoids, renormalised with norm_topk_prob, times
        routed_scaling_factor).
    kv_lora_rank: multi-head latent attention (MLA, DeepSeek-V2/V3) when > 0: keys and values
        are expanded from a latent of this rank, which the cache holds with one roped key of
        head_dim (DeepSeek's qk_rope_head_dim) per token; each head's query and key are
        qk_nope_head_dim unroped dimensions then head_dim roped ones, its value v_head_dim.
    q_lora_rank: the query's own low-rank compression (None: one q_proj).
    rope_interleave: RoPE rotates pairs of adjacent dimensions (DeepSeek's layout) rather than
        the two halves.
    attention_chunk_size: the chunk C of the "chunked_attention" layers (Llama 4): a query at
        position p sees the keys at positions k <= p with k // C == p // C.
    no_rope_layers: the layers without RoPE (Llama 4's NoPE layers, full attention).
    temperature_tuning, temperature_floor_scale, temperature_scale: on the NoPE layers, each
        query at position p is multiplied by 1 + scale * ln(1 + floor((p + 1) / floor_scale))
        (Llama 4's attn_temperature_tuning, floor_scale, attn_scale).
    v_norm: the values RMS-normed over each head's dims, without a weight (Gemma 4).
    value_from_key: the full-attention layers have no v_proj; their values are k_proj's
        output (before its norm and RoPE) (Gemma 4's attention_k_eq_v).
    layer_scalars: each layer's output is multiplied by a learned scalar, its `layer_scalar`
        (Gemma 4).
    full_head_dim, full_kv_heads: the full-attention layers' own head_dim and K/V heads where
        they differ from the sliding layers' (Gemma 4's global_head_dim and
        num_global_key_value_heads; None: the same). The cache holds every layer at the
        widest (`cache_dims`), a narrower layer's K/V padded with zeros there.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    norm_scale: str = "weight"
    pre_norms: bool = True
    post_norms: bool = False
    qk_norm: str | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    attention_sinks: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mtp_modules: int = 0
    mtp_layout: str | None = None
    attention_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_split_projections: bool = False
    recurrent_mixer: str = "gated_deltanet"
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    shared_expert_intermediate_size: int = 0
    v_norm: bool = False
    value_from_key: bool = False
    layer_scalars: bool = False
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    shared_expert_gate: bool = True
    router_scoring: str = "softmax"
    router_groups: int = 1
    router_top_groups: int = 1
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    attention_chunk_size: int | None = None
    no_rope_layers: tuple[int, ...] = ()
    temperature_tuning: bool = False
    temperature_floor_scale: int = 8192
    temperature_scale: float = 0.1

    def __repr__(self) -> str:
        """The dataclass's repr without the family fields that hold their defaults, so that a
        Llama, Mistral or Qwen2 config reads as it did before the families came (caches are
        keyed by it: `selfspec.model.fingerprint.weights_fingerprint`)."""
        shown = [f for f in fields(self) if f.name not in _FAMILY_FIELDS
                 or not _same(getattr(self, f.name), f.default)]
        values = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in shown)
        return f"{type(self).__qualname__}({values})"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(unsupported_model_type(self.model_type))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        for name, allowed in (("hidden_act", ACTIVATIONS), ("norm_scale", NORM_SCALES),
                              ("qk_norm", QK_NORMS), ("expert_act", EXPERT_ACTS),
                              ("router_scoring", ROUTER_SCORINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unsupported {name} {getattr(self, name)!r}; supported: "
                                 f"{', '.join(map(str, allowed))}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each "
                             f"of the {self.num_layers} layers, got {list(self.layer_types)}")
        if self.sliding_window is not None and not is_count(self.sliding_window):
            raise ValueError(f"sliding_window must be an integer >= 1 or None, got "
                             f"{self.sliding_window!r}")
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError("layer_types names sliding layers but sliding_window is not set")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor must rotate an even number of each head's "
                             f"{self.head_dim} dimensions, got {self.partial_rotary_factor}")
        if not self.pre_norms and not self.post_norms:
            raise ValueError("a decoder layer needs norms before (pre_norms) or after "
                             "(post_norms) its attention and MLP")
        self._check_experts()
        self._check_latent()
        self._check_chunks()
        self._check_mtp()
        self._check_linear()

    def _check_linear(self) -> None:
        if self.recurrent_mixer not in RECURRENT_MIXERS:
            raise ValueError(f"unsupported recurrent_mixer {self.recurrent_mixer!r}; supported: "
                             f"{', '.join(RECURRENT_MIXERS)}")
        mamba = self.recurrent_mixer == "mamba2"
        keys = MAMBA_KEYS[:5] if mamba else LINEAR_KEYS
        widths = [getattr(self, key) for key in keys]
        if self.linear_layers and not all(is_count(w) for w in widths):
            raise ValueError(f"{'Mamba-2' if mamba else 'linear-attention'} layers need "
                             f"{', '.join(keys)} as "
                             f"integers >= 1, got {widths}")

    def _check_mtp(self) -> None:
        if not is_count(self.mtp_modules, 0):
            raise ValueError(f"mtp_modules must be an integer >= 0, got {self.mtp_modules!r}")
        if (self.mtp_modules > 0) != (self.mtp_layout is not None) or \
                self.mtp_layout not in (None, *MTP_LAYOUTS):
            raise ValueError(f"mtp_layout must be one of {', '.join(MTP_LAYOUTS)} with "
                             f"mtp_modules >= 1, and null without them; got mtp_modules="
                             f"{self.mtp_modules!r}, mtp_layout={self.mtp_layout!r}")
        if self.mtp_layout == "mtp" and self.mtp_modules > 1:
            raise ValueError(f"an mtp layout's modules share one fc and norms: mtp_modules "
                             f"must be 1 there, got {self.mtp_modules}")

    def _check_chunks(self) -> None:
        object.__setattr__(self, "no_rope_layers", tuple(self.no_rope_layers))
        if self.chunked_layers and not is_count(self.attention_chunk_size):
            raise ValueError(f"chunked_attention layers need attention_chunk_size >= 1, got "
                             f"{self.attention_chunk_size!r}")
        if (self.chunked_layers | self.sliding_layers | self.linear_layers) & set(
                self.no_rope_layers):
            raise ValueError(f"no_rope_layers {list(self.no_rope_layers)} must be full "
                             f"attention layers")

    def _check_latent(self) -> None:
        if self.kv_lora_rank and not (is_count(self.qk_nope_head_dim, 0)
                                      and is_count(self.v_head_dim)):
            raise ValueError(f"latent attention (kv_lora_rank={self.kv_lora_rank}) needs "
                             f"qk_nope_head_dim >= 0 and v_head_dim >= 1, got "
                             f"{self.qk_nope_head_dim!r}, {self.v_head_dim!r}")
        if self.num_experts and (self.num_experts % self.router_groups
                                 or not 1 <= self.router_top_groups <= self.router_groups):
            raise ValueError(f"router_groups ({self.router_groups}) must divide num_experts "
                             f"({self.num_experts}) and router_top_groups must be in "
                             f"1..router_groups, got {self.router_top_groups}")

    def _check_experts(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok
                                    <= self.num_experts):
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts "
                             f"({self.num_experts}), got {self.num_experts_per_tok}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got "
                             f"{self.decoder_sparse_step}")

    @classmethod
    def of_family(cls, **values: Any) -> ModelConfig:
        """A config of `values` (our field names) with what their model_type's class implies
        where they leave it out: FAMILIES' fields, Gemma's scaled embedding, GELU-tanh gates
        and tied embeddings, Qwen2's q/k/v biases (a model config's `arch` block)."""
        model_type = values.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(unsupported_model_type(model_type))
        implied = dict(FAMILIES[model_type])
        if model_type in GEMMA:
            implied |= {"embedding_multiplier": values["hidden_size"] ** 0.5,
                        "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
        if model_type == GEMMA4:
            implied["attention_scale"] = 1.0  # its q/k norms set the scale
        if model_type == "qwen2":
            implied["attention_bias"] = True
        return cls(**(implied | values))

    # ---- derived facts ------------------------------------------------------------------------

    @property
    def sliding_layers(self) -> frozenset[int]:
        """The layers that attend within the sliding window."""
        if not self.layer_types:
            return frozenset(range(self.num_layers)) if self.sliding_window else frozenset()
        return frozenset(i for i, kind in enumerate(self.layer_types)
                         if kind == "sliding_attention")

    @property
    def chunked_layers(self) -> frozenset[int]:
        """The layers that attend within their chunk (Llama 4)."""
        return frozenset(i for i, kind in enumerate(self.layer_types)
                         if kind == "chunked_attention")

    @property
    def linear_layers(self) -> frozenset[int]:
        """The Gated DeltaNet layers (Qwen3-Next's linear attention)."""
        return frozenset(i for i, kind in enumerate(self.layer_types)
                         if kind == "linear_attention")

    @property
    def moe_layers(self) -> frozenset[int]:
        """The layers whose feed-forward block is a mixture of experts."""
        if not self.num_experts:
            return frozenset()
        return frozenset(i for i in range(self.num_layers) if i not in self.mlp_only_layers
                         and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (MLA): a compressed latent cached in place of K/V."""
        return self.kv_lora_rank > 0

    @property
    def cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of a token's cache entry per attention layer: K/V per
        KV head, or MLA's roped key and latent, one each."""
        if self.latent:
            return 1, self.head_dim, self.kv_lora_rank
        heads = max(self.num_kv_heads, self.full_kv_heads or 0)
        dim = max(self.head_dim, self.full_head_dim or 0)  # Gemma 4: the widest layer's
        return heads, dim, dim

    def layer_widths(self, layer: int) -> tuple[int, int]:
        """(K/V heads, head_dim) of layer `layer`'s attention: the full layers' own where they
        have them (Gemma 4), else the model's."""
        if layer >= self.num_layers or layer in self.sliding_layers:
            return self.num_kv_heads, self.head_dim
        return self.full_kv_heads or self.num_kv_heads, self.full_head_dim or self.head_dim

    @property
    def expert_width(self) -> int:
        """An expert's intermediate size."""
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def local_rope(self) -> tuple[float, dict | None] | None:
        """(theta, scaling) of the sliding layers, where it differs from the full layers'."""
        if self.local_rope_theta is None or not self.sliding_layers:
            return None
        return self.local_rope_theta, self.local_rope_scaling

    def cut(self, num_layers: int) -> ModelConfig:
        """This architecture with only its first num_layers layers (and no MTP modules, which
        read the last layer's output)."""
        return replace(self, num_layers=num_layers, layer_types=self.layer_types[:num_layers],
                       mtp_modules=0, mtp_layout=None)

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """The architecture in a model folder's config.json; errors name the file."""
        config_file = Path(folder) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            return cls.from_hf(json.loads(config_file.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON ({exc}): copy the model's "
                             f"config.json again") from None
        except ValueError as exc:
            raise ValueError(f"{config_file}: {exc}") from None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (old `rope_scaling` or v5 `rope_parameters`);
        an image-text model's (Qwen3.5's) is read as its text decoder's, its `text_config`."""
        config = _text_decoder(config)
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(unsupported_model_type(model_type))
        missing = [key for key in REQUIRED_HF_KEYS if key not in config]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: every {model_type} "
                             f"config.json has {', '.join(REQUIRED_HF_KEYS)}")
        _refuse_quantized(config)
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
        if model_type == "deepseek_v3":  # RoPE's dims: each head's roped part
            head_dim = config.get("qk_rope_head_dim", 64)
        bias = bool(config.get("attention_bias", model_type == "gpt_oss"))
        eos = config.get("eos_token_id")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            # Llama 4's intermediate_size is its experts' width: its dense layers' is apart
            intermediate_size=config.get("intermediate_size_mlp", 16384)
            if model_type == "llama4_text" else config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            # MLA expands a key and a value for every head from the latent
            num_kv_heads=num_heads if model_type == "deepseek_v3"
            else config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in GEMMA)),
            attention_bias=True if model_type == "qwen2" else bias,
            attention_out_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            model_type=model_type,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list | tuple) else _opt_tuple(eos),
            hidden_act=config.get("hidden_activation") or config.get("hidden_act", "silu"),
            **_read_rope(config, model_type),
            **(_read_attention(config, model_type, head_dim) | _read_linear(config, model_type)
               | _read_llama4(config, model_type)),
            **_read_multipliers(config, model_type),
            **_read_moe(config, model_type),
            **_read_mtp(config),
            **_read_gemma4(config, model_type, head_dim),
            **_read_latent(config, model_type),
            **FAMILIES[model_type],
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict of this architecture (`from_hf` reads it back);
        a config its model_type's class cannot express is refused."""
        self._check_expressible()
        eos = list(self.eos_token_ids)
        hf = {
            "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope_parameters": _rope_dict(self.rope_theta, self.rope_scaling,
                                          self.partial_rotary_factor),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": None,  # not a default of the family's class (Phi-3's is 32000)
            "hidden_act": self.hidden_act,
        }
        if self.mtp_layout is not None:
            hf[_MTP_KEYS[self.mtp_layout]] = self.mtp_modules
        return hf | self._family_keys()

    def _family_keys(self) -> dict[str, Any]:
        """The config.json keys of the attention, the multipliers and the RoPE per layer
        type, as this model_type's class reads them."""
        hf: dict[str, Any] = {}
        if self.model_type in GEMMA:
            hf["hidden_activation"] = self.hidden_act
            hf["final_logit_softcapping"] = self.final_logit_softcapping
        if self.model_type in ("gemma3_text", "gemma2"):
            hf["query_pre_attn_scalar"] = _pre_attn_scalar(self.attention_scale, self.head_dim)
            hf["attn_logit_softcapping"] = self.attn_logit_softcapping
        if self.model_type == GEMMA4:
            hf |= _gemma4_keys(self)
        if self.model_type == "granite":
            hf |= {"embedding_multiplier": self.embedding_multiplier or 1.0,
                   "residual_multiplier": self.residual_multiplier,
                   "attention_multiplier": self.attention_scale or self.head_dim ** -0.5,
                   "logits_scaling": self.logits_scaling}
        if self.model_type in WINDOWED:
            hf["sliding_window"] = self.sliding_window  # null where transformers has a default
            if self.model_type not in WHOLE_WINDOW:
                hf["layer_types"] = [
                    "sliding_attention" if i in self.sliding_layers else "full_attention"
                    for i in range(self.num_layers)]
            if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
                hf["use_sliding_window"] = bool(self.sliding_layers)
            if self.model_type in ("qwen2", "qwen3"):
                hf["max_window_layers"] = min(self.sliding_layers, default=self.num_layers)
        if self.model_type == "phi3" and self.rope_scaling:  # it reads this key at the top
            hf["original_max_position_embeddings"] = \
                self.rope_scaling["original_max_position_embeddings"]
        hf |= self._moe_keys()
        if self.model_type == "bamba":
            hf |= {key: getattr(self, key) for key in MAMBA_KEYS}
            hf["mamba_expand"] = self.mamba_n_heads * self.mamba_d_head // self.hidden_size
            hf["attn_layer_indices"] = [i for i in range(self.num_layers)
                                        if i not in self.linear_layers]
        elif self.model_type in HYBRID:
            hf |= {key: getattr(self, key) for key in LINEAR_KEYS}
            hf["layer_types"] = ["linear_attention" if i in self.linear_layers
                                 else "full_attention" for i in range(self.num_layers)]
        if self.model_type == "qwen3_next" and not self.num_experts:
            hf["num_experts"] = 0  # transformers' default is 512
        if self.model_type == "llama4_text":
            hf |= self._llama4_keys()
        if self.model_type == "deepseek_v3":
            hf |= {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank,
                   "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.head_dim,
                   "v_head_dim": self.v_head_dim, "rope_interleave": self.rope_interleave}
        if self.model_type in LOCAL_ROPE:
            local = self.local_rope or (self.rope_theta, self.rope_scaling)
            hf["rope_parameters"] = {
                "full_attention": _rope_dict(self.rope_theta, self.rope_scaling, 1.0),
                "sliding_attention": _rope_dict(*local, 1.0)}
        return hf

    def _llama4_keys(self) -> dict[str, Any]:
        """Llama 4's attention and mixture-of-experts keys (its intermediate_size is the
        experts' width, intermediate_size_mlp the dense layers')."""
        hf = {"intermediate_size": self.expert_width,
              "intermediate_size_mlp": self.intermediate_size,
              "num_local_experts": self.num_experts,
              "num_experts_per_tok": self.num_experts_per_tok,
              "moe_layers": sorted(self.moe_layers), "interleave_moe_layer_step": 1,
              "use_qk_norm": self.qk_norm == "l2",
              "no_rope_layers": [int(i not in self.no_rope_layers)
                                 for i in range(self.num_layers)],
              "attention_chunk_size": self.attention_chunk_size,
              "attn_temperature_tuning": self.temperature_tuning,
              "floor_scale": self.temperature_floor_scale, "attn_scale": self.temperature_scale}
        hf["layer_types"] = ["chunked_attention" if i in self.chunked_layers else
                             "full_attention" for i in range(self.num_layers)]
        return hf

    def _moe_keys(self) -> dict[str, Any]:
        """The config.json keys of the mixture of experts, as this model_type's class reads
        them."""
        if self.model_type not in MOE or not self.num_experts or \
                self.model_type == "llama4_text":  # its own: _llama4_keys
            return {}
        top = {"num_experts_per_tok": self.num_experts_per_tok}
        if self.model_type == "deepseek_v3":
            return top | {"n_routed_experts": self.num_experts,
                          "moe_intermediate_size": self.expert_width,
                          "n_shared_experts": self.shared_expert_intermediate_size
                          // self.expert_width,
                          "routed_scaling_factor": self.routed_scaling_factor,
                          "n_group": self.router_groups, "topk_group": self.router_top_groups,
                          "norm_topk_prob": self.norm_topk_prob,
                          "first_k_dense_replace": len(self.mlp_only_layers)}
        if self.model_type == "qwen3_next":
            top["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type in QWEN_MOE:
            return top | {"num_experts": self.num_experts,
                          "moe_intermediate_size": self.expert_width,
                          "norm_topk_prob": self.norm_topk_prob,
                          "decoder_sparse_step": self.decoder_sparse_step,
                          "mlp_only_layers": list(self.mlp_only_layers)}
        top["num_local_experts"] = self.num_experts
        if self.model_type == "gpt_oss":
            top |= {"swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}
        return top

    def _check_expressible(self) -> None:
        """Refuse what a config.json of this model_type cannot say (it would load as
        another model)."""
        implied = {f.name: f.default for f in fields(self)} | FAMILIES[self.model_type]
        embedding = self.hidden_size ** 0.5 if self.model_type in GEMMA else None
        implied["embedding_multiplier"] = embedding
        checked = {name: implied[name] for name in
                   ("norm_scale", "pre_norms", "post_norms", "qk_norm", "attention_sinks",
                    "router_bias", "expert_bias", "expert_act", "attention_output_gate",
                    "linear_split_projections", "router_scoring", "shared_expert_gate",
                    "recurrent_mixer")}
        if self.model_type not in ("qwen3_next", "deepseek_v3", "llama4_text"):
            checked["shared_expert_intermediate_size"] = 0
        if self.model_type != "llama4_text":
            checked |= {"attention_chunk_size": None, "no_rope_layers": (),
                        "temperature_tuning": False}
        else:  # its shared expert is one of its experts' width; L2 q/k norms or none
            checked |= {"shared_expert_intermediate_size": self.expert_width,
                        "decoder_sparse_step": 1, "norm_topk_prob": True,
                        "qk_norm": "l2" if self.qk_norm == "l2" else None}
        checked |= {name: implied[name] for name in ("v_norm", "layer_scalars")}
        if self.model_type != GEMMA4:
            checked |= {"value_from_key": False, "full_head_dim": None, "full_kv_heads": None}
        if self.model_type != "deepseek_v3":
            checked |= {"kv_lora_rank": 0, "q_lora_rank": None, "qk_nope_head_dim": 0,
                        "v_head_dim": 0, "router_groups": 1, "router_top_groups": 1,
                        "routed_scaling_factor": 1.0}
        elif self.num_experts:  # its shared experts are whole experts; its dense layers first
            checked |= {"shared_expert_intermediate_size": self.expert_width * (
                            self.shared_expert_intermediate_size // self.expert_width),
                        "mlp_only_layers": tuple(range(len(self.mlp_only_layers))),
                        "decoder_sparse_step": 1}
        if self.model_type not in ("deepseek_v3", "llama4_text"):
            checked["rope_interleave"] = False
        if self.model_type not in (*QWEN_MOE, "deepseek_v3", "llama4_text"):
            checked |= {"decoder_sparse_step": 1, "mlp_only_layers": (),
                        "expert_intermediate_size": None}
            if self.model_type in MOE:
                checked["norm_topk_prob"] = True
        if self.model_type != "granite":
            checked |= {"embedding_multiplier": embedding, "residual_multiplier": 1.0,
                        "logits_scaling": 1.0}
            if self.model_type not in GEMMA:
                checked["attention_scale"] = None
            elif self.model_type == GEMMA4:
                checked["attention_scale"] = 1.0
        if self.model_type not in GEMMA or self.model_type == GEMMA4:
            checked["attn_logit_softcapping"] = None
        if self.model_type not in GEMMA:
            checked["final_logit_softcapping"] = None
        if self.model_type not in LOCAL_ROPE:
            checked |= {"local_rope_theta": None, "local_rope_scaling": None}
        if self.model_type == GEMMA4:
            checked["partial_rotary_factor"] = 1.0  # its share rotated is in its RoPE's type
        wrong = {name: getattr(self, name) for name, value in checked.items()
                 if not _same(getattr(self, name), value)}
        if wrong:
            raise ValueError(f"a {self.model_type} config.json cannot express "
                             f"{', '.join(f'{k}={v!r}' for k, v in wrong.items())} (its class "
                             f"implies {', '.join(f'{k}={checked[k]!r}' for k in wrong)})")
        if self.model_type == "deepseek_v3" and (self.num_kv_heads != self.num_heads
                                                 or not self.latent):
            raise ValueError("a deepseek_v3 config.json implies latent attention (kv_lora_rank "
                             ">= 1) with a key and a value per head (num_kv_heads = num_heads)")
        if self.model_type == "qwen2" and not (self.attention_bias
                                               and not self.attention_out_bias):
            raise ValueError("a qwen2 config.json implies a bias on q, k and v and none on o")
        if (self.model_type in MOE) != (self.num_experts > 0) and \
                self.model_type != "qwen3_next":  # dense or not
            raise ValueError(f"a {self.model_type} config.json "
                             f"{'needs' if self.model_type in MOE else 'has no'} experts "
                             f"(num_experts={self.num_experts})")
        if self.model_type == "bamba" and (
                self.partial_rotary_factor != 0.5
                or self.mamba_n_heads * self.mamba_d_head % self.hidden_size):
            raise ValueError("a bamba config.json rotates half of each head and widens the "
                             "Mamba-2 layers by an integer factor (mamba_expand)")
        if self.model_type not in HYBRID and self.linear_layers:
            raise ValueError(f"a {self.model_type} config.json has no linear-attention layers")
        if self.model_type not in WINDOWED and self.sliding_layers:
            raise ValueError(f"a {self.model_type} config.json has no sliding window")
        if self.model_type in WHOLE_WINDOW and self.sliding_layers not in (
                frozenset(), frozenset(range(self.num_layers))):
            raise ValueError(f"a {self.model_type} config.json has one window for every layer "
                             f"or none")
        if self.model_type in ("qwen2", "qwen3") and self.sliding_layers != frozenset(
                range(min(self.sliding_layers, default=self.num_layers), self.num_layers)):
            raise ValueError(f"a {self.model_type} config.json slides its last layers only "
                             f"(from max_window_layers on)")
        if self.model_type != "qwen2" and self.attention_bias != self.attention_out_bias:
            raise ValueError(f"a {self.model_type} config.json has one attention_bias for q, "
                             f"k, v and o")


# The fields that came with the families after eos_token_ids (see __repr__).
_FAMILY_FIELDS = ("hidden_act", "norm_scale", "pre_norms", "post_norms", "qk_norm",
                  "embedding_multiplier", "residual_multiplier", "attention_scale",
                  "attn_logit_softcapping", "final_logit_softcapping", "logits_scaling",
                  "sliding_window", "layer_types", "local_rope_theta", "local_rope_scaling",
                  "partial_rotary_factor", "attention_sinks", "num_experts",
                  "num_experts_per_tok", "expert_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "router_bias", "expert_bias",
                  "expert_act", "swiglu_alpha", "swiglu_limit", "mtp_modules", "mtp_layout",
                  "attention_output_gate", *LINEAR_KEYS, "linear_split_projections",
                  "shared_expert_intermediate_size", "shared_expert_gate", "router_scoring",
                  "router_groups", "router_top_groups", "routed_scaling_factor",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
                  "rope_interleave", "attention_chunk_size", "no_rope_layers",
                  "temperature_tuning", "temperature_floor_scale", "temperature_scale")

_FAMILY_FIELDS += ("v_norm", "value_from_key", "layer_scalars", "full_head_dim",
                   "full_kv_heads")  # Gemma 4's
_FAMILY_FIELDS += ("recurrent_mixer", *MAMBA_KEYS)  # Mamba-2 hybrids' (Bamba)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def _opt_tuple(value: int | None) -> tuple[int, ...]:
    return () if value is None else (value,)


def _pre_attn_scalar(scale: float | None, head_dim: int) -> float:
    """Gemma's query_pre_attn_scalar for a softmax scale (its -1/2 power)."""
    value = head_dim if scale is None else scale ** -2
    return int(round(value)) if math.isclose(value, round(value), rel_tol=1e-9) else value


def _read_attention(config: Mapping[str, Any], model_type: str, head_dim: int) -> dict:
    """The softmax scale, soft-capping and sliding windows of a config.json."""
    scale = None
    if model_type == GEMMA4:
        scale = 1.0  # its q/k norms set the scale
    elif model_type in GEMMA:
        scale = float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5
    elif model_type == "granite" and config.get("attention_multiplier") is not None:
        scale = float(config["attention_multiplier"])
    types = config.get("layer_types")
    # transformers' defaults where the key is absent: Gemma's and Mistral's window is 4096
    window = config.get("sliding_window", _DEFAULT_WINDOWS.get(model_type))
    if model_type not in WINDOWED or (model_type in ("qwen2", "qwen3", "qwen3_moe")
                                      and not config.get("use_sliding_window", False)):
        window = None  # no window in the family, or Qwen's off unless use_sliding_window
    if window is None:
        types = None
    elif types is None and model_type in GEMMA:  # configs written before layer_types existed
        pattern = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    elif types is None and model_type == "gpt_oss":  # its class's default: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    elif types is None and model_type in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", config["num_hidden_layers"])
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    types = tuple(types or ())
    if model_type == GEMMA4 and types:  # its class forces the last layer full
        types = (*types[:-1], "full_attention")
    if types and "sliding_attention" not in types:
        window = None
    caps = {key: (None if config.get(key) is None else float(config[key]))
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {"attention_scale": scale, "sliding_window": window, "layer_types": types, **caps}


def _read_moe(config: Mapping[str, Any], model_type: str) -> dict:
    """The mixture of experts of a config.json (transformers' defaults where a key is
    absent)."""
    if model_type not in MOE or model_type in ("deepseek_v3", "llama4_text"):  # their own
        return {}
    top = config.get("num_experts_per_tok") or config.get("experts_per_token")
    # transformers names it num_local_experts in every family (published Qwen3-MoE:
    # num_experts)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if model_type == "qwen3_next":  # transformers' defaults: 512 experts, top 10
        experts = config.get("num_experts", 512)
        if not experts:
            return {}
        return {"num_experts": experts, "num_experts_per_tok": top or 10,
                "expert_intermediate_size": config.get("moe_intermediate_size", 512),
                "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
                "decoder_sparse_step": config.get("decoder_sparse_step", 1),
                "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
                "shared_expert_intermediate_size":
                    config.get("shared_expert_intermediate_size", 512)}
    if model_type == "qwen3_moe":
        return {"num_experts": experts or 128, "num_experts_per_tok": top or 8,
                "expert_intermediate_size": config.get("moe_intermediate_size", 768),
                "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                "decoder_sparse_step": config.get("decoder_sparse_step", 1),
                "mlp_only_layers": tuple(config.get("mlp_only_layers") or ())}
    if model_type == "mixtral":
        return {"num_experts": experts or 8, "num_experts_per_tok": top or 2}
    return {"num_experts": experts or 128, "num_experts_per_tok": top or 4,
            "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(config.get("swiglu_limit", 7.0))}


def _read_llama4(config: Mapping[str, Any], model_type: str) -> dict:
    """Llama 4's text decoder (transformers' defaults where a key is absent): the experts'
    and the dense layers' widths, which layers are sparse, RoPE-less and chunked."""
    if model_type != "llama4_text":
        return {}
    layers = config["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step", 1)
    sparse = config.get("moe_layers")
    sparse = set(range(step - 1, layers, step) if sparse is None else sparse)
    uses_rope = config.get("no_rope_layers") or [int((i + 1) % config.get(
        "no_rope_layer_interval", 4) != 0) for i in range(layers)]
    chunk = config.get("attention_chunk_size", 8192)
    types = config.get("layer_types") or [
        "chunked_attention" if rope and chunk is not None else "full_attention"
        for rope in uses_rope]
    experts = config.get("num_local_experts", 16)
    width = config.get("intermediate_size", 8192)
    return {"num_experts": experts, "num_experts_per_tok": config.get("num_experts_per_tok", 1),
            "expert_intermediate_size": width, "shared_expert_intermediate_size": width,
            "mlp_only_layers": tuple(i for i in range(layers) if i not in sparse),
            "qk_norm": "l2" if config.get("use_qk_norm", True) else None,
            "no_rope_layers": tuple(i for i, rope in enumerate(uses_rope) if not rope),
            "layer_types": tuple(types),
            "attention_chunk_size": chunk if "chunked_attention" in types else None,
            "temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
            "temperature_floor_scale": int(config.get("floor_scale", 8192)),
            "temperature_scale": float(config.get("attn_scale", 0.1))}


def _read_latent(config: Mapping[str, Any], model_type: str) -> dict:
    """DeepSeek-V3's latent attention and routing (transformers' defaults where a key is
    absent)."""
    if model_type != "deepseek_v3":
        return {}
    experts = config.get("n_routed_experts", config.get("num_local_experts", 256))
    width = config.get("moe_intermediate_size", 2048)
    dense = min(config.get("first_k_dense_replace", 3), config["num_hidden_layers"])
    moe = {"num_experts": experts, "num_experts_per_tok": config.get("num_experts_per_tok", 8),
           "expert_intermediate_size": width,
           "shared_expert_intermediate_size": width * config.get("n_shared_experts", 1),
           "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
           "mlp_only_layers": tuple(range(dense)),
           "routed_scaling_factor": float(config.get("routed_scaling_factor", 2.5)),
           "router_groups": config.get("n_group") or 1,
           "router_top_groups": config.get("topk_group") or 1} if experts else {}
    return moe | {"kv_lora_rank": config.get("kv_lora_rank", 512),
                  "q_lora_rank": config.get("q_lora_rank", 1536),
                  "qk_nope_head_dim": config.get("qk_nope_head_dim", 128),
                  "v_head_dim": config.get("v_head_dim", 128),
                  "rope_interleave": bool(config.get("rope_interleave", True))}


def _read_linear(config: Mapping[str, Any], model_type: str) -> dict:
    """Qwen3-Next's and Qwen3.5's layer kinds and linear-attention widths (transformers'
    defaults where a key is absent: a full-attention layer every fourth)."""
    if model_type == "bamba":
        return _read_mamba(config)
    if model_type not in HYBRID:
        return {}
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(config["num_hidden_layers"])]
    defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4}
    return {"layer_types": tuple(types)} | {key: int(config.get(key, defaults[key]))
                                             for key in LINEAR_KEYS}


def _read_mamba(config: Mapping[str, Any]) -> dict:
    """Bamba's layer kinds (attention at attn_layer_indices, Mamba-2 elsewhere) and Mamba-2
    widths (transformers' defaults where a key is absent)."""
    limit = tuple(_json_float(v) for v in config.get("time_step_limit") or (0.0, "inf"))
    if limit != (0.0, float("inf")):
        raise ValueError(f"a Mamba-2 time_step_limit other than (0, inf) is not supported "
                         f"(got {list(limit)})")
    attention = set(config.get("attn_layer_indices") or ())
    heads = int(config.get("mamba_n_heads", 128))
    head = config.get("mamba_d_head", "auto")
    if head in (None, "auto"):
        head = config.get("mamba_expand", 2) * config["hidden_size"] // heads
    return {"layer_types": tuple("full_attention" if i in attention else "linear_attention"
                                 for i in range(config["num_hidden_layers"])),
            "mamba_n_heads": heads, "mamba_d_head": int(head),
            "mamba_n_groups": int(config.get("mamba_n_groups", 1)),
            "mamba_d_state": int(config.get("mamba_d_state", 256)),
            "mamba_d_conv": int(config.get("mamba_d_conv", 4)),
            "mamba_conv_bias": bool(config.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(config.get("mamba_proj_bias", False))}


def _json_float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__":
    "Infinity"}."""
    return float(value["__float__"] if isinstance(value, Mapping) else value)


def _text_decoder(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The config.json of an image-text model's text decoder (its `text_config`, of
    IMAGE_TEXT's model_type), else config itself."""
    text = IMAGE_TEXT.get(config.get("model_type"))
    if text is None or not isinstance(config.get("text_config"), Mapping):
        return config
    return {**config["text_config"], "model_type": text}


def _read_mtp(config: Mapping[str, Any]) -> dict:
    """The MTP modules a config.json names (DeepSeek-V3's count of NextN layers, or
    Qwen3-Next's count of `mtp.*` layers); none where it names neither."""
    for layout in ("nextn", "mtp"):  # a MiMo checkpoint's names make its NextN count MiMo's
        if config.get(_MTP_KEYS[layout]):
            return {"mtp_modules": int(config[_MTP_KEYS[layout]]), "mtp_layout": layout}
    return {}


# Gemma 4's parts not read yet, each with the value that turns it off: per-layer embeddings,
# K/V shared across layers, the MoE block beside the MLP, wider MLPs in shared layers
_GEMMA4_UNREAD = {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                  "enable_moe_block": False, "use_double_wide_mlp": False}


def _read_gemma4(config: Mapping[str, Any], model_type: str, head_dim: int) -> dict:
    """Gemma 4's own field (keys doubling as values in full layers); what selfspec does not
    read yet (per-layer embeddings, K/V shared across layers, the MoE block, full layers of
    their own head_dim or K/V heads, bidirectional text attention) is refused, naming it."""
    if model_type != GEMMA4:
        return {}
    absent = {"hidden_size_per_layer_input": 256}  # transformers' default where it is absent
    unread = {key: config.get(key, absent.get(key, off)) for key, off in _GEMMA4_UNREAD.items()}
    unread = {key: value for key, value in unread.items()
              if value not in (_GEMMA4_UNREAD[key], None)}
    if config.get("use_bidirectional_attention") == "all":
        unread["use_bidirectional_attention"] = "all"
    if unread:
        raise ValueError(
            f"this gemma4_text config.json has parts selfspec does not read yet: "
            f"{', '.join(f'{k}={v!r}' for k, v in unread.items())}; it reads Gemma 4 "
            f"decoders with {', '.join(f'{k}={v!r}' for k, v in _GEMMA4_UNREAD.items())}")
    value_from_key = bool(config.get("attention_k_eq_v", False))
    full = _gemma4_full_layer(config, value_from_key)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dim, heads = full.get("head_dim", head_dim), full.get("num_key_value_heads", kv_heads)
    return {"value_from_key": value_from_key,
            "full_head_dim": None if dim == head_dim else int(dim),
            "full_kv_heads": None if heads == kv_heads else int(heads)}


def _gemma4_full_layer(config: Mapping[str, Any], value_from_key: bool) -> dict:
    """A full layer's overrides of head_dim and num_key_value_heads, as transformers reads
    them: config.json's per_layer_config where written, else global_head_dim (512 where
    absent) and, with keys as values, num_global_key_value_heads."""
    overrides = config.get("per_layer_config")
    if overrides is not None:  # written: what it lists (nothing: every layer alike)
        for i, kind in enumerate(config.get("layer_types") or []):
            found = overrides.get(str(i), overrides.get(i)) if kind == "full_attention" else None
            if found:
                return found
        return {}
    found = {"head_dim": config.get("global_head_dim", 512)}
    if value_from_key and config.get("num_global_key_value_heads") is not None:
        found["num_key_value_heads"] = config["num_global_key_value_heads"]
    return found


def _gemma4_keys(config: ModelConfig) -> dict[str, Any]:
    """A gemma4_text config.json's own keys for what selfspec reads of it (transformers reads
    num_global_key_value_heads only with keys as values)."""
    heads = config.full_kv_heads
    if heads is not None and not config.value_from_key:
        raise ValueError("a gemma4_text config.json gives full layers K/V heads of their own "
                         "only with attention_k_eq_v (value_from_key)")
    return {**_GEMMA4_UNREAD, "attention_k_eq_v": config.value_from_key,
            "global_head_dim": config.full_head_dim or config.head_dim,
            "num_global_key_value_heads": heads, "use_bidirectional_attention": None}


# transformers' config that dequantizes each published format on loading
_DEQUANTIZING = {"mxfp4": "Mxfp4Config", "fp8": "FineGrainedFP8Config"}


def _refuse_quantized(config: Mapping[str, Any]) -> None:
    """Published weights in a quantized format (gpt-oss's MXFP4, DeepSeek-V3's FP8 blocks)
    are refused, naming the fix."""
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) \
            else quantization
        dequantizing = _DEQUANTIZING.get(method, "Mxfp4Config")
        raise ValueError(
            f"the weights are quantized ({method}); dequantize them with transformers first: "
            f"AutoModelForCausalLM.from_pretrained(folder, quantization_config="
            f"{dequantizing}(dequantize=True), dtype=torch.bfloat16).save_pretrained(new_folder)")


def _read_multipliers(config: Mapping[str, Any], model_type: str) -> dict:
    if model_type in GEMMA:
        return {"embedding_multiplier": config["hidden_size"] ** 0.5}
    if model_type != "granite":
        return {}
    return {"embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
            "logits_scaling": float(config.get("logits_scaling", 1.0))}


def _read_rope(config: Mapping[str, Any], model_type: str) -> dict:
    """rope_theta, rope_scaling, partial_rotary_factor and a local RoPE from either HF
    convention (v5's `rope_parameters`, maybe one per layer type, or the older keys)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or (
        {**_GPT_OSS_ROPE, "rope_theta": config.get("rope_theta", 150000.0)}
        if model_type == "gpt_oss" else {})
    if "full_attention" in params or "sliding_attention" in params:  # one per layer type
        full = _rope_params(params.get("full_attention") or {}, config, "rope_theta", 1e6)
        local = _rope_params(params.get("sliding_attention") or {}, config,
                             "rope_local_base_freq", 1e4)
        return {"rope_theta": full[0], "rope_scaling": full[1],
                "partial_rotary_factor": full[2], "local_rope_theta": local[0],
                "local_rope_scaling": local[1]}
    default = 1e6 if model_type in LOCAL_ROPE else 10000.0
    theta, scaling, partial = _rope_params(params, config, "rope_theta", default)
    local = {}
    if model_type in LOCAL_ROPE:
        local = {"local_rope_theta": float(config.get("rope_local_base_freq", 1e4)),
                 "local_rope_scaling": None}
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial,
            **local}


def _rope_params(params: Mapping[str, Any], config: Mapping[str, Any], theta_key: str,
                 default_theta: float) -> tuple[float, dict | None, float]:
    """(theta, scaling or None, partial_rotary_factor) of one RoPE's parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", config.get(theta_key, default_theta)))
    partial = float(params.pop("partial_rotary_factor",
                               config.get("partial_rotary_factor", 1.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "proportional":  # its share rotated belongs to its own frequencies
        params["partial_rotary_factor"], partial = partial, 1.0
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return theta, None, partial
    required, optional = _ROPE_KEYS[kind]
    if "original_max_position_embeddings" not in params and \
            "original_max_position_embeddings" in config:  # Phi-3 keeps it at the top level
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    missing = [key for key in required if key not in params]
    if missing:
        raise ValueError(f"RoPE scaling {kind!r} needs {missing} in the config")
    kept = {key: params[key] for key in (*required, *optional) if params.get(key) is not None}
    for key in ("short_factor", "long_factor"):
        if key in kept:
            kept[key] = tuple(kept[key])
    return theta, {"rope_type": kind, **kept}, partial


def _rope_dict(theta: float, scaling: dict | None, partial: float) -> dict:
    """One RoPE's parameters as transformers v5 writes them."""
    scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in (scaling or {}).items()}
    rope = {"rope_type": "default", **scaling, "rope_theta": theta}
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    return rope
