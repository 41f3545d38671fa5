"""The target's own weights, quantized weight-only to int8 or int4 by torchao: a draft model
for QSpec-style drafting (a quantized copy of the target drafts, the full-precision target
verifies). `quantized_copy` builds it; `SmallModelDrafter` drafts with it like with any other
draft model (its own KV cache), and the shared exact verifier keeps the output the target's,
however far the copy's logits are from the target's.

Each device has its layouts (`layout_for`): on the CPU, aten's int8 kernel over torchao's
per-row int8 weights and torchao's opaque int4 layout (groups of 32,
`_weight_int4pack_mm_for_cpu`); on a CUDA GPU, aten's int8 kernel where the CUDA build has one
(else torchao's own int8 product, which widens the weight at each call) and torchao's
tile-packed int4 layout for tinygemm's kernel (`_weight_int4pack_mm`, groups of 128, compute
capability 8.0 or newer). The weight-only kernels want bf16 activations (on the CPU, with fp32
ones they ran 9-20x slower than the fp32 product they replace: scripts/bench_quantized.py), so
every quantized linear takes its rows in bf16, quantized from the bf16 rounding of the weight,
and hands its output back in the input's dtype; the embedding, the norms, attention and the
KV cache stay the target's (fp32 or bf16).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checks import is_int_in
from selfspec.model import Linear, Transformer
from selfspec.quiet import quiet_imports

BITS = (8, 4)
COMPUTE_DTYPE = torch.bfloat16  # the activations dtype the weight-only kernels take
# int4 scales and zero points per this many input columns on the CPU (its kernel takes
# 32-256); the finest group drafts closest to the target at about the same speed
# (bench_quantized.py).
INT4_GROUP = 32
# On CUDA: tinygemm's groups (32-256 run); 128, torchao's default there, halves the scales'
# reads of 64 at a step of 2 (int4: a coarser grid than the CPU's).
CUDA_INT4_GROUP = 128
CUDA_INT4_CAPABILITY = (8, 0)  # tinygemm's tensor-core kernel
# aten's int8 CPU kernel reads the input width in blocks of 16 once it has 4 rows or more (it
# crashed the process on widths 8, 24, 40 and 56): narrower weights are widened with zeros.
INT8_WIDTH_MULTIPLE = 16
TORCHAO_FIX = "pip install torchao==0.18.0"


@dataclass(frozen=True)
class Layout:
    """How a weight is quantized and multiplied on one kind of device.

    bits: 8 or 4; width_multiple: the input width is widened with zero columns to a multiple
    of it (an int4 group, the int8 CPU kernel's block); product: "int8pack" (aten's
    `_weight_int8pack_mm` on torchao's int8 data and per-row scales) or "torchao" (F.linear
    on torchao's tensor, which calls its layout's kernel); torchao_config: the name of the
    config `quantize_` takes, and its keyword arguments."""

    name: str
    bits: int
    width_multiple: int
    product: str
    torchao_config: str
    config_kwargs: tuple[tuple[str, object], ...] = ()


CPU_INT8 = Layout("int8 per row, aten's int8pack kernel", 8, INT8_WIDTH_MULTIPLE, "int8pack",
                  "Int8WeightOnlyConfig")
CUDA_INT8 = Layout("int8 per row, aten's int8pack kernel (CUDA)", 8, INT8_WIDTH_MULTIPLE,
                   "int8pack", "Int8WeightOnlyConfig")
# Where the CUDA build has no int8pack kernel: torchao's product, which widens the int8
# weight to bf16 at each call (exact, but it reads more than the bf16 weight would).
CUDA_INT8_WIDENED = Layout("int8 per row, torchao's product (the weight widened each call)", 8,
                           INT8_WIDTH_MULTIPLE, "torchao", "Int8WeightOnlyConfig")
CPU_INT4 = Layout(f"int4 groups of {INT4_GROUP}, torchao's opaque CPU layout", 4, INT4_GROUP,
                  "torchao", "PrototypeInt4WeightOnlyConfig", (("group_size", INT4_GROUP),))
CUDA_INT4 = Layout(f"int4 groups of {CUDA_INT4_GROUP}, torchao's tile-packed layout "
                   f"(tinygemm)", 4, CUDA_INT4_GROUP, "torchao", "Int4WeightOnlyConfig",
                   (("group_size", CUDA_INT4_GROUP),
                    ("int4_packing_format", "tile_packed_to_4d")))


def layout_for(bits: int, device: torch.device | str) -> Layout:
    """The layout a quantized copy on `device` uses (see the module's docstring); a device
    that is neither the CPU nor a CUDA GPU is refused."""
    device = _checked_device(device)
    if device.type == "cpu":
        return CPU_INT8 if bits == 8 else CPU_INT4
    if bits == 4:
        return CUDA_INT4
    return CUDA_INT8 if int8pack_failure(str(device)) is None else CUDA_INT8_WIDENED


class QuantizedLinear(nn.Module):
    """A linear layer over a torchao weight-only tensor: the one place a quantized copy's
    products run, each kernel called explicitly rather than left to `Linear.forward`, whose
    few-row `W @ x.T` torchao's tensors do not implement (aten.matmul: NotImplementedError).

    int8: torchao's `Int8Tensor` (per output row, symmetric), multiplied by aten's
    `_weight_int8pack_mm` on its int8 data (torchao 0.18's own int8 product converts the
    whole weight to float at every call; it serves only a CUDA build without that kernel).
    int4: torchao's opaque CPU tensor (groups of INT4_GROUP) or tile-packed CUDA tensor
    (groups of CUDA_INT4_GROUP), asymmetric, multiplied through `F.linear`, which torchao
    sends to `_weight_int4pack_mm_for_cpu` or tinygemm's `_weight_int4pack_mm`. `padding`:
    zero input columns the weight was widened by so that an int4 group, or the int8 kernel's
    block of 16, divides its width (the rows get zeros there: the product is unchanged).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout,
                 padding: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.layout, self.bits, self.padding = layout, layout.bits, padding
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1] - padding
        # _weight_int8pack_mm takes one scale per output row, in the activations' dtype.
        self.register_buffer("scale", None if layout.product != "int8pack" else
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
        if self.layout.product == "int8pack":
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
                f"{self.layout.name}, bias={self.bias is not None}")


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


