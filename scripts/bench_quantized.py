"""Which torchao weight-only quantizations run on this CPU, and a target's one-token forward
with each against fp32: the arms `selfspec.model.quantized` chose between, alternating round by
round in one process.

    python scripts/bench_quantized.py --models tiny smollm2-135m \
        --out docs/results/quantized/bench_quantized.json

Three parts:
- configs: each torchao weight-only config on one linear of the model's MLP shape, with fp32
  and bf16 weights: whether it runs, the tensor it makes, its relative error.
- kernels: one product over one row of that shape (microseconds, median): fp32 `F.linear`,
  torchao's products, aten's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` with fp32
  and bf16 activations.
- forwards: the whole model's one-token forward over a cache of --cache-length tokens
  (milliseconds, median of --rounds rounds of 5), and the relative error of its logits.
The machine may be shared: the figures are noisy; compare arms within one run only.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from selfspec.from_config.models import load_target
from selfspec.model import Transformer, quantized

CONF = Path(__file__).resolve().parents[1] / "conf"
BF16 = torch.bfloat16


# ---- configs: which run here ---------------------------------------------------------------


def torchao_configs() -> dict[str, Callable[[], object]]:
    """torchao 0.18's weight-only configs, by name (built lazily: some fail to build)."""
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from torchao.quantization import IntxWeightOnlyConfig as Intx

    off = {"set_inductor_config": False}
    return {
        "Int8WeightOnlyConfig": lambda: Int8WeightOnlyConfig(**off),
        "IntxWeightOnlyConfig(int8)": lambda: Intx(weight_dtype=torch.int8),
        "IntxWeightOnlyConfig(int4, group 32)": lambda: Intx(
            weight_dtype=torch.int4, granularity=_per_group(32)),
        "IntxWeightOnlyConfig(int4, opaque_torchao_auto)": lambda: Intx(
            weight_dtype=torch.int4, granularity=_per_group(32),
            intx_packing_format="opaque_torchao_auto"),
        "Int4WeightOnlyConfig(plain)": lambda: Int4WeightOnlyConfig(group_size=32, **off),
        "Int4WeightOnlyConfig(tile_packed_to_4d)": lambda: Int4WeightOnlyConfig(
            group_size=32, int4_packing_format="tile_packed_to_4d", **off),
        "Int4WeightOnlyConfig(plain_int32)": lambda: Int4WeightOnlyConfig(
            group_size=32, int4_packing_format="plain_int32", **off),
        "PrototypeInt4WeightOnlyConfig(group 32)": lambda: PrototypeInt4WeightOnlyConfig(
            group_size=32, **off),
    }


def _per_group(size: int):
    from torchao.quantization.granularity import PerGroup

    return PerGroup(size)


