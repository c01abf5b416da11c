"""CPU-only helpers for the llvm kernels: vector width, software prefetch, lane sums, stack
scratch, the K block layout and the work-claiming parallel loop."""

from __future__ import annotations

import math

import numpy as np
from tvm.script import tirx as T

VL = 16  # f32 vector lanes the CPU kernels accumulate in (one AVX-512 register; 2 x AVX2)


CACHE_LINE = 64  # bytes


NTA, L2, L1 = 0, 2, 3  # ``llvm.prefetch`` localities: prefetchnta, prefetcht1, prefetcht0


def prefetch_hint(address, locality: int):
    """Hint the CPU to bring the cache line at ``address`` (``T.address_of(buf[...])``) close to
    the core (``llvm.prefetch``, read): ``NTA`` as data used once (``prefetchnta``; where the
    line goes, and how it is kept from crowding out other data, is up to the CPU), ``L2`` into
    L2 (``prefetcht1``), ``L1`` into L1 (``prefetcht0``); never faults, so it needs no bounds
    check."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, locality, 1))


def prefetch_ahead_macro(step_elems: int, dtype: str, ahead_bytes: int, locality: int = NTA):
    """``prefetch(flat, i)``: ``prefetch_hint`` (``locality``) each cache line of the
    ``step_elems`` elements of ``dtype`` at ``flat[i]``, ``ahead_bytes`` further on (the kernels' software prefetch, issued
    once per step of their read loop, or, ``ahead_bytes`` 0, once for a span about to be read;
    past the buffer's end is harmless: a prefetch never faults)."""
    esize = np.dtype(dtype).itemsize
    lines = -(-step_elems * esize // CACHE_LINE)
    per_line, ahead = CACHE_LINE // esize, ahead_bytes // esize  # elements

    @T.macro
    def prefetch(flat, i):
        for line in T.unroll(lines):
            prefetch_hint(T.address_of(flat[i + line * per_line + ahead]), locality)

    return prefetch


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


def transpose_sums(vectors: list, lanes: int):
    """An ``m``-lane vector whose lane ``j`` is the sum of ``vectors[j]``'s ``lanes`` lanes (m =
    len(vectors) <= lanes, both powers of two): pairs of vectors are folded into one by two
    shuffles and an add (a vector holding ``k`` sums of ``w`` lanes each becomes ``2 k`` sums of
    ``w / 2``), then the last vector's halves, so ``m`` vectors take ``m - 1 + log2(lanes / m)``
    vector adds in all rather than ``log2(lanes)`` each plus scalar ones, and stay in registers."""
    m = len(vectors)
    assert 0 < m <= lanes and m & (m - 1) == 0 and lanes & (lanes - 1) == 0, (m, lanes)
    vs, w = list(vectors), lanes

    def fold(w: int, half: int):
        return [i * lanes + j * w + half * (w // 2) + t
                for i in range(2) for j in range(lanes // w) for t in range(w // 2)]

    while len(vs) > 1:
        vs = [T.Shuffle([a, b], fold(w, 0)) + T.Shuffle([a, b], fold(w, 1))
              for a, b in zip(vs[0::2], vs[1::2])]
        w //= 2
    v, width = vs[0], lanes  # width: the lanes of v, m sums of w lanes
    while w > 1:
        k = width // w
        lo = [j * w + t for j in range(k) for t in range(w // 2)]
        v = T.Shuffle([v], lo) + T.Shuffle([v], [i + w // 2 for i in lo])
        w //= 2
        width //= 2
    return v


STACK_BYTES = 1024  # TVM's kMaxStackAlloca


def scratch_buffer(shape: tuple, dtype: str = "float32"):
    """A kernel-local scratch buffer, on the stack when TVM allows it (LLVM then keeps small
    ones in registers).  TVM lowers a "local"-scope buffer, or any of ``STACK_BYTES`` or more,
    on the CPU to a ``TVMBackendAllocWorkspace`` / ``FreeWorkspace`` pair at every entry of the
    enclosing loop body (docs/design.md).  Only a "global"-scope buffer under ``STACK_BYTES`` stays an ``alloca``.  Scratch that cannot
    (a 16 x 16 float32 tile is exactly 1 KiB) is better declared once outside the parallel loop
    and sliced per lane (``lane_slice``); what is left here falls back to the workspace."""
    if math.prod(shape) * np.dtype(dtype).itemsize < STACK_BYTES:
        return T.decl_buffer(shape, dtype)
    return T.decl_buffer(shape, dtype, scope="local")


# How the CPU kernels store one block of one kv head in the K pool: ``[dim, slot]`` (the pool's
# declared shape stays ``(num_blocks, Hkv, block_size, head_dim)``, and V keeps ``[slot, dim]``).
# Decode attention then takes a block's scores as plain vector multiply-adds over its slots,
# one dim at a time, instead of one dot product per row ending in a horizontal sum.  The GPU
# kernels keep ``[slot, dim]``.  Recorded in the artifact key and manifest as "k_block_layout".
K_BLOCK_LAYOUT = "dim-major"


def k_block_view(k_pool, Hkv: int, D: int, bs: int):
    """The K pool as the CPU kernels store it: ``[block, kv_head, dim, slot]``."""
    return T.decl_buffer((k_pool.shape[0], Hkv, D, bs), k_pool.dtype, data=k_pool.data)


def lane_slice(whole, lane, shape: tuple):
    """The ``lane``-th ``shape`` slice of ``whole`` (declared once, outside the parallel loop,
    as ``(lanes, *shape)``): per-lane scratch without a heap allocation per loop entry."""
    return T.decl_buffer(shape, whole.dtype, data=whole.data,
                         elem_offset=lane * math.prod(shape))


MAX_LANES = 64  # parallel lanes a shared loop is split into (TVM hands each thread a block)


def _compiler_barrier():
    """A call LLVM must assume reads and writes memory, so the claim counters are re-read after
    it rather than hoisted out of the loop (``llvm.readcyclecounter``: rdtsc on x86, no fence)."""
    return T.evaluate(T.call_llvm_intrin("int64", "llvm.readcyclecounter"))


def claimed_units(units: int, parallel: bool):
    """``(run, lanes)``: ``run(proc, *args)`` calls ``proc(lane, u, *args)`` once or more for
    every ``u`` in ``range(units)``; ``lanes`` is how many distinct ``lane`` values it passes
    (for per-lane scratch).  ``proc`` must be idempotent (the same stores for the same ``u``).

    Serial: lane 0 runs every unit in order.  Parallel: ``lanes = min(units, MAX_LANES)`` lanes
    own contiguous runs of units, as even as possible; TVM's thread pool hands each thread a
    contiguous block of lanes and runs them in order.  A static split left the two halves of a
    GEMV finishing far apart (one core slower, or woken later; docs/design.md), so:

    - each lane claims its own units front to back (``front`` counter), and stops where a thief
      has claimed from the back (``back`` counter);
    - a lane that finds the next lane already started is the last its thread runs (lanes of one
      thread run one after the other, so that lane belongs to another thread); it then walks the
      other lanes and claims their unclaimed units from the far end, one at a time.

    A thread whose next lane has not started yet cannot tell a late-woken thread from its own
    next lane, so it does not steal then; the highest thread (no next lane) always may.

    The CPU backend has no atomics, so claims are plain int32 stores and loads (atomic on every
    target this runs on).  A unit is run only after its claim is stored, and a lane skips a
    unit only when it reads a claim for it, so every unit runs; two lanes may both run the
    unit they meet at (a stale read), which is harmless for idempotent units.  The counters
    live on the caller's stack (3 int32 per lane)."""
    if not parallel:
        @T.macro
        def run_serial(proc, *args):
            for u in range(units):
                proc(0, u, *args)

        return run_serial, 1

    lanes = min(units, MAX_LANES)
    seg = -(-units // lanes)  # most units a lane owns

    def first(w):
        return w * units // lanes

    def owned(w):
        return (w + 1) * units // lanes - w * units // lanes

    def other(w, d):  # an expression, not a TVMScript assignment (that allocates a buffer)
        return (w + d) % lanes

    @T.macro
    def run(proc, *args):
        claims = T.decl_buffer((lanes * 3,), "int32")  # per lane: front, back, started
        for i in range(lanes * 3):
            claims[i] = 0
        for w in T.parallel(lanes):
            claims[w * 3 + 2] = 1
            for i in range(seg):
                _compiler_barrier()
                if i + claims[w * 3 + 1] < owned(w):
                    claims[w * 3] = i + 1
                    proc(w, first(w) + i, *args)
            _compiler_barrier()
            if claims[T.min(w + 1, lanes - 1) * 3 + 2] == 1:  # the last lane of this thread
                for d in range(1, lanes):
                    _compiler_barrier()
                    if claims[other(w, d) * 3] + claims[other(w, d) * 3 + 1] < owned(other(w, d)):
                        for i in range(seg):
                            _compiler_barrier()
                            if (i >= claims[other(w, d) * 3 + 1]
                                    and i + claims[other(w, d) * 3] < owned(other(w, d))):
                                claims[other(w, d) * 3 + 1] = i + 1
                                proc(w, first(other(w, d)) + owned(other(w, d)) - 1 - i, *args)

    return run, lanes
