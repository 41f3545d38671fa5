"""A target model as its config section asks for it (`TargetSpec`, parsed once by the composition
root) and the one path that loads it: plan, quantize, place, load (gpt-fast's `_load_model`).

`load` refuses what it cannot build before any weight is read (a quantization this machine
cannot run, a placement on a device it lacks), reads the weights straight onto the devices
their placement names (or makes random ones), checks them against the config's architecture
facts and returns the quantized copy where one is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import use_invariant_products
from selfspec.model.placement import Placement
from selfspec.model.plan import check_present, place, plan_placement
from selfspec.model.quantized import check_quantizable, quantized_copy
from selfspec.model.transformer import Transformer, mtp_modules
from selfspec.quiet import import_transformers_models

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Fields where the config's facts and the checkpoint's config.json must agree.
CHECKED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "model_type", "sliding_window", "sliding_layers",
                  "mtp_modules", "mtp_layout")


@dataclass(frozen=True)
class TargetSpec:
    """A target model, every setting checked.

    config: the architecture (the config's facts, or the weights' config.json when it gives
        none); checked: whether the weights loaded are checked against config (it came from
        the config's facts).
    folder: the weights (None: random weights, seeded by seed, or a spec for plans alone).
    dtype: fp32, bf16 or fp16; device: the home device (embedding, norm, LM head, drafters).
    device_map, max_memory: the placement asked for, as plain values (None: one device).
    quantize: weight-only bits of its quantized copy (8, 4; None: full precision).
    compile: whether its static decode steps run compiled (`Transformer.compile_steps`).
    invariant_rows: the exact mode's block of rows (`cpu_linear.use_invariant_products`: each
        row of a product the same bits whatever rows come with it); None: off.
    chat: whether it is a chat model (its prompts come as chat turns).
    """

    name: str
    config: ModelConfig
    checked: bool
    folder: Path | None
    dtype: str
    device: torch.device
    random_weights: bool = False
    seed: int = 0
    device_map: Any = None
    max_memory: Any = None
    quantize: int | None = None
    compile: bool = False
    invariant_rows: int | None = None
    chat: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def load(spec: TargetSpec) -> Transformer:
    """The target of `spec`: refused before any weights load where it cannot be built here;
    read onto its placement (or made with random weights), checked against the config's facts;
    with spec.quantize its weight-only int8/int4 copy (`selfspec.model.quantized`), which is
    then the target every output is exact against."""
    if spec.quantize is not None:
        check_quantizable(spec.quantize, spec.device)
    placement = plan(spec)
    if placement is not None:
        check_present(placement)
    if spec.random_weights:
        target = place(random_models(spec)[0], placement)
    else:
        target = Transformer.from_pretrained(spec.folder, dtype=spec.torch_dtype,
                                             device=spec.device, placement=placement)
        if spec.checked:
            check_architecture(spec.config, target.config, spec.name, target.source)
    target = target if spec.quantize is None else quantized_copy(target, spec.quantize)
    return with_modes(target, spec)


def with_modes(target: Transformer, spec: TargetSpec) -> Transformer:
    """The target with the spec's ways of computing: compiled steps, invariant products."""
    target.compile_steps = spec.compile
    use_invariant_products(target, spec.invariant_rows)
    return target


def plan(spec: TargetSpec) -> Placement | None:
    """The placement spec.device_map asks for, the embedding, norm and LM head on spec.device
    (`selfspec.model.placement`); None without a map. A quantized target's layers are counted
    at a byte a weight (int4 too: a bound)."""
    if spec.device_map is None:
        return None
    dtype = torch.int8 if spec.quantize is not None else spec.torch_dtype
    return plan_placement(spec.config, spec.device_map, spec.max_memory, dtype, home=spec.device)


def random_models(spec: TargetSpec) -> tuple[Transformer, Any]:
    """A random-weights target (seeded by spec.seed) and the transformers model it shares its
    weights with (its MTP modules, which transformers' classes lack, are the target's own)."""
    base = replace(spec.config, mtp_modules=0, mtp_layout=None)
    hf_model = random_hf_model(base, spec.torch_dtype, spec.device, seed=spec.seed)
    target = with_random_mtp(Transformer.from_hf(hf_model), spec.config, spec.seed)
    return with_modes(target, spec), hf_model


@torch.no_grad()
def with_random_mtp(target: Transformer, config: ModelConfig, seed: int) -> Transformer:
    """target with the MTP modules config names, random (seeded): every weight but the norms'
    drawn as transformers initialises a linear layer (normal, std 0.02), the norms at their
    identity. config: target's own with MTP modules."""
    if not config.mtp_modules:
        return target
    weight = target.embed_tokens.weight
    generator = torch.Generator(device=weight.device).manual_seed(seed + 1)
    with torch.device(weight.device):
        modules = mtp_modules(config)
    for name, param in modules.named_parameters():
        if not name.endswith("norm.weight"):
            param.normal_(0.0, 0.02, generator=generator)
    target.mtp = modules.to(weight.dtype)
    target.config = config
    return target


def random_hf_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                    seed: int = 0):
    """A transformers causal LM of this architecture with random weights (transformers' own
    initialisation), built directly on `device`: a target to time without any download.
    `Transformer.from_hf` on it shares its weights, so both libraries run the same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import_transformers_models()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf()),
                                                 dtype=dtype)
    return model.eval()


def check_architecture(
    expected: ModelConfig, loaded: ModelConfig, name: str, source: str | None
) -> None:
    """Refuse weights whose config.json contradicts the config (the plan would be wrong)."""
    wrong = {f: (getattr(expected, f), getattr(loaded, f)) for f in CHECKED_FIELDS
             if getattr(expected, f) != getattr(loaded, f)}
    if wrong:
        details = ", ".join(f"{f}: config {a} vs checkpoint {b}" for f, (a, b) in wrong.items())
        raise ValueError(
            f"the weights in {source} do not match model config {name!r} ({details}); point "
            f"model.path at that model's weights or choose the model config that matches them"
        )
