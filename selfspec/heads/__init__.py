"""Trainable draft heads (no decoding logic) and their checkpoint I/O."""

from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["MedusaConfig", "MedusaHeads", "describe_target", "load_head", "save_head"]
