"""The parameter layout the compiled functions take, in order.

Matrices keep the HF ``[out_features, in_features]`` layout (the GEMV streams rows); q/k/v and
gate/up are joined along ``out_features`` once at load time so one kernel reads each.  q/k/v are
concatenated; gate and up rows alternate in runs of ``GATE_UP_ROWS`` (see ``gate_up_row``), so
the SwiGLU GEMV reads one contiguous stream instead of switching between two regions ``I`` rows
apart (measured in docs/design.md).
Norm weights and biases are always float32; matrices and the embedding use the weight dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import ModelConfig

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
            ParamSpec(p + "w_gate_up", (2 * i, h), weight_dtype),  # gate / up runs
            ParamSpec(p + "w_down", (h, i), weight_dtype),
        ]
    specs.append(ParamSpec("final_norm", (h,), "float32"))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", (v, h), weight_dtype))  # (vocab, hidden)
    return specs
