"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``; GGUF ``qwen2``): q/k/v biases."""

from . import Family

FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_architecture="qwen2",
    # Qwen2Config's defaults
    hf_defaults=dict(num_key_value_heads=32, head_dim=None, rms_norm_eps=1e-6,
                     max_position_embeddings=32768),
    qkv_bias=True,  # hard-coded by transformers: the attention_bias flag is not read
    sliding="use_sliding_window",
)
