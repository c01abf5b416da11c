"""The parameter layout the compiled functions take, in order.

Matrices keep the HF ``[out_features, in_features]`` layout (the GEMV streams rows); q/k/v and
gate/up are joined along ``out_features`` once at load time so one kernel reads each.  q/k/v are
concatenated; gate and up rows alternate in runs of ``GATE_UP_ROWS`` (see ``gate_up_row``), so
the SwiGLU GEMV reads one contiguous stream instead of switching between two regions ``I`` rows
apart (measured in docs/design.md).
Norm weights (q / k norms: one head's size, shared by the heads) and biases are always float32;
a family with post norms (``ModelConfig.post_norms``) adds ``post_attn_norm`` and
``post_ffn_norm`` per layer.
Matrices and the embedding are stored in their weight format (``formats.FORMATS``): the
artifact's ``weight_dtype`` unless its ``weight_formats`` names another for that parameter (a
GGUF's Q8_0 embedding beside Q4_1 layers); a quantized matrix is its GGUF block bytes,
``(rows, K / 32 * block bytes)`` uint8.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import ModelConfig
from .formats import FORMATS

GATE_UP_ROWS = 16  # gate rows and up rows alternate in runs of this many


def gate_up_row(c, inter: int, up: bool, minimum=min):
    """The ``w_gate_up`` row holding act row ``c``'s gate (or, with ``up``, up) weights.

    Runs of ``GATE_UP_ROWS`` act rows: gate rows ``[16b, 16b + 16)`` are stored at rows
    ``[32b, 32b + 16)`` and their up rows right after; a last, shorter run of ``w`` act rows
    (``inter % 16``) likewise holds its ``w`` gate rows then its ``w`` up rows.  Rows of one
    run stay contiguous, so a kernel reads a tile of up to 16 gate (or up) rows from its first
    row.  ``c`` may be an int, a numpy array (``minimum=np.minimum``) or a TIR expression
    (``minimum=T.min``)."""
    run = c // GATE_UP_ROWS
    row = 2 * GATE_UP_ROWS * run + c % GATE_UP_ROWS
    if not up:
        return row
    return row + minimum(GATE_UP_ROWS, inter - GATE_UP_ROWS * run)


def _gate_up_rows(inter: int) -> tuple[np.ndarray, np.ndarray]:
    c = np.arange(inter)
    return gate_up_row(c, inter, False, np.minimum), gate_up_row(c, inter, True, np.minimum)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``w_gate_up`` from HF's gate_proj and up_proj weights (each ``(inter, hidden)``)."""
    gate_rows, up_rows = _gate_up_rows(gate.shape[0])
    out = np.empty((2 * gate.shape[0], *gate.shape[1:]), np.result_type(gate, up))
    out[gate_rows], out[up_rows] = gate, up
    return out


def split_gate_up(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gate_proj, up_proj) weights back from ``w_gate_up``."""
    gate_rows, up_rows = _gate_up_rows(w.shape[0] // 2)
    return w[gate_rows], w[up_rows]


class ParamSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]  # as stored (a quantized matrix: its bytes per row)
    dtype: str  # as stored
    format: str = "float32"  # the weight format (``formats.FORMATS``)
    logical: tuple[int, ...] = ()  # [out, in] of a matrix, () for vectors


def _matrix(name: str, rows: int, cols: int, fmt: str) -> ParamSpec:
    shape, dtype = FORMATS[fmt].storage(rows, cols)
    return ParamSpec(name, shape, dtype, fmt, (rows, cols))


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``{name: (out, in)}`` of every matrix parameter (the embedding included)."""
    return {s.name: s.logical for s in param_specs(cfg, "float32") if s.logical}


def split_qkv(weight_formats, layer: int) -> bool:
    """Whether layer ``layer`` keeps V's rows apart (``wqk`` + ``wv``): when ``weight_formats``
    names either, their formats differ (a Q4_K_M GGUF stores some layers' V in Q6_K; joining
    them would requantize one)."""
    names = {name for name, _fmt in weight_formats}
    return f"layers.{layer}.wqk" in names or f"layers.{layer}.wv" in names


def param_specs(cfg: ModelConfig, weight_dtype: str, weight_formats=()) -> list[ParamSpec]:
    """Names, stored shapes and dtypes of the ``params`` tuple, in tuple order; matrices in
    ``weight_dtype`` unless ``weight_formats`` (pairs ``(name, format)``) names theirs."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    other = dict(weight_formats)

    def m(name, rows, cols):
        return _matrix(name, rows, cols, other.get(name, weight_dtype))

    specs = [m("embed", v, h)]  # (vocab, hidden)
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        specs.append(ParamSpec(p + "input_norm", (h,), "float32"))
        if split_qkv(weight_formats, layer):
            specs += [m(p + "wqk", cfg.q_size + cfg.kv_size, h), m(p + "wv", cfg.kv_size, h)]
            if cfg.attention_bias:
                specs += [ParamSpec(p + "bqk", (cfg.q_size + cfg.kv_size,), "float32"),
                          ParamSpec(p + "bv", (cfg.kv_size,), "float32")]
        else:
            specs.append(m(p + "wqkv", cfg.qkv_size, h))  # rows: q | k | v
            if cfg.attention_bias:
                specs.append(ParamSpec(p + "bqkv", (cfg.qkv_size,), "float32"))
        if cfg.qk_norm:  # one weight per head dimension, shared by the heads
            specs += [ParamSpec(p + "q_norm", (cfg.head_dim,), "float32"),
                      ParamSpec(p + "k_norm", (cfg.head_dim,), "float32")]
        specs.append(m(p + "wo", h, cfg.q_size))
        if cfg.post_norms:  # the attention output's norm, before the residual add
            specs.append(ParamSpec(p + "post_attn_norm", (h,), "float32"))
        specs += [
            ParamSpec(p + "post_norm", (h,), "float32"),  # the MLP's input norm
            m(p + "w_gate_up", 2 * i, h),  # gate / up runs
            m(p + "w_down", h, i),
        ]
        if cfg.post_norms:
            specs.append(ParamSpec(p + "post_ffn_norm", (h,), "float32"))
    specs.append(ParamSpec("final_norm", (h,), "float32"))
    if not cfg.tie_word_embeddings:
        specs.append(m("lm_head", v, h))  # (vocab, hidden)
    return specs
