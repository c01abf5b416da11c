"""A streaming-read kernel: the machine's read bandwidth, the floor decode cannot beat.

Buffers: src (CHUNKS, n_rows, ROW) float32 -> partial (CHUNKS, VL) float32 (a sum per chunk, so
the reads cannot be optimised away).  Each parallel chunk is one long contiguous region read
front to back with ``KU`` independent accumulators, the access pattern of the decode GEMVs.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import VL, finalize, scratch_buffer

ROW = 4096  # floats per row (16 KiB)
CHUNKS = 16  # contiguous regions, spread over the cores
KU = 4


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
                for r, ko in T.grid(n_rows, ROW // (VL * KU)):
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
    arithmetic taken out (``bench._Ours.weights_read_ms``)."""
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
                    for u in T.unroll(KU):
                        for v in T.vectorized(VL):
                            acc[u, v] = acc[u, v] + src[c * per + (ko * KU + u) * VL + v]
                for t in range(T.if_then_else(c == CHUNKS - 1, n - c * per, per) - body):
                    acc[0, 0] = acc[0, 0] + src[c * per + body + t]
                for v in T.vectorized(VL):
                    partial[c, v] = acc[0, v] + acc[1, v] + acc[2, v] + acc[3, v]

    return finalize(func, f"stream_words_{n}")
