"""`Linear`: nn.Linear with the CPU's faster few-row products (a decode step, a draft, a
verification), and `linear`, the same product for weights held outside a Linear.

scripts/bench_linear.py and scripts/bench_one_row.py measure the arms by setting this module's
thresholds and `linear`."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

# CPU products over at most this many rows run as W @ x.T, or on oneDNN's packed copy of the
# weight from PACKED_FROM_ROWS rows on (see `Linear`).
FEW_ROWS_ON_CPU = 128
PACKED_FROM_ROWS = 3
PACKED_FOR_ROWS = 8  # the row count oneDNN lays the packed copy out for (any count runs on it)
# A Transformer packs its weights only when they are this large in all: a model that fits in a
# CPU's last-level cache (the 32 MB tiny target) ran 3-5 rows faster as W @ x.T; one whose
# weights stream from memory every forward (SmolLM2, 538 MB) ran them far faster packed.
PACKED_FROM_MODEL_BYTES = 64 << 20


class Linear(nn.Linear):
    """nn.Linear that, on the CPU in float32, computes a product over few rows (a decode step, a
    draft, a verification) its own way, because MKL's speed over few rows depends on the form
    of the product and on the CPU (scripts/bench_linear.py measures the arms):

    - up to 128 rows (below the packed copy's) in the faster of two forms, which differ from
      one CPU to another (`linear`): MKL's own `x @ W.T`, or `(W @ x.T).T` with a single row
      twice;
    - 3-128 rows on oneDNN's inner product over a copy of W packed into its blocked layout
      (made on first use, remade when W changes, never saved or copied): it streams the
      weight about as fast for 8 rows as for one, where W @ x.T took twice as long from three
      rows on (SmolLM2: a 4-token verification 1.35 -> 1.1 one-token forwards). The copy
      doubles the memory of the weights that verify drafts; only taken with autograd off, and
      only by a layer whose `packed_products` is set (`use_packed_products`: a Transformer
      sets it when its weights outgrow a CPU cache, PACKED_FROM_MODEL_BYTES).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()
        self.packed_products = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.packed_products and PACKED_FROM_ROWS <= rows and _few_rows_on_cpu(x, rows) \
                and _packable():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed.of(self.weight), self.bias,
                                                      "none", [], "")
        return linear(x, self.weight, self.bias)


class PackedWeight:
    """oneDNN's packed copy of a weight, remade when the weight is replaced or changed in place.
    Not module state: a deep copy of the module starts without one (oneDNN's opaque tensors
    cannot be copied), and state_dict never sees it."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tensor: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {"key": None, "tensor": None}

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight.data_ptr(), _version(weight), tuple(weight.shape))
        if key != self.key:
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                  PACKED_FOR_ROWS)
            self.key = key
        return self.tensor


def use_packed_products(module: nn.Module, enabled: bool) -> None:
    """Whether every `Linear` in module runs its 3-128-row CPU products on packed weights."""
    for layer in module.modules():
        if isinstance(layer, Linear):
            layer.packed_products = enabled


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: it keeps no version counter
        return -1


def _packable() -> bool:
    """oneDNN is there and autograd is off (no_grad, inference_mode): what decoding runs under.
    Whether a weight requires grad does not matter, so freezing a model never changes its bits."""
    return not torch.is_grad_enabled() and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed the way `Linear` computes it (for heads that keep
    a weight of their own, such as a draft vocabulary's rows of an LM head).

    Few CPU rows take the faster of two forms for their weight's shape, row count and thread
    count, timed on first use (`few_row_form`): on one Xeon host MKL's matrix-vector product
    streamed a 49152 x 576 LM head at a third of the speed of `W @ x.T` over the row twice
    (plain decoding ran 1.3x faster with the latter); on another the same product ran 3x
    faster than it, and Gemma 3's 262144 x 640 LM head 2.5x. The two forms sum in different
    orders: a process keeps the form it chose, so its products repeat bit for bit."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if not _few_rows_on_cpu(x, rows):
        return F.linear(x, weight, bias)
    # Row-major rows: an MLP's output can arrive column-major (it follows the layout of the
    # transposed products before it), and MKL took 5x as long over that layout.
    flat = x.reshape(rows, in_features).contiguous()
    out = FEW_ROW_FORMS[few_row_form(flat, weight)](flat, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


def _transposed(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if flat.shape[0] == 1:
        # A single row goes through twice (the matrix-vector product is the slow one where
        # this form wins). Doubled by cat, not repeat: repeat's generic strided copy made
        # SmolLM2's one-token forward 9-13% slower (scripts/bench_one_row.py).
        return (weight @ torch.cat((flat, flat)).t())[:, :1].t()
    return (weight @ flat.t()).t().contiguous()  # row-major, as SDPA's fused kernel needs


FEW_ROW_FORMS = {"mkl": lambda flat, weight: flat @ weight.t(), "transposed": _transposed}
_CHOSEN: dict[tuple, str] = {}


def few_row_form(flat: torch.Tensor, weight: torch.Tensor) -> str:
    """The faster form of FEW_ROW_FORMS for rows flat [R, in] times this weight's shape at
    this thread count: each timed (best of three runs, after one) on first use, then kept."""
    key = (tuple(weight.shape), flat.shape[0], torch.get_num_threads())
    if key not in _CHOSEN:
        with torch.no_grad():
            rows, w = flat.detach(), weight.detach()
            _CHOSEN[key] = min(FEW_ROW_FORMS, key=lambda name: _seconds(
                lambda: FEW_ROW_FORMS[name](rows, w)))
    return _CHOSEN[key]


def _seconds(product) -> float:
    product()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return min(times)


def _few_rows_on_cpu(x: torch.Tensor, rows: int) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and 0 < rows <= FEW_ROWS_ON_CPU


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a plain tensor [out, in]. A layer that stores it another way
    (a quantized one) gives it through its own `dense_weight()`; any other layer's is its
    `weight`."""
    return layer.dense_weight() if hasattr(layer, "dense_weight") else layer.weight


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or a copy of it where torch's allocator puts buffers (64-byte aligned) when
    it lies elsewhere, as tensors read from a safetensors file do. MKL's few-row products (see
    `Linear`) sum in an order that depends on the weight's alignment: without this, a model
    loaded from a file and a fresh copy of it would differ in the last bits."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % 64 == 0:
        return tensor
    return tensor.clone()
