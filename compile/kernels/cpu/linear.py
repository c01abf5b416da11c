"""Prefill linear layers: ``y[m, c] = sum_k x[m, k] * W[c, k]``, W in its stored ``[N, K]`` layout.

A register tile of ``TM`` tokens by ``TN`` weight rows: every loaded weight vector is reused
``TM`` times and every loaded activation vector ``TN`` times.  Accumulation is float32 in
``VL``-lane vectors, reduced once per output.  A parallel task is one weight tile against
a block of tokens; a thread runs a contiguous run of tasks, and each task prefetches the next
one's weight rows into L2 as it goes, so the weights stream from memory while the FMAs run
instead of in a pass of their own.  The tile is the target's (``TILES``): 4 x 4 where
AVX-512 has 32 vector registers; 2 x 2 on AVX2, whose 16 registers a 4 x 4 tile of 16-lane
(two-register) accumulators would spill (docs/design.md).  (Decode uses the GEMVs of
``gemv.py``.)

Buffers (x and y float32, W in the weight dtype (bfloat16: its (N, 2K) bytes, as in
``gemv.py``), N and K static, n symbolic):
  x (n, K)  W (N, K)  [bias (N,) float32 | res (n, N) float32]  ->  y (n, N)
The SwiGLU variant reads W (2I, K), gate and up rows in alternating runs
(``params.gate_up_row``), and writes act (n, I).
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from ...formats import FORMATS
from ...params import GATE_UP_ROWS
from ..common import EPILOGUES, cached, dtype_tag, finalize, gate_up_rows, pick_tile, token_dim
from ..signatures import matmul_func, swiglu_matmul_func
from .fastmath import silu_mul
from .float_dot import dot_macro
from .simd import CACHE_LINE, L2, VL, prefetch_hint, scratch_buffer, transpose_sums


MB = 64  # tokens per block a thread keeps in L2 while it sweeps the weight tiles
# (tokens, at most this many weight rows) per register tile, by whether the target has AVX-512
TILES = {True: {"linear": (4, 4), "swiglu": (4, 4)},
         False: {"linear": (2, 2), "swiglu": (2, 2)}}
DEFAULT_TILE = TILES[True]["linear"]


def _tile_tag(tile) -> str:
    return "" if tuple(tile) == DEFAULT_TILE else f"_t{tile[0]}{tile[1]}"


def _task(NT: int):
    """(first token, weight tile, tokens) of parallel task ``task`` over ``n`` tokens: task =
    (token block, weight tile), token block outermost.  Expressions, not TVMScript assignments
    (a scalar assigned in a kernel loop becomes a heap workspace per iteration on the CPU)."""
    def m0(task):
        return task // NT * MB

    return m0, (lambda task: task % NT), (lambda task, n: T.min(n - m0(task), MB))


def _passes(rows, TM: int):
    """The tile passes a task over ``rows`` tokens makes: its full TM-token tiles, then one
    pass per token left over."""
    return rows // TM + rows % TM


def _sum(acc, r, c, TN):
    """The reduced sum of tile element (token r, weight row c), as ``_reduce_macro`` leaves it."""
    return acc[0, 0, r * TN + c]


def _reduce_macro(K, wdt, TM, TN):
    """acc[0, 0, r * TN + c] = sum over k of x[m0 + r, k] * W[c0 + c, k] (``_sum``): TM x TN
    accumulators of VL lanes summed in ``float_dot``'s order (the GEMVs'), then one transposing
    reduction of the whole tile, which sums each output's lanes as the GEMVs' lane sum does
    (per-output halving sums went through memory: 12 % of a 768-long row's tile pass).  W is
    its format's ``elements``."""
    dot = dot_macro(K, wdt, TM, TN)
    lanes = T.ramp(0, 1, TM * TN) if TM * TN > 1 else 0

    @T.macro
    def accumulate(x, W, acc, m0, c0):
        dot(x, W, acc, m0, c0)
        # the tile's sums into lanes r * TN + c of acc[0, 0, :] (``_sum``), in registers
        acc[0, 0, lanes] = transpose_sums(
            [acc[r, c, T.ramp(0, 1, VL)] for r in range(TM) for c in range(TN)], VL)

    return accumulate


def _pass_macro(K, wdt, TM, TN, ahead_rows: int, slots: int):
    """``accumulate(x, W, acc, m0, c0, r0, p, passes, a)``: ``_reduce_macro``'s tile pass,
    after prefetching into L2 its share of the ``ahead_rows`` weight rows from ``r0`` (the next
    task's, contiguous in W).  A task makes ``passes`` passes (one per token tile) of ``slots``
    tile passes each; this is slot ``a`` of pass ``p``, and takes the rows whose index is that
    slot modulo all the task's slots, so the next task's rows arrive spread over the whole task
    (every row once, however few its token tiles).  The prefetch is a burst of a row's lines
    before the FMA loop, not a prefetch per step inside it: there it made LLVM keep the 1 KiB
    accumulator tile (a heap workspace) in memory, a store per multiply-add."""
    reduce = _reduce_macro(K, wdt, TM, TN)
    edt = FORMATS[wdt].element_dtype
    per_line = CACHE_LINE // np.dtype(edt).itemsize  # elements per cache line
    lines = -(-K // per_line)

    @T.macro
    def accumulate(x, W, acc, m0, c0, r0, p, passes, a):
        flat = T.decl_buffer((W.shape[0] * W.shape[1],), edt, data=W.data)
        if p * slots + a < ahead_rows:  # rows p * slots + a + i * (passes * slots)
            for i in range((ahead_rows - 1 - p * slots - a) // (passes * slots) + 1):
                for line in range(lines):
                    prefetch_hint(T.address_of(
                        flat[(r0 + p * slots + a + i * passes * slots) * K + line * per_line]),
                        L2)
        reduce(x, W, acc, m0, c0)

    return accumulate


def store_macro(epilogue: str, TN: int):
    """``store(y, acc, m0, c0, rows, bias, res)``: the reduced tile plus its epilogue into
    y[m0 : m0 + rows, c0 : c0 + TN]."""
    @T.macro
    def store(y, acc, m0, c0, rows, bias, res):
        for r, c in T.grid(rows, TN):
            if epilogue == "bias":
                y[m0 + r, c0 + c] = _sum(acc, r, c, TN) + bias[c0 + c]
            elif epilogue == "residual":
                y[m0 + r, c0 + c] = _sum(acc, r, c, TN) + res[m0 + r, c0 + c]
            else:
                y[m0 + r, c0 + c] = _sum(acc, r, c, TN)

    return store


def swiglu_store_macro(TN: int):
    """``store(act, g, u, m0, c0, rows)``: silu(gate tile) * up tile into
    act[m0 : m0 + rows, c0 : c0 + TN]."""
    @T.macro
    def store(act, g, u, m0, c0, rows):
        for r, c in T.grid(rows, TN):
            act[m0 + r, c0 + c] = silu_mul(_sum(g, r, c, TN), _sum(u, r, c, TN))

    return store


@cached
def linear(N: int, K: int, wdt: str, epilogue: str = "none", tile=DEFAULT_TILE):
    """y = x @ W.T (+ bias | + res) for a symbolic number of tokens n; ``tile`` = (tokens, at
    most this many weight rows) per register tile."""
    assert epilogue in EPILOGUES
    TM, TN = tile[0], pick_tile(N, tuple(t for t in (4, 2, 1) if t <= tile[1]))
    acc_main, acc_tail = _pass_macro(K, wdt, TM, TN, TN, 1), _pass_macro(K, wdt, 1, TN, TN, 1)
    store = store_macro(epilogue, TN)

    NT = N // TN
    m0, co, rows = _task(NT)

    @T.macro
    def tasks(x, W, y, bias, res, n):
        # a thread sweeps the weight tiles against one block of activations in its L2, each
        # tile prefetched into L2 by the task before (a thread runs a contiguous run of tasks)
        for task in T.parallel((n + MB - 1) // MB * NT):
            acc = scratch_buffer((TM, TN, VL))
            for mo in range(rows(task, n) // TM):
                acc_main(x, W, acc, m0(task) + mo * TM, co(task) * TN, co(task + 1) * TN, mo,
                         _passes(rows(task, n), TM), 0)
                store(y, acc, m0(task) + mo * TM, co(task) * TN, TM, bias, res)
            for mt in range(rows(task, n) % TM):
                acc_tail(x, W, acc, m0(task) + rows(task, n) // TM * TM + mt, co(task) * TN,
                         co(task + 1) * TN, rows(task, n) // TM + mt, _passes(rows(task, n), TM),
                         0)
                store(y, acc, m0(task) + rows(task, n) // TM * TM + mt, co(task) * TN, 1,
                      bias, res)

    @T.macro
    def body(x, W, y, bias, res, n):
        tasks(x, FORMATS[wdt].elements(W), y, bias, res, n)

    w_shape, w_dtype = FORMATS[wdt].storage(N, K)
    func = matmul_func(body, N, K, w_dtype, epilogue, token_dim(None), w_shape)
    return finalize(func, f"matmul_{epilogue}_{N}x{K}_{dtype_tag(wdt)}{_tile_tag(tile)}")


@cached
def linear_swiglu(I: int, K: int, wdt: str, tile=DEFAULT_TILE):
    """act = silu(x @ Wg.T) * (x @ Wu.T), W (2I, K) = gate and up rows in alternating runs
    (``params.gate_up_row``); act (n, I).  A task is one run of act rows (TN divides I and the
    run length): per token tile its gate tiles, then its up tiles, so a first pass reads W in
    memory order (as the SwiGLU GEMVs do, docs/design.md)."""
    TM, TN = tile[0], pick_tile(I, tuple(t for t in (4, 2, 1) if t <= tile[1]))
    assert GATE_UP_ROWS % TN == 0
    gate_row, up_row = gate_up_rows(I)
    RT = GATE_UP_ROWS // TN  # tiles per run
    RUNS = -(-I // GATE_UP_ROWS)
    m0, co, rows = _task(RUNS)
    RR = 2 * GATE_UP_ROWS  # W rows per run: its gate rows, then its up rows
    acc_main = _pass_macro(K, wdt, TM, TN, RR, 2 * RT)
    acc_tail = _pass_macro(K, wdt, 1, TN, RR, 2 * RT)
    n = token_dim(None)

    def c0(task, j):  # first act row of tile j of the task's run
        return co(task) * GATE_UP_ROWS + j * TN

    @T.macro
    def run(x, W, g, u, G, act, task, m, tm, acc, p, passes):
        # prefetching the next task's run (the next RR rows of W, wrapping) as it goes
        for j in range(RT):
            if c0(task, j) < I:
                acc(x, W, g, m, gate_row(c0(task, j)), co(task + 1) * RR, p, passes, j)
                for r, c in T.grid(tm, TN):
                    G[r, j * TN + c] = _sum(g, r, c, TN)
        for j in range(RT):
            if c0(task, j) < I:
                acc(x, W, u, m, up_row(c0(task, j)), co(task + 1) * RR, p, passes, RT + j)
                for r, c in T.grid(tm, TN):
                    act[m + r, c0(task, j) + c] = silu_mul(G[r, j * TN + c], _sum(u, r, c, TN))

    @T.macro
    def tasks(x, W, act, n):
        for task in T.parallel((n + MB - 1) // MB * RUNS):
            g = scratch_buffer((TM, TN, VL))
            u = scratch_buffer((TM, TN, VL))
            G = scratch_buffer((TM, GATE_UP_ROWS))
            for mo in range(rows(task, n) // TM):
                run(x, W, g, u, G, act, task, m0(task) + mo * TM, TM, acc_main, mo,
                    _passes(rows(task, n), TM))
            for mt in range(rows(task, n) % TM):
                run(x, W, g, u, G, act, task, m0(task) + rows(task, n) // TM * TM + mt, 1,
                    acc_tail, rows(task, n) // TM + mt, _passes(rows(task, n), TM))

    @T.macro
    def body(x, W, act, n):
        tasks(x, FORMATS[wdt].elements(W), act, n)

    w_shape, w_dtype = FORMATS[wdt].storage(2 * I, K)
    func = swiglu_matmul_func(body, I, K, w_dtype, n, w_shape)

    return finalize(func, f"matmul_swiglu_{I}x{K}_{dtype_tag(wdt)}{_tile_tag(tile)}")
