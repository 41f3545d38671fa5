"""The mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, gpt-oss, Qwen3-Next) as
`ModelConfig` describes it: a linear router (with a bias: gpt-oss) picks each token's top k
experts, and the token's output is the weighted sum of theirs, plus, where the family has one
(Qwen3-Next: `shared_expert_intermediate_size`), a shared expert every token runs, scaled by
the sigmoid of its own gate.

Routing: the top k logits' softmax (`norm_topk_prob`: Mixtral, gpt-oss) or their share of the
softmax over every expert (Qwen3-MoE without it). The two are the same ranking, so the top k
of the logits serve both. DeepSeek-V3 (`router_scoring="sigmoid"`) routes by sigmoids
instead, within the best groups of experts (`grouped_sigmoid_routing`), and its shared
experts have no gate. Llama 4 (`router_scoring="sigmoid_input"`) weighs its top k by the
sigmoids of their logits and multiplies each expert's input by its weight, not its output
(the expert is not linear: the two differ).

Experts are stacked per layer: `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows,
then its up rows), `experts.down_proj` [E, H, I], and with `expert_bias` their biases
[E, 2I] and [E, H]. `selfspec.model.checkpoint` maps the published layouts (per-expert
Mixtral and Qwen3-MoE weights, gpt-oss's transposed and interleaved stacks) to these.

Two dispatches with one result:
- eager: the token-expert pairs grouped by expert, each expert used runs once over its
  tokens (reads the group sizes to the host: prefill and long forwards);
- static: fixed shapes and no host read (a static decode step, `selfspec.step`): each
  token's top-k experts' weights gathered and multiplied batch-wise where that reads fewer
  weights than the whole layer holds (few tokens), else every expert over every token with
  the unrouted pairs weighted 0 (each weight read once).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import Linear, invariant_linear
from selfspec.model.exact_mode import activated


class Routing(NamedTuple):
    """Each token's experts [N, k] (long) and their weights [N, k] (the input's dtype)."""

    experts: torch.Tensor
    weights: torch.Tensor


class Experts(nn.Module):
    """A layer's experts, stacked (see the module's docstring for the layout)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, hidden, inner = config.num_experts, config.hidden_size, config.expert_width
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inner))
        if config.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * inner))
            self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.clamped = config.expert_act == "clamped_swiglu"
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.invariant_rows: int | None = None  # the exact mode (`MoE.exact_dispatch`)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation, per expert."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., I] the activation of the gate and up products [..., 2I]: SiLU(gate) * up, or
        gpt-oss's clamped gate * sigmoid(alpha * gate) * (up + 1)."""
        gate, up = gate_up.chunk(2, dim=-1)
        if not self.clamped:
            return activated(F.silu, gate, self.invariant_rows) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * activated(torch.sigmoid, gate * self.alpha,
                                             self.invariant_rows))

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """[n, H] expert e over tokens x [n, H] (in the exact mode, invariant products)."""
        exact = self.invariant_rows
        gate_up = _linear(x, self.gate_up_proj[e], _row(self.gate_up_proj_bias, e), exact)
        return _linear(self.gated(gate_up), self.down_proj[e], _row(self.down_proj_bias, e),
                       exact)

    def gathered(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """[N, k, H] each token's k experts (experts [N, k]) over it (x [N, H], or [N, k, H]:
        each pair's own input), from their weights gathered: [N, k, 2I, H] and [N, k, H, I]."""
        pattern = "nh,nkoh->nko" if x.dim() == 2 else "nkh,nkoh->nko"
        gate_up = torch.einsum(pattern, x, self.gate_up_proj[experts])
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[experts]
        out = torch.einsum("nki,nkhi->nkh", self.gated(gate_up), self.down_proj[experts])
        return out if self.down_proj_bias is None else out + self.down_proj_bias[experts]

    def every(self, x: torch.Tensor) -> torch.Tensor:
        """[E, N, H] every expert over every token x [N, H] (or [E, N, H]: each expert's own
        inputs)."""
        gate_up = torch.matmul(x, self.gate_up_proj.transpose(1, 2))  # [E, N, 2I]
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[:, None]
        out = torch.matmul(self.gated(gate_up), self.down_proj.transpose(1, 2))
        return out if self.down_proj_bias is None else out + self.down_proj_bias[:, None]


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            invariant_rows: int | None) -> torch.Tensor:
    """F.linear, or in the exact mode the product whose rows keep their bits."""
    if invariant_rows is None:
        return F.linear(x, weight, bias)
    return invariant_linear(x, weight, bias, invariant_rows)


