"""A streaming-read kernel: the machine's read bandwidth, the floor decode cannot beat.

Buffers: src (n_chunks, CHUNK) float32 -> partial (n_chunks, VL) float32 (a sum per chunk,
so the reads cannot be optimised away).  Chunks are spread over all cores like the GEMV rows.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import VL, finalize

CHUNK = 4096  # floats per chunk (16 KiB)


def stream_read(n_chunks: int):
    """Sum every float of a (n_chunks, CHUNK) buffer, VL lanes at a time, chunks in parallel."""

    @T.prim_func(s_tir=True)
    def func(src: T.Buffer((n_chunks, CHUNK), "float32"),
             partial: T.Buffer((n_chunks, VL), "float32")):
        with T.sblock("root"):
            for c in T.parallel(n_chunks):
                acc = T.decl_buffer((VL,), "float32", scope="local")
                for v in T.vectorized(VL):
                    acc[v] = T.float32(0)
                for ko in range(CHUNK // VL):
                    for v in T.vectorized(VL):
                        acc[v] = acc[v] + src[c, ko * VL + v]
                for v in T.vectorized(VL):
                    partial[c, v] = acc[v]

    return finalize(func, f"stream_read_{n_chunks}")
