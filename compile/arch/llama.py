"""Llama (``LlamaForCausalLM``; GGUF ``llama``, which Mistral's GGUFs also use)."""

from . import Family

FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    gguf_architecture="llama",
    # LlamaConfig's defaults
    hf_defaults=dict(num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6,
                     max_position_embeddings=2048),
    # attention_bias adds an o_proj bias besides q/k/v's; mlp_bias the MLP's
    refused_flags=("mlp_bias", "attention_bias"),
    gguf_qk_permuted=True,
    gguf_rope_freqs=True,  # Llama 3.x's llama3 scaling
)
