"""Our compact decoder for the Llama family (`transformer`), its architecture (`config`), its
Hugging Face checkpoint I/O (`checkpoint`) and the CPU's few-row products (`cpu_linear`)."""

from selfspec.model.config import ModelConfig
from selfspec.model.cpu_linear import Linear, aligned, dense_weight, linear, use_packed_products
from selfspec.model.transformer import (
    MLP,
    Attention,
    DecoderLayer,
    LayerStages,
    ModelOutput,
    RMSNorm,
    Transformer,
    apply_rope,
    attention_kernels,
    attention_mask,
    compiled_stages,
    fuse_projections,
    rope_cos_sin,
    rope_inv_freq,
)

__all__ = ["MLP", "Attention", "DecoderLayer", "LayerStages", "Linear", "ModelConfig",
           "ModelOutput", "RMSNorm", "Transformer", "aligned", "apply_rope", "attention_kernels",
           "attention_mask", "compiled_stages", "dense_weight", "fuse_projections", "linear",
           "rope_cos_sin", "rope_inv_freq", "use_packed_products"]
