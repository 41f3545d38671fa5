"""Config plumbing every builder shares: repository paths, checked settings, devices, threads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from selfspec.checks import check_count
from selfspec.devices import check_device
from selfspec.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra config root (a repository folder, not package data)


def set_threads(cfg: DictConfig, key: str = "threads") -> None:
    """torch's thread count from cfg's `key` (null: torch's default)."""
    if OmegaConf.select(cfg, key) is not None:
        torch.set_num_threads(positive_int(cfg, key))


def device(cfg: DictConfig) -> torch.device:
    """cfg.device, checked: this machine has it (e.g. device=cuda needs a CUDA GPU)."""
    return check_device(cfg.get("device", "cpu"))


def sampling_params(cfg_sampling: DictConfig) -> SamplingParams:
    return checked_settings(SamplingParams, "sampling",
                            temperature=float(cfg_sampling.temperature),
                            top_k=int(cfg_sampling.top_k), top_p=float(cfg_sampling.top_p))


def checked_settings(cls: type, section: str, **values: Any) -> Any:
    """cls(**values), its errors naming the setting as the config does (sampling.top_p)."""
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"{cls.__name__}: ", f"{section}.", 1)) from None


def positive_int(cfg: DictConfig, key: str, low: int = 1) -> int:
    """cfg's setting `key` (dotted), checked to be an integer >= low."""
    return check_count(key, OmegaConf.select(cfg, key), low)


def as_list(value) -> list:
    """A config value that may be one item (a multirun job's value) or a list of them."""
    if isinstance(value, ListConfig | list | tuple):
        return list(value)
    return [] if value is None else [value]
