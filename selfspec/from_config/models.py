"""Models and weights from `conf/model/`: architecture facts, where the weights are, the
target's settings read once into a `TargetSpec` that `selfspec.model.loading` loads, tokenizers,
and the Hugging Face peers' copies.

A model config names its weights four ways, tried in order: a local `path`, a shipped package
`asset` (selfspec/assets/<asset>), a `gguf` file inside an installed pip package (converted
once into a cache folder, `selfspec.model.converted`), the Hugging Face cache for `hf_id` (never a
download). Its `arch` block holds the architecture facts, so plans need no weights.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.devices import check_device
from selfspec.model import loading
from selfspec.model.config import ModelConfig
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder
from selfspec.model.cpu_linear import INVARIANT_BLOCK_ROWS
from selfspec.model.loading import DTYPES, TargetSpec
from selfspec.model.placement import parse_device
from selfspec.model.plan import ModelPlan, plan_model
from selfspec.model.transformer import Transformer
from selfspec.quiet import import_transformers_models

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelNotAvailable(ValueError):
    """The weights of a configured model are not on this machine (the message says why)."""


def load_target(cfg: DictConfig) -> Transformer:
    """The target model of cfg.model (`selfspec.model.loading.load`: plan, quantize, place,
    load), its settings read once (`target_spec`). With model.quantize, its weight-only
    int8/int4 copy (`selfspec.model.quantized`), which is then the target every output is exact
    against."""
    spec = target_spec(cfg)
    return loading.load(spec)


def target_spec(cfg: DictConfig, weights: bool = True) -> TargetSpec:
    """cfg.model (with cfg.device, cfg.compile and cfg.seed) read once, every setting checked.
    weights=False: for a plan alone, the weights neither looked for nor the device checked
    (the config's `arch` block then suffices)."""
    cfg_model = cfg.model
    bits = target_quantization(cfg_model)
    compiled = _compile(cfg, bits)
    invariant_rows = _invariant_rows(cfg, bits, compiled)
    random_weights = bool(cfg_model.get("random_weights"))
    dtype = str(cfg_model.get("dtype", "fp32"))
    torch_dtype(dtype)  # checked
    placement = _placement_settings(cfg_model)
    home = cfg.get("device", "cpu")
    arch = _arch_config(cfg_model)
    needs_folder = arch is None or (weights and not random_weights)
    folder = _weights_folder(cfg_model, "model") if needs_folder else None
    return TargetSpec(
        name=str(cfg_model.name),
        config=arch if arch is not None else ModelConfig.from_folder(folder),
        checked=arch is not None, folder=folder, dtype=dtype,
        device=check_device(home) if weights else parse_device(home),
        random_weights=random_weights, seed=int(cfg.get("seed", 0)),
        device_map=placement.get("device_map"), max_memory=placement.get("max_memory"),
        quantize=bits, compile=compiled, invariant_rows=invariant_rows,
        chat=bool(cfg_model.get("chat", False)))


def model_config(cfg_model: DictConfig) -> ModelConfig:
    """The architecture (no weights) from a model config's `arch` block, or from the model
    folder's config.json when `arch` is null (a local model: `model=local model.path=...`)."""
    arch = _arch_config(cfg_model)
    return arch if arch is not None else ModelConfig.from_folder(resolve_model_path(cfg_model))


def _arch_config(cfg_model: DictConfig) -> ModelConfig | None:
    """The architecture of a model config's `arch` block (None: the block is null)."""
    if cfg_model.get("arch") is None:
        return None
    arch = OmegaConf.to_container(cfg_model.arch, resolve=True)
    if "head_dim" not in arch and {"hidden_size", "num_heads"} <= arch.keys():
        arch["head_dim"] = arch["hidden_size"] // arch["num_heads"]  # unless it differs
    arch["eos_token_ids"] = tuple(arch.get("eos_token_ids") or ())
    try:
        return ModelConfig.of_family(**arch)
    except TypeError as exc:  # an unknown or missing field
        raise ValueError(f"model config {cfg_model.get('name')!r}: bad `arch` block "
                         f"({exc})") from None


def model_plan(cfg: DictConfig) -> ModelPlan:
    """The memory plan of cfg.model over cfg.num_gpus GPUs, built on the meta device, with
    the placement model.device_map asks for (no GPU needed)."""
    spec = target_spec(cfg, weights=False)
    return plan_model(spec.config, spec.name, int(cfg.num_gpus), loading.plan(spec),
                      "int8" if spec.quantize is not None else spec.dtype)


def _placement_settings(cfg_model: DictConfig) -> dict:
    """model.device_map and model.max_memory as plain values (`selfspec.model.placement`);
    empty without a map."""
    plain = {key: OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
             for key in ("device_map", "max_memory") if (value := cfg_model.get(key)) is not None}
    if "device_map" not in plain and "max_memory" in plain:
        raise ValueError("model.max_memory is read only with model.device_map; set "
                         "model.device_map=auto (or a mapping) beside it")
    return plain


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_path(cfg_model: DictConfig, key: str = "model") -> Path:
    """The local folder holding the model's weights, or ModelNotAvailable saying what was tried.

    key: where the config sits in the tree ("model", "model.draft"), for the message's fix.
    """
    if key == "model":
        target_quantization(cfg_model)  # a bad setting is refused with the folder's checks
    return _weights_folder(cfg_model, key)


def _weights_folder(cfg_model: DictConfig, key: str) -> Path:
    """resolve_model_path, the settings already checked."""
    if cfg_model.get("random_weights"):
        raise ModelNotAvailable(
            f"model {cfg_model.name!r} has random weights and no files (no tokenizer, nothing "
            f"to load): it is for timing, e.g. python eval/bench_decode.py model={cfg_model.name}")
    if cfg_model.get("path"):
        folder = Path(cfg_model.path).expanduser()
        if _is_model_folder(folder):
            return folder
        tried = [f"{key}.path={folder}: no config.json there"]
        raise ModelNotAvailable(_unavailable_message(cfg_model, key, tried))
    tried = [f"{key}.path: not set"]
    if cfg_model.get("asset"):
        folder = Path(str(resources.files("selfspec") / "assets" / cfg_model.asset))
        if _is_model_folder(folder):
            return folder
        tried.append(f"the shipped asset {folder}: missing (build it: scripts/build_tiny.py)")
    if cfg_model.get("gguf"):
        return _converted_gguf(cfg_model, key)
    if cfg_model.get("hf_id"):
        folder = _hf_cache_snapshot(cfg_model.hf_id)
        if folder is not None:
            return folder
        cache = _hf_cache_dir()
        tried.append(f"the Hugging Face cache ({cache}): no snapshot of {cfg_model.hf_id}")
    raise ModelNotAvailable(_unavailable_message(cfg_model, key, tried))


def _converted_gguf(cfg_model: DictConfig, key: str) -> Path:
    """The cached conversion of the model's GGUF file (converted now if missing)."""
    g = cfg_model.gguf
    source = GGUFSource(str(g.package), str(g.version), str(g.file),
                        tuple(str(part) for part in g.get("parts") or ()))
    try:
        return gguf_model_folder(str(cfg_model.name), source)
    except SourceNotInstalled as exc:
        raise SourceNotInstalled(f"model {cfg_model.name!r}: {exc} (or point {key}.path at a "
                                 f"model folder)") from None


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of repo_id, looked up without any network access."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, HFValidationError):  # LocalEntryNotFoundError is an OSError
        return None
    return folder if _is_model_folder(folder) else None


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _unavailable_message(cfg_model: DictConfig, key: str, tried: list[str]) -> str:
    name, hf_id = cfg_model.get("name"), cfg_model.get("hf_id")
    ident = f" (Hugging Face id {hf_id})" if hf_id else ""
    example = f", e.g. from `hf download {hf_id}` elsewhere" if hf_id else ""
    lines = [
        f"model {name!r}{ident} is not available on this machine.",
        "Tried:",
        *(f"  - {t}" for t in tried),
        f"Fix: point {key}.path=/local/folder at downloaded weights (a folder with config.json "
        f"and *.safetensors{example}).",
    ]
    if hf_id:
        lines.append(f"Otherwise this machine needs Hugging Face Hub access to download {hf_id} "
                     f"into its cache (nothing is downloaded here).")
    lines.append("dry_run=true prints the model's memory plan without weights.")
    return "\n".join(lines)


def compile_steps(cfg: DictConfig) -> bool:
    """cfg.compile (default false): whether the static decode steps run compiled over fused
    products (`Transformer.compile_steps`)."""
    return _compile(cfg, target_quantization(cfg.model))


def _compile(cfg: DictConfig, bits: int | None) -> bool:
    """compile_steps, model.quantize read already (as bits)."""
    value = cfg.get("compile", False)
    if not isinstance(value, bool):
        raise ValueError(f"compile must be true or false, got {value!r}")
    if value and bits is not None:
        raise ValueError("compile=true: a quantized target's products cannot be fused and "
                         "compiled; set compile=false (or model.quantize=null)")
    return value


def _invariant_rows(cfg: DictConfig, bits: int | None, compiled: bool) -> int | None:
    """batch_invariant=true: the exact mode's block of rows (`use_invariant_products`), else
    None; compile and model.quantize read already."""
    value = cfg.get("batch_invariant", False)
    if not isinstance(value, bool):
        raise ValueError(f"batch_invariant must be true or false, got {value!r}")
    if value and compiled:
        raise ValueError("batch_invariant=true runs uncompiled steps (a compiled stage sums a "
                         "bucket of rows in its own order); set compile=false")
    if value and bits is not None:
        raise ValueError("batch_invariant=true covers full-precision products; set "
                         "model.quantize=null")
    return INVARIANT_BLOCK_ROWS if value else None


QUANTIZE = {"int8": 8, "int4": 4}  # model.quantize: weight-only, by torchao


def target_quantization(cfg_model: DictConfig) -> int | None:
    """model.quantize (null, int8 or int4) as bits, checked; refused for a dtype the quantized
    products do not take (they compute in bf16, from fp32 or bf16 activations)."""
    value = cfg_model.get("quantize")
    if value is None:
        return None
    if value not in QUANTIZE:
        raise ValueError(f"model.quantize: choose null, int8 or int4 (weight-only, torchao), "
                         f"got {value!r}")
    if cfg_model.get("dtype", "fp32") not in ("fp32", "bf16"):
        raise ValueError(f"model.quantize={value} quantizes an fp32 or bf16 target (its "
                         f"products take bf16 rows, the rest keeps the target's dtype); set "
                         f"model.dtype=fp32 or bf16, got {cfg_model.dtype}")
    return QUANTIZE[value]


def random_models(cfg: DictConfig) -> tuple[Transformer, Any]:
    """A `random_weights: true` model config's target with random weights (seeded by cfg.seed)
    and the transformers model it shares them with (`selfspec.model.loading.random_models`)."""
    return loading.random_models(target_spec(cfg))


def load_model(cfg_model: DictConfig, key: str, dtype: str, on: torch.device,
               compiled: bool = False) -> Transformer:
    """The model of a config beside the target's (model.draft: key names it for messages), in
    dtype on `on`; compiled: its `compile_steps` (cfg.compile)."""
    folder = resolve_model_path(cfg_model, key)
    model = Transformer.from_pretrained(folder, dtype=torch_dtype(dtype), device=on)
    model.compile_steps = compiled
    return model


def load_tokenizer(folder: str | Path):
    """The `transformers` tokenizer saved in a model folder (refused clearly if there is none)."""
    from transformers import AutoTokenizer  # slow import: only when weights are there

    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in model folder {folder} (none of {', '.join(TOKENIZER_FILES)}): "
            f"save the model's tokenizer there (tokenizer.save_pretrained(folder))")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except OSError as exc:  # unreadable or incomplete tokenizer files
        raise ValueError(f"cannot load the tokenizer in {folder} ({exc})") from None


def draft_model_config(cfg: DictConfig, otherwise: str) -> DictConfig:
    """model.draft's settings, or an error that says how to give one or, `otherwise`, what
    else to do (the caller knows which methods run it)."""
    draft_cfg = cfg.model.get("draft")
    if draft_cfg is None or not any(draft_cfg.get(f) for f in ("path", "asset", "hf_id")):
        raise ValueError(
            f"model {cfg.model.name!r} has no standard small draft model: set "
            f"model.draft.path=/local/folder (a model with the target's tokenizer; "
            f"train/draft.py cuts and trains one) or "
            f"{otherwise}"
        )
    return draft_cfg


def load_hf_model(folder: str | Path, dtype: str, on: torch.device | str):
    """A transformers causal LM from a model folder, for the Hugging Face peer methods."""
    from transformers import AutoModelForCausalLM  # slow import: only when a peer is swept

    import_transformers_models()

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype(dtype))
    return model.to(on).eval()
