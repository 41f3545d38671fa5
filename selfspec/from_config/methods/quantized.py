"""The target's quantized copy as a draft model (QSpec-style, `selfspec.model.quantized`): its own
weights, int8 or int4 weight-only, draft k tokens over the copy's own KV cache through
`SmallModelDrafter`, and the full-precision target verifies. Nothing to train or load: the
copy is built from the target in memory, once per bits setting.

Rows: quantized/int{b}[/top{W}][/stop{t}] for each b in quantized.bits (8 or 4), W in
quantized.first_candidates and t in quantized.confidence_threshold (as small_model's).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from selfspec.checks import is_count, is_int_in
from selfspec.drafters import SmallModelDrafter
from selfspec.drafters.confidence import check_confidence_threshold
from selfspec.from_config.common import as_list, device
from selfspec.from_config.methods.entry import Loaded, MethodEntry
from selfspec.measure.grid import Variant
from selfspec.model import Transformer
from selfspec.model.quantized import BITS, check_quantizable, quantized_copy

GROUP = "quantized"


@dataclass(frozen=True)
class QuantizedVariant(Variant):
    method: str = GROUP
    bits: int = 8
    first_candidates: int = 1
    confidence_threshold: float | None = None

    def label(self) -> str:
        return (f"{self.method}/int{self.bits}"
                + ("" if self.first_candidates == 1 else f"/top{self.first_candidates}")
                + ("" if self.confidence_threshold is None
                   else f"/stop{self.confidence_threshold:g}"))


def variants(cfg: DictConfig, for_sweep: bool = True) -> tuple[QuantizedVariant, ...]:
    group = cfg.get(GROUP) or {}
    bits = as_list(group.get("bits")) or [8]
    widths = as_list(group.get("first_candidates")) or [1]
    stops = as_list(group.get("confidence_threshold")) or [None]
    if not all(is_int_in(b, BITS) for b in bits):
        raise ValueError(f"{GROUP}.bits: give 8 or 4 (int8 or int4 weights of the target), "
                         f"got {bits}")
    if not all(map(is_count, widths)):
        raise ValueError(f"{GROUP}.first_candidates: give candidate counts >= 1 (1: a chain), "
                         f"got {widths}")
    stops = [check_confidence_threshold(GROUP, t) for t in stops]
    chosen = tuple(QuantizedVariant(bits=b, first_candidates=w, confidence_threshold=t)
                   for b in bits for w in widths for t in stops)
    if not for_sweep and len(chosen) > 1:
        raise ValueError(f"{GROUP}: its settings describe {len(chosen)} rows "
                         f"({', '.join(v.label() for v in chosen)}); give one value of "
                         f"{GROUP}.bits, first_candidates and confidence_threshold here (lists "
                         f"are for eval/sweep.py)")
    return chosen


def check(cfg: DictConfig, lengths: tuple[int, ...]) -> None:
    """Each bits setting builds here: the device is the CPU, torchao imports, int4's kernel
    runs on this machine (one small product)."""
    for bits in sorted({v.bits for v in variants(cfg)}):
        try:
            check_quantizable(bits, device(cfg))
        except ValueError as error:
            reason = str(error).removeprefix("quantized copy: ")
            raise ValueError(f"{GROUP}.bits={bits}: {reason}") from None


def copy_of(loaded: Loaded, bits: int) -> Transformer:
    """The target's int{bits} copy, built once per run."""
    return loaded.once(f"{GROUP}/int{bits}", lambda: quantized_copy(loaded.target, bits))


def load(loaded: Loaded, chosen: tuple[QuantizedVariant, ...]) -> None:
    for variant in chosen:
        copy_of(loaded, variant.bits)


def drafter(loaded: Loaded, variant: QuantizedVariant, k: int) -> SmallModelDrafter:
    return SmallModelDrafter(copy_of(loaded, variant.bits), num_draft_tokens=k,
                             confidence_threshold=variant.confidence_threshold,
                             first_candidates=variant.first_candidates)


ENTRIES = (MethodEntry(
    name=GROUP,
    summary="the target's own weights quantized (int8 or int4, torchao) as a draft model",
    variants=variants, load=load, drafter=drafter, check=check, color="navy", order=58),)
