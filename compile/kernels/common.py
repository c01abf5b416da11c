"""Helpers every kernel family uses (CPU and GPU): naming, memoising, tiles, token dims."""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from ..formats import FORMATS
from ..params import gate_up_row

EPILOGUES = ("none", "bias", "residual")  # what a linear layer adds to its product


def finalize(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc:
    """Name the kernel and mark it scheduled and opaque, so Relax passes leave it as written."""
    return func.with_attr({
        "global_symbol": name,
        "tirx.noalias": True,
        "tirx.is_scheduled": True,
        "op_pattern": 8,  # kOpaque: FuseOps must not merge hand-scheduled kernels
    })


def pick_tile(n: int, candidates=(8, 4, 2, 1)) -> int:
    """The largest candidate tile that divides ``n``."""
    return next(c for c in candidates if n % c == 0)


def dtype_tag(dtype: str) -> str:
    """A kernel name's tag for a weight dtype: f32 / f16 / bf16, or a quantized format's name."""
    if FORMATS[dtype].quantized:
        return dtype
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[dtype]


def const_tag(v: float) -> str:
    """A kernel's constant as part of its symbol: 30.0 -> 30, 0.5 -> 0p5, 1e-06 -> 1em06."""
    return format(v, ".9g").replace(".", "p").replace("-", "m").replace("+", "")


def cached(factory):
    """Memoise a kernel factory: TVMScript parsing dominates graph building otherwise."""
    return functools.lru_cache(maxsize=None)(factory)


def gate_up_rows(inter: int):
    """``(gate_row, up_row)``: act row ``c`` (a TIR expression) -> the ``w_gate_up`` row holding
    its gate / up weights (``params.gate_up_row``), for the SwiGLU kernels."""
    return (lambda c: gate_up_row(c, inter, False, T.min),
            lambda c: gate_up_row(c, inter, True, T.min))


def token_dim(n_static: int | None):
    """The token dimension: a fresh symbolic ``n`` for prefill, the constant for decode."""
    return tirx.Var("n", "int64") if n_static is None else n_static