def quantized_copy(target: Transformer, bits: int, layout: Layout | None = None) -> Transformer:
    """A deep copy of `target` whose linear layers (attention, MLP and the LM head) hold
    int8 or int4 weight-only quantizations of the target's weights (`QuantizedLinear`), on the
    target's device, in its layout there (`layout_for`, or `layout`); the embedding and norms
    are copied as they are. A tied LM head is untied
    in the copy: its head is the quantized embedding matrix, its embedding table stays full
    precision. The target is not changed. No I/O."""
    device = target.embed_tokens.weight.device
    check_quantizable(bits, device)
    if target.config.num_experts:
        raise ValueError(f"quantized copy: a {target.config.model_type} target's experts are "
                         f"stacked tensors, not linear layers, and are not quantized; draft "
                         f"with a dense model (draft: small_model) instead")
    layout = layout or layout_for(bits, device)
    if layout.bits != bits:
        raise ValueError(f"quantized copy: the layout {layout.name!r} holds int{layout.bits} "
                         f"weights, not int{bits}")
    quantized = copy.deepcopy(target)
    for parent, name, layer in list(linear_layers(quantized)):
        setattr(parent, name, _quantized_linear(layer, layout))
    # Its products round activations to bf16, so, as a bf16 model, a forward over several rows
    # may break a near-tie of its logits otherwise than a one-row forward: the lossless check
    # reads this to count such divergences as the dtype's near-ties (measure.divergence).
    quantized.products_dtype = COMPUTE_DTYPE
    return quantized.eval()


