"""Gemma 2 (``Gemma2ForCausalLM``; GGUF ``gemma2``): ``(1 + w)`` RMSNorms, a GELU-tanh gate,
norms after attention and after the MLP, embeddings times sqrt(hidden), attention and final
logit soft-capping, every other layer sliding (from the first)."""

from . import GGUF_LAYER_TENSORS, Family

# the norms around attention and the MLP, by parameter (``params``) and by llama.cpp's names
HF_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
            "post_norm": "pre_feedforward_layernorm",
            "post_ffn_norm": "post_feedforward_layernorm"}
GGUF_TENSORS = {**GGUF_LAYER_TENSORS, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}

FAMILY = Family(
    name="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architecture="gemma2",
    # Gemma2Config's defaults
    hf_defaults=dict(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                     max_position_embeddings=8192),
    refused_flags=("attention_bias",),
    activation=("gelu_pytorch_tanh",),
    activation_key="hidden_activation",
    gate_act="gelu_tanh",
    hf_norm_offset=1.0,
    post_norms=True,
    hf_norms=HF_NORMS,
    embed_scale_sqrt_hidden=True,
    attn_scale_key="query_pre_attn_scalar",
    gguf_attn_scale_layers=(46,),  # llama.cpp's 27B
    attn_softcap_key="attn_logit_softcapping",
    final_softcap_key="final_logit_softcapping",
    sliding="layer_types",
    sliding_pattern=2,
    gguf_layer_tensors=GGUF_TENSORS,
    hf_tied=True,
    hf_feature_defaults={"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                         "final_logit_softcapping": 30.0},  # Gemma2Config's
)
