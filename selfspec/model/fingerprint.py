"""What identifies a model's weights: the key of every cache of their outputs (answers,
training rows, feature stores)."""

from __future__ import annotations

import hashlib

import torch


def cache_key(*parts) -> str:
    """A short hash of the parts: a cached file's name, which changes with any of them."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def weights_fingerprint(target) -> str:
    """What identifies the target's weights: a sum over every parameter (cheap, and any
    retrained or adapted target differs) with the architecture. A quantized layer's weight,
    which has no sum of its own, counts as the weight its kernel computes with."""
    total = sum(float(_plain(target, name, p).double().sum())
                for name, p in target.named_parameters())
    return f"{target.config}|{total:.12e}"


def _plain(model, name: str, parameter) -> torch.Tensor:
    owner, _, kind = name.rpartition(".")
    layer = model.get_submodule(owner)
    if kind == "weight" and hasattr(layer, "dense_weight"):  # a quantized layer
        return layer.dense_weight().detach()
    return parameter.detach()
