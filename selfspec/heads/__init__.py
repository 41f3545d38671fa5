"""Trainable draft heads (no decoding logic) and their checkpoint I/O."""

from selfspec.heads.dflash import DFlashConfig, DFlashHead
from selfspec.heads.draft_vocab import DraftVocab, draft_vocabulary
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.early_exit import ExitConfig, ExitHead
from selfspec.heads.io import describe_target, load_head, save_head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

__all__ = ["DFlashConfig", "DFlashHead", "DraftVocab", "EagleConfig", "EagleHead", "ExitConfig",
           "ExitHead", "MedusaConfig", "MedusaHeads",
           "describe_target", "draft_vocabulary", "load_head", "save_head"]
