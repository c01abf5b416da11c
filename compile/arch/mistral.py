"""Mistral (``MistralForCausalLM``; its GGUFs say ``llama`` and read as that family)."""

from . import Family

FAMILY = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    gguf_architecture=None,
    # MistralConfig's defaults
    hf_defaults=dict(num_key_value_heads=8, head_dim=None, rms_norm_eps=1e-6,
                     max_position_embeddings=131072),
    sliding="every_layer",
)
