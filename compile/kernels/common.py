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


def tree_sum_macro(width: int, row0: bool = False):
    """buf[0] (or buf[0, 0] with ``row0``) = sum of the first ``width`` lanes, by halving
    (log2 steps of vector adds, not width-1 scalar adds); ``width`` a power of two <= 32.
    Clobbers those lanes."""
    assert width & (width - 1) == 0 and width <= 32, width

    @T.macro
    def step(buf, h):
        if row0:
            for v in T.vectorized(h):
                buf[0, v] = buf[0, v] + buf[0, v + h]
        else:
            for v in T.vectorized(h):
                buf[v] = buf[v] + buf[v + h]

    @T.macro
    def tree_sum(buf):
        if width >= 32:
            step(buf, 16)
        if width >= 16:
            step(buf, 8)
        if width >= 8:
            step(buf, 4)
        if width >= 4:
            step(buf, 2)
        if width >= 2:
            step(buf, 1)

    return tree_sum
