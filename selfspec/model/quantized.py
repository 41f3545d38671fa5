"""The target's own weights, quantized weight-only to int8 or int4 by torchao: a draft model
for QSpec-style drafting (a quantized copy of the target drafts, the full-precision target
verifies). `quantized_copy` builds it; `SmallModelDrafter` drafts with it like with any other
draft model (its own KV cache), and the shared exact verifier keeps the output the target's,
however far the copy's logits are from the target's.

On the CPU, aten's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are vectorized for bf16 activations only: with fp32 ones they ran 9-20x slower than the fp32
product they replace (scripts/bench_quantized.py). So every quantized linear takes its rows in
bf16, quantized from the bf16 rounding of the weight (the kernels want bf16 scales), and
hands its output back in the input's dtype; the embedding, the norms, attention and the KV
cache stay the target's fp32.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.model import Linear, Transformer
from selfspec.quiet import quiet_imports

BITS = (8, 4)
COMPUTE_DTYPE = torch.bfloat16  # the activations dtype the CPU kernels are vectorized for
# int4 scales and zero points per this many input columns (the CPU kernel takes 32-256); the
# finest group drafts closest to the target at about the same speed (bench_quantized.py).
INT4_GROUP = 32
# aten's int8 CPU kernel reads the input width in blocks of 16 once it has 4 rows or more (it
# crashed the process on widths 8, 24, 40 and 56): narrower weights are widened with zeros.
INT8_WIDTH_MULTIPLE = 16
TORCHAO_FIX = "pip install torchao==0.18.0"


class QuantizedLinear(nn.Module):
    """A linear layer over a torchao weight-only tensor: the one place a quantized copy's
    products run, each kernel called explicitly rather than left to `Linear.forward`, whose
    few-row `W @ x.T` torchao's tensors do not implement (aten.matmul: NotImplementedError).

    int8: torchao's `Int8Tensor` (per output row, symmetric), multiplied by aten's
    `_weight_int8pack_mm` on its int8 data (torchao 0.18's own int8 product converts the
    whole weight to float at every call). int4: torchao's `Int4OpaqueTensor` (groups of
    INT4_GROUP, asymmetric), multiplied through `F.linear`, which torchao sends to
    `_weight_int4pack_mm_for_cpu`. `padding`: zero input columns the weight was widened by so
    that an int4 group, or the int8 kernel's block of 16, divides its width (the rows get
    zeros there: the product is unchanged).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
                 padding: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.bits, self.padding = bits, padding
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] - padding
        # _weight_int8pack_mm takes one scale per output row, in the activations' dtype.
        self.register_buffer("scale", None if bits == 4 else
                             weight.scale.reshape(-1).to(COMPUTE_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.is_grad_enabled() and rows.requires_grad:  # training through a frozen target
            out = _DifferentiableProduct.apply(rows, self)
        else:
            out = self.product(rows)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in_features] times the quantized weight's transpose, [n, out_features]
        (in COMPUTE_DTYPE; no bias)."""
        rows = rows.to(COMPUTE_DTYPE).contiguous()
        if self.padding:
            rows = F.pad(rows, (0, self.padding))
        if self.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(rows, self.weight.qdata, self.scale)
        return F.linear(rows, self.weight)

    def dense_weight(self) -> torch.Tensor:
        """The weight [out, in] in fp32 as the kernel computes with it: its products with the
        identity's rows (for initialising heads from a quantized LM head, and for gradients)."""
        identity = torch.eye(self.in_features, dtype=COMPUTE_DTYPE,
                             device=self.weight.qdata.device)
        return self.product(identity).float().t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}, bias={self.bias is not None}")


