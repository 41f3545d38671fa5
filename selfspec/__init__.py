"""selfspec: self-speculative decoding with an exact shared verifier."""

from selfspec.decode import GenerationResult, generate
from selfspec.model import Transformer
from selfspec.sampling import SamplingParams, logits_to_probs
from selfspec.tree import Tree
from selfspec.verify import Acceptance, verify_linear, verify_tree

__all__ = [
    "Acceptance",
    "GenerationResult",
    "SamplingParams",
    "Transformer",
    "Tree",
    "generate",
    "logits_to_probs",
    "verify_linear",
    "verify_tree",
]