class SharedExpert(nn.Module):
    """The expert every token runs (Qwen3-Next): a gated MLP of its own width, its output
    scaled by sigmoid(shared_expert_gate(x)), a gate [1, hidden] per layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.shared_expert_intermediate_size
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)
        self.invariant_rows: int | None = None  # the exact mode: its act on whole vectors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = activated(F.silu, self.gate_proj(x), self.invariant_rows)
        return self.down_proj(gate * self.up_proj(x))


def grouped_sigmoid_routing(scores: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int,
                            top_groups: int, renormalise: bool, scale: float) -> Routing:
    """DeepSeek-V3's routing by the sigmoids of the router's logits, scores [N, E]: experts
    are chosen by their score plus the correction bias [E], among the top_groups groups (of
    `groups` contiguous ones) whose two best such scores sum highest; their weights are their
    plain scores, renormalised to sum to 1 where asked, times scale. In fp32 throughout."""
    scores = scores.float()
    choice = scores + bias.float()
    n, experts = choice.shape
    by_group = choice.view(n, groups, experts // groups)
    group_scores = by_group.topk(min(2, experts // groups), dim=-1).values.sum(-1)  # [N, G]
    kept = torch.zeros_like(group_scores).scatter_(
        1, group_scores.topk(top_groups, dim=-1).indices, 1.0).bool()  # [N, G]
    choice = by_group.masked_fill(~kept[..., None], float("-inf")).view(n, experts)
    chosen = choice.topk(top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, chosen)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(chosen, weights * scale)


class MoE(nn.Module):
    """A layer's mixture of experts: the router `gate` and the stacked `experts`. Maps
    [B, T, hidden] to [B, T, hidden], as the MLP it replaces."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.sigmoid_routing = config.router_scoring == "sigmoid"
        self.weighs_input = config.router_scoring == "sigmoid_input"  # Llama 4
        if self.sigmoid_routing:  # DeepSeek-V3's learned correction of the choice (fp32)
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(config.num_experts, dtype=torch.float32))
            self.groups = (config.router_groups, config.router_top_groups)
            self.routed_scale = config.routed_scaling_factor
        self.experts = Experts(config)
        if config.shared_expert_intermediate_size and config.shared_expert_gate:
            self.shared_expert = SharedExpert(config)  # transformers' names
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        elif config.shared_expert_intermediate_size:  # DeepSeek's, side by side, ungated
            self.shared_experts = SharedExpert(config)
        self.invariant_rows: int | None = None  # the exact mode (`exact_dispatch`)

    @property
    def num_experts(self) -> int:
        return self.experts.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, fused: bool = False, static: bool = False
                ) -> torch.Tensor:
        """static: the fixed-shape dispatch, which reads nothing back to the host (a static
        decode step); else the eager one. fused: unused (the experts' products are stacked
        already)."""
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        routing = self.route(flat)
        if self.invariant_rows is not None:
            out = self.exact_dispatch(flat, routing)
        else:
            out = self.static_dispatch(flat, routing) if static else \
                self.eager_dispatch(flat, routing)
        if hasattr(self, "shared_expert"):
            gate = activated(torch.sigmoid, self.shared_expert_gate(flat), self.invariant_rows)
            out = out + gate * self.shared_expert(flat)
        elif hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.view_as(x)

    def route(self, x: torch.Tensor) -> Routing:
        """Each token's top-k experts and weights, x [N, hidden]."""
        if self.sigmoid_routing:
            exact = self.invariant_rows
            logits = _linear(x.float(), self.gate.weight.float(), None, exact)
            routing = grouped_sigmoid_routing(
                activated(torch.sigmoid, logits, exact), self.gate.e_score_correction_bias,
                self.top_k, *self.groups, self.norm_topk_prob, self.routed_scale)
            return Routing(routing.experts, routing.weights.to(x.dtype))
        logits = self.gate(x)  # [N, E]
        top, experts = logits.topk(self.top_k, dim=-1)  # [N, k]
        top = top.float()
        if self.weighs_input:
            weights = activated(torch.sigmoid, top, self.invariant_rows)
        elif self.norm_topk_prob:
            weights = torch.softmax(top, dim=-1)
        else:
            weights = activated(torch.exp, top - torch.logsumexp(logits.float(), dim=-1,
                                                                  keepdim=True),
                                 self.invariant_rows)
        return Routing(experts, weights.to(x.dtype))

    def eager_dispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """[N, hidden]: the token-expert pairs sorted by expert; each expert used runs once
        over its tokens (one host read: the group sizes)."""
        pairs = routing.experts.flatten()  # [N * k]
        order = pairs.argsort(stable=True)
        sizes = torch.bincount(pairs, minlength=self.num_experts).tolist()
        weights = routing.weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, size in enumerate(sizes):
            if size:
                rows = order[start:start + size]
                tokens = rows // self.top_k
                w = weights[rows, None]
                y = self.experts.one(e, x[tokens] * w) if self.weighs_input else \
                    self.experts.one(e, x[tokens]) * w
                out.index_add_(0, tokens, y)
                start += size
        return out

    def per_expert(self, routing: Routing) -> torch.Tensor:
        """[N, E] each token's weight for every expert: its routed weights, 0 elsewhere."""
        weights = routing.weights
        combine = weights.new_zeros(weights.shape[0], self.num_experts)
        return combine.scatter_(1, routing.experts, weights)

    def exact_dispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """[N, hidden] in the exact mode: every expert over every token, in fixed-shape
        products, added in the experts' order with the unrouted ones weighted 0, so that a
        token's sum is the same whatever tokens come with it and whether or not the step is
        captured (E / k times the experts' work of a routed dispatch)."""
        combine = self.per_expert(routing)  # [N, E]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            weight = combine[:, e, None]
            out = out + (self.experts.one(e, x * weight) if self.weighs_input
                         else self.experts.one(e, x) * weight)
        return out

    def static_dispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """[N, hidden] in shapes fixed by N alone: the gathered experts when N * k pairs read
        fewer weights than the layer's E experts, else every expert with the unrouted pairs
        weighted 0."""
        weights = routing.weights[..., None]  # [N, k, 1]
        if x.shape[0] * self.top_k < self.num_experts:
            if self.weighs_input:
                return self.experts.gathered(x[:, None] * weights, routing.experts).sum(dim=1)
            out = self.experts.gathered(x, routing.experts)  # [N, k, hidden]
            return (out * weights).sum(dim=1)
        combine = self.per_expert(routing)  # [N, E]
        if self.weighs_input:  # an unrouted pair's input is 0, and so is its output
            return self.experts.every(combine.T[..., None] * x).sum(dim=0)
        return torch.einsum("ne,enh->nh", combine, self.experts.every(x))

