"""Gemma 3 text (``Gemma3ForCausalLM``; GGUF ``gemma3``): Gemma 2's layer with per-head q/k
RMSNorms, five sliding layers to one full, a second RoPE base for the sliding layers, and no
attention soft-capping (transformers does not apply a configured one)."""

from . import Family
from .gemma2 import GGUF_TENSORS, HF_NORMS

FAMILY = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architecture="gemma3",
    # Gemma3TextConfig's defaults
    hf_defaults=dict(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     max_position_embeddings=131072),
    refused_flags=("attention_bias",),
    qk_norm=True,
    activation=("gelu_pytorch_tanh",),
    activation_key="hidden_activation",
    gate_act="gelu_tanh",
    hf_norm_offset=1.0,
    post_norms=True,
    hf_norms=HF_NORMS,
    embed_scale_sqrt_hidden=True,
    attn_scale_key="query_pre_attn_scalar",
    gguf_attn_scale_layers=(62,),  # llama.cpp's 27B
    final_softcap_key="final_logit_softcapping",
    sliding="layer_types",
    sliding_pattern=6,
    rope_per_layer_type=True,
    gguf_local_rope_theta=10000.0,  # llama.cpp's fixed base of the sliding layers
    hf_tied=True,
    hf_feature_defaults={"query_pre_attn_scalar": 256},  # Gemma3TextConfig's (no soft-caps)
    gguf_layer_tensors={**GGUF_TENSORS, "self_attn.q_norm": "attn_q_norm",
                        "self_attn.k_norm": "attn_k_norm"},
)
