"""The parameter layout the compiled functions take, in order.

Matrices keep the HF ``[out_features, in_features]`` layout (the GEMV streams rows); q/k/v and
gate/up are concatenated along ``out_features`` once at load time so one kernel reads each.
Norm weights and biases are always float32; matrices and the embedding use the weight dtype.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import ModelConfig


class ParamSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str


def param_specs(cfg: ModelConfig, weight_dtype: str) -> list[ParamSpec]:
    """Names, shapes and dtypes of the ``params`` tuple, in tuple order."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    specs = [ParamSpec("embed", (v, h), weight_dtype)]  # (vocab, hidden)
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        specs += [
            ParamSpec(p + "input_norm", (h,), "float32"),
            ParamSpec(p + "wqkv", (cfg.qkv_size, h), weight_dtype),  # rows: q | k | v
        ]
        if cfg.attention_bias:
            specs.append(ParamSpec(p + "bqkv", (cfg.qkv_size,), "float32"))
        specs += [
            ParamSpec(p + "wo", (h, cfg.q_size), weight_dtype),
            ParamSpec(p + "post_norm", (h,), "float32"),
            ParamSpec(p + "w_gate_up", (2 * i, h), weight_dtype),  # rows: gate | up
            ParamSpec(p + "w_down", (h, i), weight_dtype),
        ]
    specs.append(ParamSpec("final_norm", (h,), "float32"))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (v, h), weight_dtype))  # (vocab, hidden)
    return specs
