"""Model families: one module per family, each a :class:`Family` describing, as data, what
``config.py`` reads (HF ``config.json`` keys and defaults, GGUF metadata keys), how its tensors
are named (HF and GGUF), and what its layers do (the features ``model.py`` asks for through
``ModelConfig``).  The registry maps HF ``architectures`` and GGUF ``general.architecture`` to
a family.  Adding a family: docs/architecture.md, "To add X".
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

SLIDING_POLICIES = ("none", "every_layer", "use_sliding_window", "layer_types")
GATE_ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP gate's function, as ``ModelConfig.gate_act``
DEFAULTED_KEYS = ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")

# HF module (below ``model.layers.N.``) -> llama.cpp's tensor name (below ``blk.N.``): the
# layers every family here shares; a family adds its own in ``Family.gguf_layer_tensors``
GGUF_LAYER_TENSORS = MappingProxyType({
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
})
# parameter (below ``layers.N.``) -> HF module of the layer's norms: where the norm before the
# MLP (``post_norm``) is HF's ``post_attention_layernorm``; a family with post norms names its own
HF_LAYER_NORMS = MappingProxyType({"input_norm": "input_layernorm",
                                   "post_norm": "post_attention_layernorm"})
GGUF_GLOBAL_TENSORS = MappingProxyType({
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
})


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family, as data.

    ``hf_defaults``: transformers' config-class defaults for the keys of ``DEFAULTED_KEYS`` a
    config.json may leave out (None: ``num_key_value_heads`` = ``num_attention_heads``,
    ``head_dim`` = ``hidden_size / num_attention_heads``).  ``qkv_bias``: q/k/v projections
    always carry biases (the flag is not read).  ``refused_flags``: config.json booleans that,
    when true, add what is not run here (an o_proj or MLP bias).  ``qk_norm``: a per-head
    RMSNorm of q and k before RoPE (``self_attn.q_norm`` / ``k_norm``).  ``sliding``: how
    transformers picks the layers with a window (``SLIDING_POLICIES``).  ``gguf_qk_permuted``:
    llama.cpp's converter reorders Q / K rows for its interleaved RoPE (undone at load).
    ``gguf_rope_freqs``: llama.cpp reads a ``rope_freqs`` tensor (per-frequency divisors: how
    its converter stores llama3 RoPE scaling) for this family; elsewhere one is refused.
    ``norm`` and ``activation``: the layer's norm (``x * rsqrt(mean(x^2) + eps) * w``) and
    gate activation (the names config.json's ``activation_key`` may give it), ``gate_act`` the
    function they name (``GATE_ACTIVATIONS``).

    Features beyond Llama's: ``hf_norm_offset`` is added to every HF norm weight at load (a
    ``(1 + w)`` norm; llama.cpp's converter already stores ``w + 1``).  ``post_norms``: a norm
    on the attention output and on the MLP output before each residual add (``hf_norms`` names
    the four HF modules).  ``embed_scale_sqrt_hidden``: embeddings times sqrt(hidden_size).
    ``attn_scale_key``: the config.json key whose ``** -0.5`` scales the scores (else
    1/sqrt(head_dim)); ``gguf_attn_scale_layers``: block counts whose GGUF (which stores no
    scale) takes ``(hidden / heads) ** -0.5``, as llama.cpp decides.  ``attn_softcap_key`` /
    ``final_softcap_key``: config.json keys (and ``<arch>.<key>`` in GGUF) of the tanh
    soft-capping of scores / logits (None: the family does not apply it).  ``sliding_pattern``:
    every ``sliding_pattern``-th layer is full, the others slide (``layer_types`` absent, and
    GGUF).  ``rope_per_layer_type``: ``rope_parameters`` per layer type (the sliding layers'
    base: ``rope_local_base_freq`` in older configs); ``gguf_local_rope_theta``: the sliding
    layers' base in GGUF (which stores only the global one).
    """

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str | None
    hf_defaults: Mapping[str, Any]
    qkv_bias: bool = False
    refused_flags: tuple[str, ...] = ()
    qk_norm: bool = False
    sliding: str = "none"
    gguf_qk_permuted: bool = False
    gguf_rope_freqs: bool = False
    gguf_layer_tensors: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: GGUF_LAYER_TENSORS)
    norm: str = "rms"
    activation: tuple[str, ...] = ("silu", "swish")  # one function: transformers maps both
    activation_key: str = "hidden_act"
    gate_act: str = "silu"
    hf_norm_offset: float = 0.0
    post_norms: bool = False
    hf_norms: Mapping[str, str] = dataclasses.field(default_factory=lambda: HF_LAYER_NORMS)
    embed_scale_sqrt_hidden: bool = False
    attn_scale_key: str | None = None
    gguf_attn_scale_layers: tuple[int, ...] = ()
    attn_softcap_key: str | None = None
    final_softcap_key: str | None = None
    sliding_pattern: int = 0
    rope_per_layer_type: bool = False
    # a config.json without sliding_window: its config class's default (None: no window)
    hf_sliding_window: int | None = 4096  # Mistral, Qwen2, Qwen3, Gemma 2 / 3
    # HF module holding the rows of several shared ones, in order (Phi-3's qkv_proj: q_proj,
    # k_proj, v_proj), read as their rows (``weights.stored_rows``)
    fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    gguf_local_rope_theta: float | None = None
    # the config class's defaults of the keys above a config.json may leave out
    # (``attn_scale_key``, the soft-caps); a key not here defaults to off
    hf_feature_defaults: Mapping[str, float] = dataclasses.field(default_factory=dict)
    hf_tied: bool = False  # the config class's tie_word_embeddings default

    def __post_init__(self):
        if self.sliding not in SLIDING_POLICIES:
            raise ValueError(f"{self.name}: sliding={self.sliding!r}, not in {SLIDING_POLICIES}")
        if set(self.hf_defaults) != set(DEFAULTED_KEYS):
            raise ValueError(f"{self.name}: hf_defaults must give {DEFAULTED_KEYS}")
        if self.attn_scale_key and self.attn_scale_key not in self.hf_feature_defaults:
            raise ValueError(f"{self.name}: hf_feature_defaults must give {self.attn_scale_key}")
        if self.norm != "rms":
            raise ValueError(f"{self.name}: norm={self.norm!r}: only 'rms' is built")
        if self.gate_act not in GATE_ACTIVATIONS:
            raise ValueError(f"{self.name}: gate_act={self.gate_act!r}, not in {GATE_ACTIVATIONS}")
        if (self.sliding == "layer_types") != (self.sliding_pattern > 0):
            raise ValueError(f"{self.name}: sliding='layer_types' needs a sliding_pattern")


def _families() -> dict[str, Family]:
    from . import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3

    return {m.FAMILY.name: m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3)}


FAMILIES: Mapping[str, Family] = MappingProxyType(_families())
BY_HF: Mapping[str, Family] = MappingProxyType(
    {a: f for f in FAMILIES.values() for a in f.hf_architectures})
BY_GGUF: Mapping[str, Family] = MappingProxyType(
    {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture})


def family(name: str) -> Family:
    """The family called ``name`` (``ModelConfig.arch``)."""
    return FAMILIES[name]


def gguf_layer_tensor(module: str, arch: str | None = None) -> str | None:
    """llama.cpp's name for the HF layer module ``module`` in family ``arch`` (None: the first
    family naming it, Llama's names first), or None."""
    if arch is not None:
        return FAMILIES[arch].gguf_layer_tensors.get(module)
    for fam in FAMILIES.values():
        if module in fam.gguf_layer_tensors:
            return fam.gguf_layer_tensors[module]
    return None
