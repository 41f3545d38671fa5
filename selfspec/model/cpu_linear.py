"""`Linear`: nn.Linear with the CPU's faster few-row products (a decode step, a draft, a
verification), and `linear`, the same product for weights held outside a Linear.

scripts/bench_linear.py and scripts/bench_one_row.py measure the arms by setting this module's
thresholds and `linear`."""

from __future__ import annotations

import logging
import math
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checks import check_count

# CPU products over at most this many rows run as W @ x.T, or on oneDNN's packed copy of the
# weight from PACKED_FROM_ROWS rows on (see `Linear`).
FEW_ROWS_ON_CPU = 128
PACKED_FROM_ROWS = 3
PACKED_FOR_ROWS = 8  # the row count oneDNN lays the packed copy out for (any count runs on it)
# Weights this small may take the elementwise form (see `invariant_form`): its 128-row
# product holds 128 x this many terms at once (8 MB).
ELEMENTWISE_MAX_WEIGHT = 16_384
# A Transformer packs its weights only when they are this large in all: a model that fits in a
# CPU's last-level cache (the 32 MB tiny target) ran 3-5 rows faster as W @ x.T; one whose
# weights stream from memory every forward (SmolLM2, 538 MB) ran them far faster packed.
PACKED_FROM_MODEL_BYTES = 64 << 20
# `few_row_form` times a weight's forms over copies of it that fill this much (and at most this
# many copies), more than a CPU's last-level cache holds.
STREAMED_BYTES = 64 << 20
STREAMED_COPIES = 64
# The exact mode (`use_invariant_products`): off the CPU's fp32 forms, a product runs in blocks
# of exactly this many rows, the last padded with zeros, so that one kernel of one shape sums
# every row whatever rows came with it. On an H200 cuBLAS summed a row of a 64-row product in
# another order than the same row alone (docs/gpu.md, "A compiled step"); 64 holds a 60-node
# tree in one block, at the cost of a one-token step computing 64 rows (c(64) was 1.15 there).
INVARIANT_BLOCK_ROWS = 64
log = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear that, on the CPU in float32, computes a product over few rows (a decode step, a
    draft, a verification) its own way, because MKL's speed over few rows depends on the form
    of the product and on the CPU (scripts/bench_linear.py measures the arms):

    - up to 128 rows in a form whose rows come out the same bits however many come together
      (`invariant_form`: `(W @ x.T).T`, a single row twice, where that holds on this CPU, else
      the packed copy below), or, for one or two rows of a layer with `packed_products`,
      MKL's `x @ W.T` where that streams its weight faster on this CPU (`linear`);
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
        self.invariant_rows: int | None = None  # the exact mode's block (`invariant_linear`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant_rows is not None:
            packed = self.packed if self.packed_products else None
            return invariant_linear(x, self.weight, self.bias, self.invariant_rows, packed)
        rows = x.numel() // self.in_features
        if self.packed_products and PACKED_FROM_ROWS <= rows and _few_rows_on_cpu(x, rows) \
                and _packable():
            return _packed_product(x, self.packed.of(self.weight), self.bias)
        return linear(x, self.weight, self.bias, fastest=self.packed_products, packed=self.packed)


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


def use_invariant_products(module: nn.Module, block_rows: int | None) -> None:
    """The exact mode: every module in module that has one (`invariant_rows`: a `Linear`'s
    products, `invariant_linear`; attention, `exact_mode.invariant_attention`) computes
    each row with the same bits whatever rows come with it, at any row count, on any device
    (in blocks of block_rows off the CPU's fp32); None: the fastest forms again."""
    if block_rows is not None:
        check_count("block_rows", block_rows, owner="use_invariant_products")
    for layer in module.modules():
        if hasattr(layer, "invariant_rows"):
            layer.invariant_rows = block_rows


