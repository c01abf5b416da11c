"""Gemma 3 text (``Gemma3ForCausalLM``; GGUF ``gemma3``): Gemma 2's family with per-head q/k
RMSNorms, five sliding layers to one full, a second RoPE base for the sliding layers, and no
attention soft-capping (transformers does not apply a configured one)."""

import dataclasses

from . import gemma2

FAMILY = dataclasses.replace(
    gemma2.FAMILY,
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architecture="gemma3",
    # Gemma3TextConfig's defaults
    hf_defaults=dict(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     max_position_embeddings=131072),
    qk_norm=True,
    gguf_attn_scale_layers=(62,),  # llama.cpp's 27B
    attn_softcap_key=None,
    sliding_pattern=6,
    rope_per_layer_type=True,
    gguf_local_rope_theta=10000.0,  # llama.cpp's fixed base of the sliding layers
    hf_feature_defaults={"query_pre_attn_scalar": 256},  # Gemma3TextConfig's (no soft-caps)
    gguf_layer_tensors={**gemma2.GGUF_TENSORS, "self_attn.q_norm": "attn_q_norm",
                        "self_attn.k_norm": "attn_k_norm"},
)
