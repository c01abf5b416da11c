"""Embedding lookup and RMSNorm (float32 activations).

Buffers (H static, n symbolic for prefill or 1 for decode):
  embedding: ids (n,) int32, table (V, H) weight dtype (bfloat16: (V, 2H) bytes) -> x (n, H)
  rmsnorm:   x (n, H), w (H,) float32 -> y (n, H);  ``last_only`` normalises row n-1 -> y (1, H)
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from ..common import cached, dtype_tag, finalize, token_dim
from .simd import VL, scratch_buffer


@cached
def embedding(V: int, H: int, wdt: str, n_static: int | None = None):
    """Gather rows of the embedding table; an id outside [0, V) fails the call before any write."""
    n = token_dim(n_static)
    fmt = FORMATS[wdt]
    t_shape, t_dtype = fmt.storage(V, H)

    @T.macro
    def gather(ids, table, x):
        for i in range(n):
            for h in T.vectorized(H):
                x[i, h] = fmt.widen(table[T.Cast("int64", ids[i]), h])

    @T.prim_func(s_tir=True)
    def func(var_ids: T.handle, table: T.Buffer(t_shape, t_dtype), var_x: T.handle):
        ids = T.match_buffer(var_ids, (n,), "int32")
        x = T.match_buffer(var_x, (n, H), "float32")
        with T.sblock("root"):
            for i in range(n):
                assert 0 <= ids[i] and ids[i] < V, "token id out of range of the vocabulary"
            gather(ids, fmt.elements(table), x)

    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"embedding_{tag}_{V}x{H}_{dtype_tag(wdt)}")


def rms_inv_macro(H: int, eps: float):
    """A macro ``(x, row, acc)`` leaving ``rsqrt(mean(x[row]^2) + eps)`` in ``acc[1]`` (``acc``:
    a ``(VL,)`` scratch), vector partial sums reduced at the end; the norm kernels' common part."""
    HO, HT = H // VL, H % VL

    @T.macro
    def rms_inv(x, row, acc):
        for v in T.vectorized(VL):
            acc[v] = T.float32(0)
        for ho in range(HO):
            for v in T.vectorized(VL):
                acc[v] = acc[v] + x[row, ho * VL + v] * x[row, ho * VL + v]
        for v in range(HT):
            acc[v] = acc[v] + x[row, HO * VL + v] * x[row, HO * VL + v]
        for v in range(1, VL):
            acc[0] = acc[0] + acc[v]
        acc[1] = T.rsqrt(acc[0] / T.float32(H) + T.float32(eps))

    return rms_inv


@cached
def rmsnorm(H: int, eps: float, n_static: int | None = None, last_only: bool = False):
    """y = x * w * rsqrt(mean(x^2) + eps), per row, in float32 (HF's LlamaRMSNorm up to the
    order of the two products): each row exactly as the decode GEMVs normalise their input
    (``gemv._macros``), so a batched row's norm is the B = 1 step's (batch invariance)."""
    n = token_dim(n_static)
    rows_out = 1 if last_only else n
    rms_inv = rms_inv_macro(H, eps)

    def src(i):  # the input row of output row i (an expression: see ``scratch_buffer``)
        return n - 1 if last_only else i

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, w: T.Buffer((H,), "float32"), var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        y = T.match_buffer(var_y, (rows_out, H), "float32")
        with T.sblock("root"):
            for i in T.parallel(rows_out):
                acc = scratch_buffer((VL,))
                rms_inv(x, src(i), acc)
                for h in T.vectorized(H):  # (x * w) * inv, as the decode GEMVs' fused norm
                    y[i, h] = x[src(i), h] * w[h] * acc[1]

    suffix = "_last" if last_only else ""
    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"rmsnorm{suffix}_{tag}_{H}")