def invariant_rows_of(module: nn.Module) -> int | None:
    """The exact mode's block of rows module's products run in (None: off)."""
    return next((layer.invariant_rows for layer in module.modules()
                 if isinstance(layer, Linear)), None)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     block_rows: int, packed: PackedWeight | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the others, at any row
    count: on the CPU in fp32 in the form `invariant_form` found (one or two rows too, which
    `linear` may give a faster form), FEW_ROWS_ON_CPU rows at a time; elsewhere in blocks of
    exactly block_rows rows, the last padded with zeros (`_fixed_shape_product`)."""
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features)
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and len(flat):
        out = torch.cat([_invariant_product(chunk.contiguous(), weight, packed)
                         for chunk in flat.split(FEW_ROWS_ON_CPU)])
    else:
        out = _fixed_shape_product(flat, weight, block_rows)
    if bias is not None:
        out = out + bias  # elementwise: each row's own
    return out.reshape(*x.shape[:-1], out_features)


def _fixed_shape_product(rows: torch.Tensor, weight: torch.Tensor, block_rows: int
                         ) -> torch.Tensor:
    """rows @ weight.T as products of block_rows rows each: one shape, so one kernel whose
    sums run in one order for each row, whatever its neighbours hold."""
    count = rows.shape[0]
    padded = -(-count // block_rows) * block_rows
    if padded != count:
        rows = torch.cat((rows, rows.new_zeros(padded - count, rows.shape[1])))
    blocks = [F.linear(block.contiguous(), weight) for block in rows.split(block_rows)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out[:count]


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: it keeps no version counter
        return -1


def _packable() -> bool:
    """oneDNN is there and autograd is off (no_grad, inference_mode): what decoding runs under.
    Whether a weight requires grad does not matter, so freezing a model never changes its bits."""
    return not torch.is_grad_enabled() and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fastest: bool = False, packed: PackedWeight | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed the way `Linear` computes it (for heads that keep
    a weight of their own, such as a draft vocabulary's rows of an LM head).

    Few CPU rows take the form `invariant_form` found for the weight's shape, whose rows come
    out the same bits however many came with them (packed: the weight's packed copy, if that
    is the form; else one kept beside the weight). With `fastest` (a model whose weights
    stream from memory, the one whose products of 3 rows or more take the packed copy:
    `Linear`) one or two rows take instead the fastest of `W @ x.T`, MKL's own `x @ W.T` and
    the packed product for the weight's shape and row count, timed reading the weight from
    memory (`few_row_form`), since which is faster differs from one CPU to another: on one
    Xeon host `W @ x.T` ran SmolLM2's 49,152 x 576 LM head three times as fast as MKL's
    matrix-vector product (plain decoding 1.3x faster); on another the latter ran it 3x
    faster, Gemma 3's 262,144 x 640 LM head 2.5x faster, and plain decoding twice as fast. A
    one-row product's bits may then differ from the same row's among others, unless the
    invariant form is the one taken (as it is when it runs within FEW_ROW_TIE of the
    fastest)."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if not _few_rows_on_cpu(x, rows):
        return F.linear(x, weight, bias)
    # Row-major rows: an MLP's output can arrive column-major (it follows the layout of the
    # transposed products before it), and MKL took 5x as long over that layout.
    flat = x.reshape(rows, in_features).contiguous()
    if fastest and rows <= 2:
        out = _few_row_product(few_row_form(weight, rows), flat, weight, packed)
    else:
        out = _invariant_product(flat, weight, packed)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


def _invariant_product(rows: torch.Tensor, weight: torch.Tensor,
                       packed: PackedWeight | None) -> torch.Tensor:
    """The product in the form found for the weight's shape (`invariant_form`, looked up
    once). A compiled step keeps W @ x.T (inductor cannot lower oneDNN's op), and so does a
    forward that trains."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return _transposed(rows, weight)
    form = invariant_form(weight)
    if form == "packed":  # probed only where oneDNN is there
        packed = packed if packed is not None else _packed_copy(weight)
        return _packed_product(rows, packed.of(weight))
    if form == "elementwise":
        return _elementwise(rows, weight)
    return _transposed(rows, weight)


def _transposed(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] == 1:  # twice, doubled by cat: repeat's generic strided copy made
        # SmolLM2's one-token forward 9-13% slower (the same bits; scripts/bench_one_row.py)
        return (weight @ torch.cat((rows, rows)).t())[:, :1].t()
    return (weight @ rows.t()).t().contiguous()  # row-major: SDPA's fused kernel needs it


def _elementwise(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each output as its own sum of products over the input: for weights of at most
    ELEMENTWISE_MAX_WEIGHT elements, where oneDNN's and MKL's calls cost several times the
    arithmetic (a 32 x 32 product: 20 us against 50 us packed, on an AVX2 EPYC host)."""
    return (rows[:, None, :] * weight[None]).sum(-1)  # [rows, out]


def _packed_product(rows: torch.Tensor, packed: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _few_row_product(form: str, rows: torch.Tensor, weight: torch.Tensor,
                     packed: PackedWeight | None) -> torch.Tensor:
    if form == "mkl":
        return rows @ weight.t()
    if form == "packed":
        return _packed_product(rows, (packed or _packed_copy(weight)).of(weight))
    return _transposed(rows, weight)


FEW_ROW_FORMS = ("transposed", "mkl", "packed")  # packed: where oneDNN is there
# A one- or two-row product takes the invariant form unless another runs this much faster:
# then a plain decoding step's row comes out the bits a verification's does.
FEW_ROW_TIE = 1.1
_CHOSEN: dict[tuple, str] = {}
_INVARIANT: dict[tuple, str] = {}
_PACKED_COPIES: dict[int, PackedWeight] = {}  # by the id of a weight alive
PROBED_ROWS = (1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 64, 128)


def invariant_form(weight: torch.Tensor) -> str:
    """"elementwise" (each output summed on its own; weights of at most
    ELEMENTWISE_MAX_WEIGHT elements only, where it is the cheapest), "transposed" (`W @ x.T`,
    one row twice) or "packed" (oneDNN's inner product over the weight packed for 8 rows):
    the first whose rows of a product come out the same bits as each row alone, over 1-128
    rows, for this weight's shape at this thread count, probed once on a random weight of
    that shape. Which holds depends on the CPU: on Xeon hosts `W @ x.T` does; on an AVX2 EPYC
    host MKL sums 1-3, 4-11 and 12 or more rows three ways, while the packed product kept its
    bits. Where none holds (or oneDNN is missing), "transposed", with a warning: greedy
    decoding then equals plain decoding up to near-ties. The elementwise and packed forms run
    with autograd off (decoding); a forward that trains takes `W @ x.T`."""
    key = (tuple(weight.shape), torch.get_num_threads())
    if key not in _INVARIANT:
        _INVARIANT[key] = _probe_invariant_form(*weight.shape)
    return _INVARIANT[key]


def _probe_invariant_form(out_features: int, in_features: int) -> str:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(FEW_ROWS_ON_CPU, in_features, generator=generator)
    forms = {}
    if out_features * in_features <= ELEMENTWISE_MAX_WEIGHT:
        forms["elementwise"] = lambda rows: _elementwise(rows, weight)
    forms["transposed"] = lambda rows: _transposed(rows, weight)
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        forms["packed"] = lambda rows: _packed_product(rows, packed)
    with torch.no_grad():
        for name, product in forms.items():
            alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
            if all(torch.equal(product(x[:n]), alone[:n]) for n in PROBED_ROWS):
                return name
    log.warning("this CPU's products of %d x %d weights give a row other bits among other "
                "rows than alone: greedy speculative decoding equals plain decoding up to "
                "near-ties", out_features, in_features)
    return "transposed"


def _packed_copy(weight: torch.Tensor) -> PackedWeight:
    """The packed copy kept beside a weight held outside a `Linear` (gone with the weight)."""
    key = id(weight)
    if key not in _PACKED_COPIES:
        _PACKED_COPIES[key] = PackedWeight()
        weakref.finalize(weight, _PACKED_COPIES.pop, key, None)
    return _PACKED_COPIES[key]


def few_row_form(weight: torch.Tensor, rows: int = 1) -> str:
    """The form of FEW_ROW_FORMS a product of `rows` (1 or 2) rows by this weight's shape takes
    at this thread count: the fastest, timed the first time (best of three runs, after one),
    then kept; the invariant form where it runs within FEW_ROW_TIE of it. Each form is timed
    over copies of the weight that fill STREAMED_BYTES, so that it reads them from memory as a
    model too large for the CPU's caches does: a single weight timed again and again stays in
    the cache, where MKL's matrix-vector product won on an AVX-512 EPYC host and then ran a
    SmolLM2 step's products at half the speed of the packed ones (58 against 28 ms)."""
    key = (tuple(weight.shape), torch.get_num_threads(), rows)
    if key not in _CHOSEN:
        with torch.no_grad():
            seconds = _streamed_seconds(weight.detach(), rows)
        fastest = min(seconds.values())
        invariant = invariant_form(weight)
        _CHOSEN[key] = invariant if seconds.get(invariant, math.inf) <= FEW_ROW_TIE * fastest \
            else min(seconds, key=seconds.get)
    return _CHOSEN[key]


def streamed_copies(weight: torch.Tensor) -> int:
    """How many copies of the weight `few_row_form` times a form over: as many as fill
    STREAMED_BYTES, at least one, at most STREAMED_COPIES."""
    size = weight.numel() * weight.element_size()
    return max(1, min(STREAMED_COPIES, STREAMED_BYTES // size))


def _streamed_seconds(weight: torch.Tensor, rows: int) -> dict[str, float]:
    """Each form's seconds for `rows` rows times every one of as many random copies of the
    weight as fill STREAMED_BYTES (at least one, at most STREAMED_COPIES)."""
    generator = torch.Generator().manual_seed(0)
    copies = [torch.randn(weight.shape, generator=generator).to(weight)
              for _ in range(streamed_copies(weight))]
    x = torch.randn(rows, weight.shape[1], generator=generator).to(weight)
    forms = [form for form in FEW_ROW_FORMS
             if form != "packed" or torch.backends.mkldnn.is_available()]
    packed = [PackedWeight() for _ in copies] if "packed" in forms else []
    return {form: _seconds(lambda form=form: [
        _few_row_product(form, x, w, packed[i] if packed else None)
        for i, w in enumerate(copies)]) for form in forms}


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
