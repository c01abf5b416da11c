"""The layer features of ``ModelConfig`` beyond Llama's, read from an HF ``config.json`` or GGUF
metadata as the family (``arch.Family``) says: sliding windows and their layers, the gate
activation, post norms, the embedding scale, the attention scale, soft-capping and RoPE per
layer type.  ``f`` is ``config._Fields`` over the file's mapping; every bad value is a
``ConfigError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from paged_decode.runtime.errors import ConfigError

from .arch import Family

_HF_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config default
LAYER_TYPES = ("full_attention", "sliding_attention")


def _pattern_layers(pattern: int, n_layers: int) -> list[int]:
    """Every ``pattern``-th layer full, the others sliding (transformers' and llama.cpp's)."""
    return [i for i in range(n_layers) if (i + 1) % pattern]


def _layer_types(f, n_layers: int) -> list[str] | None:
    types = f.raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n_layers
                              or not all(isinstance(t, str) and t in LAYER_TYPES for t in types)):
        raise f.bad("layer_types", types, f"must be null or a list of {n_layers} (one per layer) "
                    f"of {list(LAYER_TYPES)}")
    return types


def hf_sliding(f, fam: Family, n_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_layers`` as transformers decides them for this family."""
    window, layers = _hf_sliding_layers(f, fam, n_layers)
    if window is None or not layers:
        return {}
    if window == 0:
        raise f.bad("sliding_window", window, "a window of 0 positions attends to nothing; "
                    "must be positive or null")
    return {"sliding_window": window, "sliding_layers": tuple(layers)}


def _hf_sliding_layers(f, fam: Family, n_layers: int) -> tuple[int | None, list[int]]:
    if fam.sliding == "none":
        return None, []
    window = f.integer("sliding_window", fam.hf_sliding_window, null=None, minimum=0)
    if fam.sliding == "every_layer":
        return window, list(range(n_layers))
    types = _layer_types(f, n_layers)
    if fam.sliding == "layer_types":
        if types is None:
            pattern = f.integer("sliding_window_pattern", fam.sliding_pattern, minimum=1)
            return window, _pattern_layers(pattern, n_layers)
        return window, [i for i, t in enumerate(types) if t == "sliding_attention"]
    use = f.flag("use_sliding_window", False)
    first = f.integer("max_window_layers", _HF_MAX_WINDOW_LAYERS, minimum=0)
    if not use:  # the config drops the window unless use_sliding_window
        return None, []
    if types is None:
        types = [LAYER_TYPES[i >= first] for i in range(n_layers)]
    return window, [i for i, t in enumerate(types) if t == "sliding_attention"]


def _optional_number(f, key: str, default: float | None) -> float:
    """A positive number, or 0.0 for null (absent: ``default``, None meaning 0.0)."""
    if key not in f.raw:
        return float(default or 0.0)
    return 0.0 if f.raw[key] is None else f.number(key)


def hf_features(f, fam: Family, hidden: int, n_q: int, head_dim: int) -> dict[str, Any]:
    """The gate, post norms, embedding scale, attention scale and soft-capping fields."""
    if f.raw.get("use_bidirectional_attention"):
        raise f.bad("use_bidirectional_attention", f.raw["use_bidirectional_attention"],
                    "bidirectional attention is not supported (causal decoding only)")
    out: dict[str, Any] = {"gate_act": fam.gate_act, "post_norms": fam.post_norms}
    if fam.embed_scale_sqrt_hidden:
        out["embed_scale"] = hidden ** 0.5
    if fam.attn_scale_key:
        scalar = f.number(fam.attn_scale_key, fam.hf_feature_defaults[fam.attn_scale_key])
        out["attn_scale"] = 0.0 if scalar == head_dim else scalar ** -0.5
    for field, key in (("attn_softcap", fam.attn_softcap_key),
                       ("final_softcap", fam.final_softcap_key)):
        if key:
            out[field] = _optional_number(f, key, fam.hf_feature_defaults.get(key))
    return out


def hf_rope_layer_types(cfg: dict, fam: Family, f_of) -> dict[str, Any] | None:
    """``rope_theta``, ``rope_local_theta`` and ``rope_linear_factor`` of a family with RoPE per
    layer type (None for others): ``rope_parameters`` per layer type (transformers 5), or
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (older configs).  ``f_of(raw,
    label)`` makes the typed reader of a sub-object."""
    if not fam.rope_per_layer_type:
        return None
    top = f_of(cfg, "")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and any(k in params for k in LAYER_TYPES):
        full = f_of(_object(top, params, "full_attention"), "rope_parameters.full_attention")
        local = f_of(_object(top, params, "sliding_attention"),
                     "rope_parameters.sliding_attention")
    else:
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise top.bad("rope_scaling", scaling, "must be an object or null")
        full = f_of({"rope_theta": cfg.get("rope_theta", 1e6), **(scaling or {})}, "rope_scaling")
        local = f_of({"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}, "")
    if _rope_type(local) != "default":
        raise local.bad("rope_type", _rope_type(local), "only 'default' RoPE is supported on "
                        "sliding layers")
    kind, factor = _rope_type(full), 1.0
    if kind == "linear":
        factor = full.number("factor")
    elif kind != "default":
        raise full.bad("rope_type", kind, "supported on full layers: 'default', 'linear'")
    return {"rope_theta": full.number("rope_theta", 1e6),
            "rope_local_theta": local.number("rope_theta", 10000.0), "rope_linear_factor": factor}


def _object(top, params: dict, key: str) -> dict:
    value = params.get(key) or {}
    if not isinstance(value, dict):
        raise top.bad(f"rope_parameters.{key}", value, "must be an object")
    return value


def _rope_type(f) -> Any:
    kind = f.raw.get("rope_type", f.raw.get("type", "default"))
    if not isinstance(kind, str):
        raise f.bad("rope_type", kind, "must be a string")
    return kind


def gguf_features(f, fam: Family, n_layers: int, hidden: int, n_q: int,
                  head_dim: int) -> dict[str, Any]:
    """The same fields from GGUF metadata, as llama.cpp reads them: the window from
    ``<arch>.attention.sliding_window`` on the family's pattern of layers (every layer for a
    family without one), soft-capping from ``<arch>.<key>``, the attention scale llama.cpp
    picks by block count (the file stores none), the sliding layers' fixed RoPE base."""
    g = fam.gguf_architecture
    out: dict[str, Any] = {"gate_act": fam.gate_act, "post_norms": fam.post_norms}
    if fam.embed_scale_sqrt_hidden:
        out["embed_scale"] = hidden ** 0.5
    if n_layers in fam.gguf_attn_scale_layers and hidden // n_q != head_dim:
        out["attn_scale"] = (hidden // n_q) ** -0.5
    for field, key in (("attn_softcap", fam.attn_softcap_key),
                       ("final_softcap", fam.final_softcap_key)):
        if key and f"{g}.{key}" in f.raw:
            out[field] = f.number(f"{g}.{key}")
    window = f.integer(f"{g}.attention.sliding_window", 0, minimum=0)
    if window:
        layers = (_pattern_layers(fam.sliding_pattern, n_layers) if fam.sliding_pattern
                  else list(range(n_layers)))
        out.update(sliding_window=window, sliding_layers=tuple(layers))
    elif fam.sliding_pattern:
        raise ConfigError(f"{f.source}: {g}.attention.sliding_window is missing: the {g} "
                          "family's sliding layers need their window")
    if fam.gguf_local_rope_theta:
        out["rope_local_theta"] = fam.gguf_local_rope_theta
    return out