class _DifferentiableProduct(torch.autograd.Function):
    """`QuantizedLinear.product`, differentiable in its rows (the weight is frozen): aten's
    weight-only kernels have no derivative, so the rows' gradient multiplies by the weight the
    kernel itself computes with, read back as its product with the identity (W^T = I W^T).
    What training heads through a quantized frozen target (its LM head) needs."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        return layer.product(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.float() @ ctx.layer.dense_weight(), None  # [n, out] @ [out, in]


def quantized_copy(target: Transformer, bits: int) -> Transformer:
    """A deep copy of `target` whose linear layers (attention, MLP and the LM head) hold
    int8 or int4 weight-only quantizations of the target's weights (`QuantizedLinear`), on the
    target's device; the embedding and norms are copied as they are. A tied LM head is untied
    in the copy: its head is the quantized embedding matrix, its embedding table stays full
    precision. The target is not changed. No I/O."""
    device = target.embed_tokens.weight.device
    check_quantizable(bits, device)
    quantized = copy.deepcopy(target)
    for parent, name, layer in list(linear_layers(quantized)):
        setattr(parent, name, _quantized_linear(layer, bits))
    # Its products round activations to bf16, so, as a bf16 model, a forward over several rows
    # may break a near-tie of its logits otherwise than a one-row forward: the lossless check
    # reads this to count such divergences as the dtype's near-ties (measure.lossless).
    quantized.products_dtype = COMPUTE_DTYPE
    return quantized.eval()


def check_quantizable(bits: int, device: torch.device | str) -> None:
    """Refuse what `quantized_copy` cannot build here: bits other than 8 or 4, a device other
    than the CPU, a missing torchao, an int4 kernel that does not run on this machine."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"quantized copy: bits must be 8 or 4 (int8 or int4 weights), "
                         f"got {bits!r}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized copy: runs on the CPU only (torchao's int8/int4 CPU "
                         f"kernels), the target is on {device}; use device=cpu")
    _torchao()
    failure = int4_failure() if bits == 4 else None
    if failure is not None:
        raise ValueError(f"quantized copy: int4 does not run on this machine (aten's "
                         f"_weight_int4pack_mm_for_cpu: {failure}); use bits 8, or "
                         f"torch==2.13.0 with {TORCHAO_FIX}")


@functools.cache
def int4_failure() -> str | None:
    """Why torchao's int4 CPU tensor does not multiply here, or None when it does (one
    32 x 32 product, tried once per process)."""
    try:
        layer = _quantized_linear(Linear(INT4_GROUP, INT4_GROUP, bias=False), 4)
        layer(torch.ones(1, INT4_GROUP))
    except (RuntimeError, AssertionError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return None


def linear_layers(model: nn.Module) -> Iterator[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, layer) for every selfspec Linear in model."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):
                yield parent, name, child


def _quantized_linear(layer: nn.Linear, bits: int) -> QuantizedLinear:
    weight = layer.weight.detach().to(COMPUTE_DTYPE)
    padding = -weight.shape[1] % (INT8_WIDTH_MULTIPLE if bits == 8 else INT4_GROUP)
    weight = F.pad(weight, (0, padding))  # zero columns, met by zero inputs
    return QuantizedLinear(_torchao_quantized(weight, bits), layer.bias, bits, padding)


def _torchao_quantized(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [N, K] as torchao's weight-only tensor, through its public `quantize_`."""
    torchao = _torchao()
    config = (torchao.Int8WeightOnlyConfig(set_inductor_config=False) if bits == 8 else
              torchao.PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP,
                                                     set_inductor_config=False))
    with torch.device("meta"):  # a holder only: quantize_ works on modules
        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    holder.weight = nn.Parameter(weight, requires_grad=False)
    with quiet_imports():  # quantize_ imports torchao's kernels, which warn without triton
        torchao.quantize_(holder, config)
    if not hasattr(holder.weight, "qdata"):  # torchao skips a shape it cannot quantize
        raise RuntimeError(f"torchao left a {list(weight.shape)} weight unquantized")
    return holder.weight


class _Torchao:
    """The torchao names this module uses, imported on first use (no import-time cost)."""

    def __init__(self) -> None:
        with quiet_imports():
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        self.quantize_ = quantize_
        self.Int8WeightOnlyConfig = Int8WeightOnlyConfig
        self.PrototypeInt4WeightOnlyConfig = PrototypeInt4WeightOnlyConfig


@functools.cache
def _torchao() -> _Torchao:
    try:
        return _Torchao()
    except ImportError as exc:
        raise ValueError(f"quantized copy: needs torchao ({exc}); {TORCHAO_FIX}") from None
