"""Shared helpers for the kernel factories."""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

VL = 16  # f32 vector lanes the CPU kernels accumulate in (one AVX-512 register; 2 x AVX2)


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
    return {"float32": "f32", "float16": "f16"}[dtype]


def cached(factory):
    """Memoise a kernel factory: TVMScript parsing dominates graph building otherwise."""
    return functools.lru_cache(maxsize=None)(factory)


def tree_sum_macro(width: int):
    """buf[0] = sum(buf[:width]) by halving (log2 steps of vector adds, not width-1 scalar adds);
    ``width`` must be a power of two.  Clobbers buf."""
    assert width & (width - 1) == 0 and width <= 32, width

    @T.macro
    def tree_sum(buf):
        if width >= 32:
            for v in T.vectorized(16):
                buf[v] = buf[v] + buf[v + 16]
        if width >= 16:
            for v in T.vectorized(8):
                buf[v] = buf[v] + buf[v + 8]
        if width >= 8:
            for v in T.vectorized(4):
                buf[v] = buf[v] + buf[v + 4]
        if width >= 4:
            for v in T.vectorized(2):
                buf[v] = buf[v] + buf[v + 2]
        if width >= 2:
            buf[0] = buf[0] + buf[1]

    return tree_sum
