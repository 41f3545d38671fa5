"""Models and weights from `conf/model/`: architecture facts, where the weights are, loading
them checked against those facts, tokenizers, and the Hugging Face peers' copies.

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

from selfspec.from_config.common import device
from selfspec.measure.peers import random_hf_model
from selfspec.model import ModelConfig, Transformer
from selfspec.model.converted import GGUFSource, SourceNotInstalled, gguf_model_folder
from selfspec.model.placement import Placement
from selfspec.model.plan import ModelPlan, check_present, place, plan_model, plan_placement
from selfspec.model.quantized import check_quantizable, quantized_copy
from selfspec.quiet import import_transformers_models

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# Fields where the config's facts and the checkpoint's config.json must agree.
_CHECKED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "model_type", "sliding_window", "sliding_layers")


class ModelNotAvailable(ValueError):
    """The weights of a configured model are not on this machine (the message says why)."""


def model_config(cfg_model: DictConfig) -> ModelConfig:
    """The architecture (no weights) from a model config's `arch` block, or from the model
    folder's config.json when `arch` is null (a local model: `model=local model.path=...`)."""
    name = cfg_model.get("name")
    if cfg_model.get("arch") is None:
        return ModelConfig.from_folder(resolve_model_path(cfg_model))
    arch = OmegaConf.to_container(cfg_model.arch, resolve=True)
    if "head_dim" not in arch and {"hidden_size", "num_heads"} <= arch.keys():
        arch["head_dim"] = arch["hidden_size"] // arch["num_heads"]  # unless it differs
    arch["eos_token_ids"] = tuple(arch.get("eos_token_ids") or ())
    try:
        return ModelConfig.of_family(**arch)
    except TypeError as exc:  # an unknown or missing field
        raise ValueError(f"model config {name!r}: bad `arch` block ({exc})") from None


def model_plan(cfg: DictConfig) -> ModelPlan:
    """The memory plan of cfg.model over cfg.num_gpus GPUs, built on the meta device, with
    the placement model.device_map asks for (no GPU needed)."""
    dtype = "int8" if cfg.model.get("quantize") else cfg.model.dtype
    return plan_model(model_config(cfg.model), cfg.model.name, int(cfg.num_gpus),
                      target_placement(cfg), dtype)


def target_placement(cfg: DictConfig) -> Placement | None:
    """model.device_map and model.max_memory as a placement of the target's layers, its
    embedding, norm and LM head on cfg.device (`selfspec.model.placement`); None without a map."""
    cfg_model = cfg.model
    plain = {key: OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
             for key in ("device_map", "max_memory") if (value := cfg_model.get(key)) is not None}
    if "device_map" not in plain:
        if "max_memory" in plain:
            raise ValueError("model.max_memory is read only with model.device_map; set "
                             "model.device_map=auto (or a mapping) beside it")
        return None
    # A quantized target's layers are counted at a byte a weight (int4 too: a bound).
    dtype = torch.int8 if cfg_model.get("quantize") else torch_dtype(cfg_model.dtype)
    return plan_placement(model_config(cfg_model), plain["device_map"], plain.get("max_memory"),
                          dtype, home=cfg.get("device", "cpu"))


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


def load_target(cfg: DictConfig) -> Transformer:
    """The target model of cfg.model, checked against its config's architecture facts; with
    model.quantize, its weight-only int8/int4 copy (`selfspec.model.quantized`), which is then the
    target every output is exact against."""
    bits = target_quantization(cfg.model)
    compiled = compile_steps(cfg)
    if bits is not None:  # refused before any weights load
        check_quantizable(bits, device(cfg))
    placement = target_placement(cfg)
    if placement is not None:
        check_present(placement)
    if cfg.model.get("random_weights"):
        target = place(random_models(cfg)[0], placement)
    else:
        target = load_model(cfg.model, "model", cfg.model.dtype, device(cfg),
                            placement=placement)
    if cfg.model.get("arch") is not None and not cfg.model.get("random_weights"):
        check_architecture(model_config(cfg.model), target.config, cfg.model.name, target.source)
    target = target if bits is None else quantized_copy(target, bits)
    target.compile_steps = compiled
    return target


def compile_steps(cfg: DictConfig) -> bool:
    """cfg.compile (default false): whether the static decode steps run compiled over fused
    products (`Transformer.compile_steps`)."""
    value = cfg.get("compile", False)
    if not isinstance(value, bool):
        raise ValueError(f"compile must be true or false, got {value!r}")
    if value and target_quantization(cfg.model) is not None:
        raise ValueError("compile=true: a quantized target's products cannot be fused and "
                         "compiled; set compile=false (or model.quantize=null)")
    return value


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
    and the transformers model it shares them with."""
    hf_model = random_hf_model(model_config(cfg.model), torch_dtype(cfg.model.dtype), device(cfg),
                               seed=int(cfg.get("seed", 0)))
    target = Transformer.from_hf(hf_model)
    target.compile_steps = compile_steps(cfg)
    return target, hf_model


def load_model(
    cfg_model: DictConfig, key: str, dtype: str, on: torch.device, compiled: bool = False,
    placement: Placement | None = None,
) -> Transformer:
    """compiled: its `compile_steps` (cfg.compile); placement: its layers spread over
    devices (`selfspec.model.placement`)."""
    folder = resolve_model_path(cfg_model, key)
    model = Transformer.from_pretrained(folder, dtype=torch_dtype(dtype), device=on,
                                        placement=placement)
    model.compile_steps = compiled
    return model


def check_architecture(
    expected: ModelConfig, loaded: ModelConfig, name: str, source: str | None
) -> None:
    """Refuse weights whose config.json contradicts the config (the plan would be wrong)."""
    wrong = {f: (getattr(expected, f), getattr(loaded, f)) for f in _CHECKED_FIELDS
             if getattr(expected, f) != getattr(loaded, f)}
    if wrong:
        details = ", ".join(f"{f}: config {a} vs checkpoint {b}" for f, (a, b) in wrong.items())
        raise ValueError(
            f"the weights in {source} do not match model config {name!r} ({details}); point "
            f"model.path at that model's weights or choose the model config that matches them"
        )


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


def draft_model_config(
    cfg: DictConfig,
    otherwise: str = "choose another method (e.g. drafter=ngram; in a sweep, leave "
                     "small_model and hf_assisted out of methods)",
) -> DictConfig:
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
