"""Shared helpers for the kernel factories."""

from __future__ import annotations

import functools

from tvm import tirx

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
