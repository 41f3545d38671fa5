"""LoRA adapters on the target (via `peft`), for methods that fine-tune it with their head.

Medusa-2 trains low-rank adapters on the target's linear layers jointly with the heads. The
adapted target is then the model that is verified: its own LM head (the "base logits") gives
the law p that every draft is checked against, and a KL term to the unadapted target keeps that
law near the original during training. peft owns the adapter layers, the adapter-disabled
teacher pass, the adapter file format and the merge; this module only adapts it to
`selfspec.model.Transformer`. peft is imported lazily: it takes seconds to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from selfspec.checks import check_count
from selfspec.model import Transformer
from selfspec.quiet import quiet_imports

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER_DIR = "adapter"  # the adapter's folder inside a head export
ADAPTER_CONFIG = "adapter_config.json"
LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """rank r and alpha (the update is alpha / r * B @ A), dropout on the adapter's input, and
    which of the target's linear layers get an adapter (names as in `Transformer`)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LINEAR_LAYERS

    def __post_init__(self) -> None:
        check_count("rank", self.rank, owner="LoraSettings")
        if not self.alpha > 0:
            raise ValueError(f"LoraSettings: alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSettings: dropout must lie in [0, 1), got {self.dropout!r}")
        unknown = sorted(set(self.target_modules) - set(LINEAR_LAYERS))
        if unknown or not self.target_modules:
            raise ValueError(
                f"LoraSettings: target_modules {unknown or '(empty)'} are not linear layers of "
                f"the target; choose from {', '.join(LINEAR_LAYERS)}"
            )


def add_lora(target: Transformer, settings: LoraSettings) -> PeftModel:
    """The target wrapped with fresh adapters. Every original weight is frozen; B starts at
    zero, so the adapted target starts out computing exactly the original's outputs."""
    with quiet_imports():
        from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), bias="none",
    )
    return get_peft_model(target, config)


def lora_parameter_count(target: Transformer, settings: LoraSettings) -> int:
    """Trainable adapter parameters: r * (in + out) per adapted linear layer. Works on a
    meta-device target (a memory plan), since it reads shapes only."""
    adapted = set(settings.target_modules)
    return sum(
        settings.rank * (module.in_features + module.out_features)
        for name, module in target.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in adapted
    )


def save_adapter(
    model: PeftModel, folder: str | Path, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the adapter in peft's format (adapter_config.json + adapter_model.safetensors).

    state: the full adapter weights keyed as in `model.state_dict()`, when the model's own
    copies are partitioned (DeepSpeed ZeRO-3 gathers them for the checkpoint); None reads
    them from the model.
    """
    folder = Path(folder)
    if state is None:
        model.save_pretrained(str(folder))
    else:
        model.save_pretrained(str(folder), state_dict={k: v.cpu() for k, v in state.items()})
    return folder


def merge_adapter(target: Transformer, folder: str | Path) -> Transformer:
    """The target with the adapter in `folder` merged into its weights (in place; returned).

    The merged target is a plain `Transformer` again: decoding pays nothing for the adapter.
    """
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(
            f"no LoRA adapter in {folder} (no {ADAPTER_CONFIG}); pass the `{ADAPTER_DIR}` folder "
            f"of a Medusa-2 export (train/medusa.py medusa.version=2)"
        )
    with quiet_imports():
        from peft import PeftModel

    source = target.source
    try:
        adapted = PeftModel.from_pretrained(target, str(folder))
    except (RuntimeError, ValueError, KeyError) as error:  # shapes or layer names differ
        raise ValueError(
            f"the LoRA adapter in {folder} does not fit this target ({source or 'in memory'}): "
            f"{str(error).splitlines()[0]}; load the target it was trained on"
        ) from None
    merged = adapted.merge_and_unload()
    merged.source = source  # still the folder of its tokenizer and config
    return merged
