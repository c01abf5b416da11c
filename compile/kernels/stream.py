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
