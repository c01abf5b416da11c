"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``; GGUF ``phi3``): q/k/v in one ``qkv_proj`` and
gate/up in one ``gate_up_proj`` (llama.cpp: ``attn_qkv``, and ``ffn_up`` holding gate then up),
no biases, a window on every layer, partial RoPE (Phi-4-mini: 0.75) and longrope scaling."""

from . import GGUF_LAYER_TENSORS, Family

FAMILY = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architecture="phi3",
    # Phi3Config's defaults
    hf_defaults=dict(num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-5,
                     max_position_embeddings=4096),
    sliding="every_layer",
    hf_sliding_window=None,  # Phi3Config's default
    fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    gguf_layer_tensors={**GGUF_LAYER_TENSORS, "self_attn.qkv_proj": "attn_qkv",
                        "mlp.gate_up_proj": "ffn_up"},
)
