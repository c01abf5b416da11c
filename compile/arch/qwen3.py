"""Qwen3 (``Qwen3ForCausalLM``; GGUF ``qwen3``): per-head q/k RMSNorm before RoPE, no biases,
an explicit head_dim."""

from . import GGUF_LAYER_TENSORS, Family

FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_architecture="qwen3",
    # Qwen3Config's defaults: head_dim 128 whatever hidden_size / num_attention_heads is
    hf_defaults=dict(num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
                     max_position_embeddings=32768),
    refused_flags=("attention_bias",),  # biases on q/k/v and o_proj alike
    qk_norm=True,
    sliding="use_sliding_window",
    gguf_layer_tensors={**GGUF_LAYER_TENSORS, "self_attn.q_norm": "attn_q_norm",
                        "self_attn.k_norm": "attn_k_norm"},
)
