"""The one order in which every float-weight kernel sums a dot product ``x . w`` over K, so a
row's result is bit-identical in the B = 1 GEMV (``gemv.py``), the small-batch GEMVs
(``batch.py``) and the matmul tiles (``linear.py``), whatever other rows a call holds (batch
invariance, docs/design.md).

The sum runs in one chain of ``VL`` float32 lanes: lane ``v`` adds ``x[k] * w[k]`` for every
``k % VL == v`` in ascending k, one multiply-add each (``acc + x * w``, which LLVM contracts
alike in every kernel), the last partial VL-block into the lanes it has; then the lanes sum by
halving, 16 -> 8 -> 4, then ``(l0 + l2) + (l1 + l3)`` (``simd.lane_sum_macro``;
``simd.transpose_sums`` takes the same tree for several sums at once).  x is read as float32
after rounding through the GEMV's input dtype (``x_dtype``: float16 for wide float16 rows).

One chain, not several: a matmul tile of TM x TN outputs then keeps one VL-lane accumulator per
output in registers as before, while four chains (the GEMV's old order) made the tiles take four
passes over K and fold them, 0.72-0.80x on SmolLM2's float16 matrices at 16 rows; the GEMVs,
which stream W from memory, run as fast with one chain in steps of four blocks (eight blocks a
step measured 0.82x in a decode step; docs/design.md).  Kernels differ only in how many rows of
x and W they carry at once (``dot_macro``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from .simd import VL

X_L1_BYTES = 16 << 10  # input-vector bytes the GEMV keeps in float32 (half of a 32 KiB L1D)


def x_dtype(K: int, wdt: str) -> str:
    """The dtype the GEMV reads its input vector in: float16 for float16 weights once a float32
    x would crowd the streamed rows out of L1 (K > 4096; x is re-read for every row), as
    llama.cpp and HF's float16 path do; float32 otherwise (docs/design.md).  The batched
    kernels round x through it too, so their products are the GEMV's."""
    return "float16" if wdt == "float16" and K * 4 > X_L1_BYTES else "float32"


def x_reader(K: int, wdt: str, x_in: str = "float32"):
    """``read(x, r, k)``: x[r, k] as the GEMV multiplies it (float32, rounded through
    ``x_dtype``); ``x_in``: the dtype x is stored in (the GEMV's scratch is in ``x_dtype``)."""
    xdt = x_dtype(K, wdt)

    def read(x, r, k):
        if xdt == x_in:
            return T.Cast("float32", x[r, k]) if xdt != "float32" else x[r, k]
        return T.Cast("float32", T.Cast(xdt, x[r, k]))

    return read


def dot_macro(K: int, wdt: str, R: int, C: int, step: int = 1, x_in: str = "float32",
              prefetch=None):
    """``accumulate(x, W, acc, m0, c0)``: acc[r, c, :] = the VL lane sums of x row ``m0 + r``
    times W row ``c0 + c`` (r < R, c < C; W as its format's ``elements``; acc ``(R, C, VL)``
    float32), from zero.  The loop advances ``step`` VL-blocks at a time, unrolled, and calls
    ``prefetch(W, c0, k)`` (if given) before the step at weight k; neither changes the order."""
    fmt = FORMATS[wdt]
    read = x_reader(K, wdt, x_in)
    NB, PT = K // VL, K % VL  # full VL-blocks, the partial block's length
    KO, BT = NB // step, NB % step  # full steps, the full blocks after them

    @T.macro
    def fma(x, W, acc, m0, c0, r, c, v, k):
        acc[r, c, v] = acc[r, c, v] + read(x, m0 + r, k) * fmt.widen(W[c0 + c, k])

    @T.macro
    def accumulate(x, W, acc, m0, c0):
        for r, c, v in T.grid(R, C, VL):
            acc[r, c, v] = T.float32(0)
        for ko in range(KO):
            if prefetch is not None:
                prefetch(W, c0, ko * step * VL)
            for j in T.unroll(step):
                for r in T.unroll(R):  # unrolled: acc stays in registers
                    for c in T.unroll(C):
                        for v in T.vectorized(VL):
                            fma(x, W, acc, m0, c0, r, c, v, (ko * step + j) * VL + v)
        for b in range(BT):
            for r, c in T.grid(R, C):
                for v in T.vectorized(VL):
                    fma(x, W, acc, m0, c0, r, c, v, (KO * step + b) * VL + v)
        for r, c, v in T.grid(R, C, PT):
            fma(x, W, acc, m0, c0, r, c, v, NB * VL + v)

    return accumulate
