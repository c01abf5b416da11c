"""A streaming-read kernel: the machine's read bandwidth, the floor decode cannot beat.

Buffers: src (CHUNKS, n_rows, ROW) float32 -> partial (CHUNKS, VL) float32 (a sum per chunk, so
the reads cannot be optimised away).  Each parallel chunk is one long contiguous region read
front to back with ``KU`` independent accumulators, the access pattern of the decode GEMVs, and
like them with a software prefetch ahead of the reads (``PREFETCH_BYTES``).
"""

from __future__ import annotations

from tvm.script import tirx as T

from paged_decode.compile.kernels.common import finalize
from paged_decode.compile.kernels.cpu.simd import VL, prefetch_ahead_macro, scratch_buffer

ROW = 4096  # floats per row (16 KiB)
CHUNKS = 16  # contiguous regions, spread over the cores
KU = 4
# Each step of ``KU * VL`` words also prefetches its cache lines this many bytes ahead as data
# read once, as the GEMVs do (``gemv.PREFETCH_BYTES``): without it the floor reads low
# (docs/benchmarks.md).
PREFETCH_BYTES = 4096
_prefetch = prefetch_ahead_macro(KU * VL, "float32", PREFETCH_BYTES)  # 4-byte words either way


def stream_read(n_rows: int):
    """Sum every float of a (CHUNKS, n_rows, ROW) buffer, chunks in parallel."""

    @T.prim_func(s_tir=True)
    def func(src: T.Buffer((CHUNKS, n_rows, ROW), "float32"),
             partial: T.Buffer((CHUNKS, VL), "float32")):
        with T.sblock("root"):
            for c in T.parallel(CHUNKS):
                acc = scratch_buffer((KU, VL))
                for u, v in T.grid(KU, VL):
                    acc[u, v] = T.float32(0)
                flat = T.decl_buffer((CHUNKS * n_rows * ROW,), "float32", data=src.data)
                for r, ko in T.grid(n_rows, ROW // (VL * KU)):
                    _prefetch(flat, (c * n_rows + r) * ROW + ko * KU * VL)
                    for u in T.unroll(KU):
                        for v in T.vectorized(VL):
                            acc[u, v] = acc[u, v] + src[c, r, (ko * KU + u) * VL + v]
                for v in T.vectorized(VL):
                    partial[c, v] = acc[0, v] + acc[1, v] + acc[2, v] + acc[3, v]

    return finalize(func, f"stream_read_{n_rows}")


def stream_words(n: int):
    """Read every 32-bit word of a flat ``(n,)`` int32 buffer once (a weight tensor's bytes, of
    any dtype), ``CHUNKS`` contiguous chunks in parallel, front to back with ``KU`` independent
    accumulators, the last chunk taking the remainder; ``partial (CHUNKS, VL)`` int32 holds the
    wrapping sums (integer adds: a float16 tensor's bits read as float32 could be denormals, whose
    arithmetic is slow).  Timed over each weight matrix in turn, it is a decode step with the
    arithmetic taken out (``run._Ours.weights_read_ms``)."""
    per = n // CHUNKS
    body = per // (VL * KU) * (VL * KU)  # words of a chunk read by the vector loop

    @T.prim_func(s_tir=True)
    def func(src: T.Buffer((n,), "int32"), partial: T.Buffer((CHUNKS, VL), "int32")):
        with T.sblock("root"):
            for c in T.parallel(CHUNKS):
                acc = scratch_buffer((KU, VL), "int32")
                for u, v in T.grid(KU, VL):
                    acc[u, v] = 0
                for ko in range(body // (VL * KU)):
                    _prefetch(src, c * per + ko * KU * VL)
                    for u in T.unroll(KU):
                        for v in T.vectorized(VL):
                            acc[u, v] = acc[u, v] + src[c * per + (ko * KU + u) * VL + v]
                for t in range(T.if_then_else(c == CHUNKS - 1, n - c * per, per) - body):
                    acc[0, 0] = acc[0, 0] + src[c * per + body + t]
                for v in T.vectorized(VL):
                    partial[c, v] = acc[0, v] + acc[1, v] + acc[2, v] + acc[3, v]

    return finalize(func, f"stream_words_{n}")
