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


CACHE_LINE = 64  # bytes


def prefetch_l2(address):
    """Hint the CPU to bring the cache line at ``address`` (``T.address_of(buf[...])``) into L2
    (``llvm.prefetch``: read, locality 2); never faults, so it needs no bounds check."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 2, 1))


def lane_sum_macro(width: int):
    """``lane_sum(buf, r)``: buf[r, 0] = sum of buf[r, 0:width] (``width`` a power of two), by
    vector halving down to 4 lanes, then scalar adds (LLVM lowers 2- and 1-lane vector steps
    through general registers).  Clobbers those lanes.  Callers reduce many rows in one loop,
    so the rows' short chains overlap instead of ending each row's dot product serially."""
    assert width & (width - 1) == 0 and width <= 32, width

    @T.macro
    def half_step(buf, r, h):
        for v in T.vectorized(h):
            buf[r, v] = buf[r, v] + buf[r, v + h]

    @T.macro
    def lane_sum(buf, r):
        if width >= 32:
            half_step(buf, r, 16)
        if width >= 16:
            half_step(buf, r, 8)
        if width >= 8:
            half_step(buf, r, 4)
        if width >= 4:
            buf[r, 0] = (buf[r, 0] + buf[r, 2]) + (buf[r, 1] + buf[r, 3])
        elif width == 2:
            buf[r, 0] = buf[r, 0] + buf[r, 1]

    return lane_sum
