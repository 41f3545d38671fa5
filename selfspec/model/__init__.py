"""Our one decoder for every family (`transformer`), its architecture as configuration
(`config`), RoPE (`rope`), its Hugging Face checkpoint I/O (`checkpoint`), the one path that
loads a target from its parsed settings (`loading`) and the CPU's few-row products
(`cpu_linear`)."""

from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import Linear, aligned, dense_weight, linear, use_packed_products
from selfspec.model.rope import Rope, apply_rope, rope_cos_sin
from selfspec.model.transformer import (
    MLP,
    Attention,
    DecoderLayer,
    LayerStages,
    ModelOutput,
    RMSNorm,
    Transformer,
    attention_kernels,
    attention_mask,
    compiled_stages,
    fuse_projections,
    rms_norm,
    window_mask,
)

__all__ = ["MLP", "Attention", "DecoderLayer", "LayerStages", "Linear", "ModelConfig",
           "ModelOutput", "RMSNorm", "Rope", "Transformer", "aligned", "apply_rope",
           "attention_kernels", "attention_mask", "compiled_stages", "dense_weight",
           "fuse_projections", "linear", "rms_norm", "rope_cos_sin", "use_packed_products",
           "window_mask"]
