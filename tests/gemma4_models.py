"""Tiny random Gemma 4 models of transformers' classes, for the parity and drafting tests:
the text decoder (`Gemma4ForCausalLM`) and its assistant (`Gemma4AssistantForCausalLM`)."""

import torch
from helpers import WINDOW

LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


def gemma4_config(value_from_key: bool = True, **extra):
    """A transformers Gemma 4 text config scaled down: a window of WINDOW tokens on its even
    layers, the full layers' proportional RoPE (a quarter of the pairs), keys doubling as
    values there (as the 31B model's), soft-capping that bites, no per-layer embeddings."""
    import transformers as tf

    return tf.Gemma4TextConfig(**{
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 16, "max_position_embeddings": 256,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "sliding_window": WINDOW, "attention_k_eq_v": value_from_key,
        "layer_types": list(LAYERS), "final_logit_softcapping": 4.0, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 1, **extra})


def _randomized(model, std: float):
    """model with seeded-by-the-caller weights of std (norm gains around 1, layer scalars in
    [0.5, 1.5]), in fp32, eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, std)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return model.float().eval()


def gemma4_model(seed: int = 0, std: float = 0.2, **extra):
    """A seeded random `Gemma4ForCausalLM`."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    config = gemma4_config(**extra)
    config._attn_implementation = "eager"
    return _randomized(Gemma4ForCausalLM(config), std)


def gemma4_assistant(seed: int = 1, std: float = 0.2, ordered: bool = False, vocab: int = 64,
                     backbone: int = 32, **text_extra):
    """A seeded random `Gemma4AssistantForCausalLM` for a `gemma4_model` target: two layers
    (sliding, full) of width 24 and two heads over the target's K/V heads; with ordered
    embeddings, 8 centroids (the top 3 scored) over a shuffled token order. text_extra: its
    text config's own settings (global_head_dim for a target with wider full layers)."""
    import transformers as tf

    text = gemma4_config(vocab_size=vocab, hidden_size=24, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=2, attention_k_eq_v=False,
                         layer_types=["sliding_attention", "full_attention"], **text_extra)
    config = tf.Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=backbone,
                                      use_ordered_embeddings=ordered, num_centroids=8,
                                      centroid_intermediate_top_k=3)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _randomized(tf.Gemma4AssistantForCausalLM(config), std)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
    return model
