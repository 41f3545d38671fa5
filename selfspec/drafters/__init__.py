"""Drafters: what proposes the tokens the target verifies."""

from selfspec.drafters.base import (
    DecodeSetup,
    Draft,
    DraftContext,
    Drafter,
    EarlyLayers,
    TargetFeatures,
)
from selfspec.drafters.dflash import DFlashDrafter
from selfspec.drafters.eagle import EagleDrafter
from selfspec.drafters.eagle_parallel import ParallelEagleDrafter
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.medusa import MedusaDrafter, MedusaProductDrafter
from selfspec.drafters.ngram import LookupCorpus, NgramDrafter
from selfspec.drafters.small_model import SmallModelDrafter, check_same_vocabulary
from selfspec.drafters.union import UnionDrafter

__all__ = [
    "DFlashDrafter",
    "DecodeSetup",
    "Draft",
    "DraftContext",
    "Drafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "EarlyLayers",
    "LookupCorpus",
    "MedusaDrafter",
    "MedusaProductDrafter",
    "NgramDrafter",
    "ParallelEagleDrafter",
    "SmallModelDrafter",
    "TargetFeatures",
    "UnionDrafter",
    "check_same_vocabulary",
]