def check_quantizable(bits: int, device: torch.device | str) -> None:
    """Refuse what `quantized_copy` cannot build here: bits other than 8 or 4, a device other
    than the CPU or a CUDA GPU, a missing torchao, an int4 kernel that does not run on this
    machine (on CUDA: a GPU older than compute capability 8.0)."""
    if not is_int_in(bits, BITS):
        raise ValueError(f"quantized copy: bits must be 8 or 4 (int8 or int4 weights), "
                         f"got {bits!r}")
    device = _checked_device(device)
    _torchao()
    if bits != 4:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < CUDA_INT4_CAPABILITY:
            raise ValueError(f"quantized copy: int4 on CUDA runs tinygemm's kernel, which needs "
                             f"compute capability {CUDA_INT4_CAPABILITY[0]}.0 or newer; "
                             f"{torch.cuda.get_device_name(device)} has "
                             f"{capability[0]}.{capability[1]}: use bits 8")
    failure = int4_failure(str(device))
    if failure is not None:
        raise ValueError(f"quantized copy: int4 does not run on this machine ({failure}); use "
                         f"bits 8, or torch==2.13.0 with {TORCHAO_FIX}")


def _checked_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantized copy: runs on the CPU or a CUDA GPU (torchao's int8/int4 "
                         f"kernels), the target is on {device}; use device=cpu or device=cuda")
    return device


@functools.cache
def int4_failure(device: str = "cpu") -> str | None:
    """Why torchao's int4 tensor does not multiply on `device`, or None when it does (one
    small product, tried once per process and device)."""
    layout = layout_for(4, device)
    return _failure(lambda: _quantized_linear(
        Linear(layout.width_multiple, 32, bias=False).to(device), layout)(
        torch.ones(1, layout.width_multiple, device=device)))


@functools.cache
def int8pack_failure(device: str) -> str | None:
    """Why aten's int8 weight-only kernel does not run on `device`, or None when it does (one
    small product, tried once per process and device)."""
    rows = torch.ones(4, INT8_WIDTH_MULTIPLE, dtype=COMPUTE_DTYPE, device=device)
    weight = torch.ones(8, INT8_WIDTH_MULTIPLE, dtype=torch.int8, device=device)
    scale = torch.ones(8, dtype=COMPUTE_DTYPE, device=device)
    return _failure(lambda: torch.ops.aten._weight_int8pack_mm(rows, weight, scale))


def _failure(product) -> str | None:
    try:
        product()
    except (RuntimeError, AssertionError, NotImplementedError, ValueError) as exc:
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return None


def linear_layers(model: nn.Module) -> Iterator[tuple[nn.Module, str, Linear]]:
    """(parent, attribute, layer) for every selfspec Linear in model."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, Linear):
                yield parent, name, child


def _quantized_linear(layer: nn.Linear, layout: Layout) -> QuantizedLinear:
    weight = layer.weight.detach().to(COMPUTE_DTYPE)
    padding = -weight.shape[1] % layout.width_multiple
    weight = F.pad(weight, (0, padding))  # zero columns, met by zero inputs
    return QuantizedLinear(_torchao_quantized(weight, layout), layer.bias, layout, padding)


def _torchao_quantized(weight: torch.Tensor, layout: Layout) -> torch.Tensor:
    """weight [N, K] as torchao's weight-only tensor, through its public `quantize_`."""
    torchao = _torchao()
    config = getattr(torchao, layout.torchao_config)(set_inductor_config=False,
                                                     **dict(layout.config_kwargs))
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
            from torchao.quantization import (
                Int4WeightOnlyConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )
        self.quantize_ = quantize_
        self.Int8WeightOnlyConfig = Int8WeightOnlyConfig
        self.Int4WeightOnlyConfig = Int4WeightOnlyConfig
        self.PrototypeInt4WeightOnlyConfig = PrototypeInt4WeightOnlyConfig


@functools.cache
def _torchao() -> _Torchao:
    try:
        return _Torchao()
    except ImportError as exc:
        raise ValueError(f"quantized copy: needs torchao ({exc}); {TORCHAO_FIX}") from None