def check_configs(out_features: int, in_features: int) -> dict[str, dict]:
    """Each config on one [out, in] linear, fp32 and bf16 weights: the tensor it made and its
    relative error over 4 rows, or why it failed."""
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    weight, rows = torch.randn(out_features, in_features), torch.randn(4, in_features)
    found = {}
    for name, make in torchao_configs().items():
        for dtype in (torch.float32, BF16):
            layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            layer.weight.data.copy_(weight)
            try:
                quantize_(layer, make())
                got = F.linear(rows.to(dtype), layer.weight).float()
                error = float((got - rows @ weight.t()).norm() / (rows @ weight.t()).norm())
                found[f"{name}, {_short(dtype)}"] = {
                    "runs": True, "quantized": type(layer.weight) is not nn.Parameter,
                    "tensor": type(layer.weight).__name__, "relative_error": round(error, 4)}
            except Exception as exc:  # noqa: BLE001 - a failure is the finding
                found[f"{name}, {_short(dtype)}"] = {
                    "runs": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    return found


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- kernels: one product over one row ------------------------------------------------------


def kernel_products(out_features: int, in_features: int) -> dict[str, Callable[[], object]]:
    """One-row products of an [out, in] weight, by name."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    q8 = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    arms: dict[str, Callable[[], object]] = {}
    x32 = torch.randn(1, in_features)
    arms["fp32 F.linear"] = lambda: F.linear(x32, weight)
    for dtype in (torch.float32, BF16):
        x, scale = x32.to(dtype), torch.rand(out_features, dtype=dtype)
        int8 = _layer(weight.to(dtype), 8)
        int4 = _layer(weight.to(dtype), 4)
        arms[f"aten _weight_int8pack_mm, {_short(dtype)} rows"] = (
            lambda x=x, scale=scale: torch.ops.aten._weight_int8pack_mm(x, q8, scale))
        arms[f"torchao Int8Tensor F.linear, {_short(dtype)} rows"] = (
            lambda x=x, w=int8.weight: F.linear(x, w))
        arms[f"torchao Int4OpaqueTensor F.linear (_weight_int4pack_mm_for_cpu), "
             f"{_short(dtype)} rows"] = lambda x=x, w=int4.weight: F.linear(x, w)
    return arms


def _layer(weight: torch.Tensor, bits: int) -> nn.Module:
    """torchao's quantization of weight, in a plain nn.Linear (its own F.linear dispatch)."""
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    config = (Int8WeightOnlyConfig(set_inductor_config=False) if bits == 8 else
              PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    quantize_(layer, config)
    return layer


def time_kernels(arms: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Microseconds per call, the median over rounds of the mean of 20 calls; arms alternate."""
    laps: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, product in arms.items():
            product()
            start = time.perf_counter()
            for _ in range(20):
                product()
            laps[name].append(1e6 * (time.perf_counter() - start) / 20)
    return {name: round(statistics.median(t), 1) for name, t in laps.items()}


# ---- forwards: the whole model --------------------------------------------------------------


class TorchaoLinear(nn.Module):
    """A linear over torchao's weight as torchao runs it (`F.linear` on its tensor), its rows
    in `dtype`: the arms the chosen `QuantizedLinear` was measured against."""

    def __init__(self, layer: nn.Linear, bits: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = _layer(layer.weight.detach().to(dtype), bits), dtype
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.to(self.dtype)).to(x.dtype)
        return out if self.bias is None else out + self.bias


def with_layers(target: Transformer, make: Callable[[nn.Linear], nn.Module]) -> Transformer:
    copied = copy.deepcopy(target)
    for parent, name, layer in list(quantized.linear_layers(copied)):
        setattr(parent, name, make(layer))
    return copied


def forward_arms(target: Transformer, slow: bool) -> dict[str, Transformer]:
    """The models to time: fp32, selfspec.model.quantized's copies (int4 at each group size), and
    torchao's own F.linear products with bf16 rows (with fp32 rows too when `slow`)."""
    arms = {"fp32": target, "int8 (selfspec.model.quantized: aten int8pack, bf16 rows)":
            quantized.quantized_copy(target, 8)}
    chosen = quantized.INT4_GROUP
    for group in (32, 64, 128):
        quantized.INT4_GROUP = group
        arms[f"int4 group {group} (selfspec.model.quantized: int4pack_mm_for_cpu, bf16 rows)"] = (
            quantized.quantized_copy(target, 4))
    quantized.INT4_GROUP = chosen
    fits_int4 = all(layer.in_features % 32 == 0 for *_, layer in quantized.linear_layers(target))
    for dtype in (BF16, torch.float32) if slow else (BF16,):
        arms[f"int8 torchao Int8Tensor F.linear, {_short(dtype)} rows"] = with_layers(
            target, lambda layer, d=dtype: TorchaoLinear(layer, 8, d))
        if fits_int4:  # torchao's int4 leaves a width no group divides unquantized
            arms[f"int4 torchao Int4OpaqueTensor F.linear, {_short(dtype)} rows"] = with_layers(
                target, lambda layer, d=dtype: TorchaoLinear(layer, 4, d))
    return arms


@torch.inference_mode()
def time_forwards(arms: dict[str, Transformer], rounds: int, cache_length: int) -> dict:
    """Per arm: ms of a one-token forward over a cache of cache_length random tokens (median
    over rounds of the median of 5), its logits' relative error against fp32's and whether
    its argmax agrees, over the cache's tokens."""
    vocab = arms["fp32"].config.vocab_size
    tokens = torch.randint(vocab, (1, cache_length + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(cache_length + 1)
    caches = {name: model.new_cache(max_slots=cache_length + 1) for name, model in arms.items()}
    logits = {name: model(tokens[:, :-1], positions[:-1], caches[name]).logits[0]
              for name, model in arms.items()}
    laps: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, model in arms.items():
            one = []
            for _ in range(5):
                start = time.perf_counter()
                model(tokens[:, -1:], positions[-1:], caches[name])
                one.append(time.perf_counter() - start)
                caches[name].truncate(cache_length)
            laps[name].append(1000 * statistics.median(one))
    reference = logits["fp32"]
    return {name: {"ms": round(statistics.median(laps[name]), 3),
                   "relative_error": round(float((got - reference).norm() / reference.norm()), 4),
                   "argmax_agrees": round(float((got.argmax(-1) == reference.argmax(-1))
                                                .float().mean()), 3)}
            for name, got in logits.items()}


# ---- the run ----------------------------------------------------------------------------------


def bench(model: str, rounds: int, cache_length: int, slow: bool) -> dict:
    with initialize_config_dir(str(CONF), version_base=None):
        target = load_target(compose("generate", overrides=[f"model={model}"])).eval()
    config = target.config
    shape = (config.intermediate_size, config.hidden_size)  # gate_proj / up_proj
    return {"configs": check_configs(*shape),
            "kernels_us": {f"{shape[0]}x{shape[1]}": time_kernels(kernel_products(*shape),
                                                                  rounds)},
            "forward": time_forwards(forward_arms(target, slow), rounds, cache_length)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny"], help="conf/model names")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slow", action="store_true",
                        help="also time torchao's products on fp32 rows (10-20x slower)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_quantized.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quantized.check_quantizable(8, "cpu")  # torchao imported, quietly
    results = {"torch": torch.__version__, "torchao": _torchao_version(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "threads": args.threads, "rounds": args.rounds,
               "cache_length": args.cache_length,
               "note": "a shared 2-core machine: noisy; compare arms within one run",
               "models": {}}
    for model in args.models:
        results["models"][model] = found = bench(model, args.rounds, args.cache_length,
                                                 args.slow)
        report(model, found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def _torchao_version() -> str:
    from importlib.metadata import version

    return version("torchao")


def report(model: str, found: dict) -> None:
    print(f"== {model}")
    for name, row in found["configs"].items():
        print(f"  config {name}: " + (f"fails ({row['error']})" if not row["runs"] else
                                      f"{row['tensor']}, relative error {row['relative_error']}"
                                      + ("" if row["quantized"] else " (left unquantized)")))
    for shape, arms in found["kernels_us"].items():
        for name, us in arms.items():
            print(f"  kernel {shape} {name}: {us} us")
    fp32 = found["forward"]["fp32"]["ms"]
    for name, row in found["forward"].items():
        print(f"  forward {name}: {row['ms']:.2f} ms ({row['ms'] / fp32:.2f}x fp32), "
              f"relative error {row['relative_error']}, argmax agrees {row['argmax_agrees']}")


if __name__ == "__main__":
    main()
