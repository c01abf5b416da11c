"""Decode GEMV: ``y[c] = sum_k xn[k] * W[c, k]`` for one token, W in its stored ``[N, K]`` layout.

Optionally fused with the RMSNorm that precedes it (``xn = x * rsqrt(mean(x^2) + eps) * g``,
computed once per call into a K-element scratch before the row loop; see ``x_dtype`` for when
that scratch, or a copy of x, is float16, and ``row_pairs`` for when two rows share each pass
over x), with a bias or a residual epilogue, or with SwiGLU over gate/up rows.  Rows are
processed in units of ``RG`` rows (SwiGLU: ``SWIGLU_UNIT_TILES`` tiles of RG act rows, each
tile's gate rows then its up rows), each row front to back in ``float_dot``'s order (one
chain of VL lanes, the batched kernels' too, so a row sums alike in every kernel): one
sequential stream per core is what the hardware prefetcher follows best.
Units are shared out by ``claimed_units``: each parallel lane owns a contiguous run of them, and
the last lane a thread runs then claims the units other threads have not reached, from the far
end (see there).  A row leaves its 16 partial sums in a ``RG``-row tile; the tile is reduced and its epilogue (bias,
residual, SiLU) applied for all RG rows at once, so no row ends in a serial horizontal-sum / exp
/ divide chain.  Small matrices run serially: waking the thread pool costs more than they do.

SwiGLU reads a unit's RG-row tiles of gate rows and up rows in turn: W stores them so
(``params.gate_up_row``), which makes a unit one contiguous run of W.  The measurements behind
these choices are in docs/design.md.

Buffers (float32 activations; W in the weight dtype, bfloat16 as its (N, 2K) uint8 bytes, read
as uint16 and widened exactly by the format's ``widen``; N, K static):
  x (1, K)  [g (K,) float32]  W (N, K)  [bias (N,) | res (1, N)]  ->  y (1, N)
  SwiGLU: W (2I, K) gate / up rows in alternating runs -> act (1, I) = silu(gate) * up
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from ...params import GATE_UP_ROWS
from ..common import cached, dtype_tag, finalize, gate_up_rows
from ..signatures import gemv_func
from .fastmath import silu_mul
from .float_dot import X_L1_BYTES, dot_macro, x_dtype
from .simd import (NTA, VL, claimed_units, lane_slice, lane_sum_macro, prefetch_ahead_macro,
                   scratch_buffer)

PARALLEL_MIN_ELEMS = 1 << 16  # below this many weights a GEMV runs on one core
STEP = 4  # VL-blocks per unrolled step of a row (and per software prefetch)
SWIGLU_UNIT_TILES = 8  # RG-row tiles per SwiGLU unit: 128 act rows, 256 contiguous W rows


# Each row step also prefetches the weights this many bytes ahead as data read once
# (``prefetchnta``), on top of the hardware prefetcher; distances measured in docs/design.md.
PREFETCH_BYTES = {"float32": 1536, "float16": 6144, "bfloat16": 6144}
RG = 16  # rows whose partial sums are reduced (and whose epilogue runs) together
SWIGLU_UNIT_ROWS = RG * SWIGLU_UNIT_TILES  # act rows per SwiGLU unit


def _macros(K: int, eps: float, wdt: str, locality: int):
    """Macros over W as its format's ``elements`` (one element a weight, ``widen``-ed)."""
    fmt, xdt = FORMATS[wdt], x_dtype(K, wdt)
    step_prefetch = prefetch_ahead_macro(STEP * VL, fmt.element_dtype, PREFETCH_BYTES[wdt],
                                         locality)
    lane_sum = lane_sum_macro(VL)

    @T.macro
    def normalize(x, g, xn):
        """xn = x * rsqrt(mean(x^2) + eps) * g."""
        part = scratch_buffer((VL,))
        st = scratch_buffer((1,))
        for v in T.vectorized(VL):
            part[v] = T.float32(0)
        for ko in range(K // VL):
            for v in T.vectorized(VL):
                part[v] = part[v] + x[0, ko * VL + v] * x[0, ko * VL + v]
        for v in range(K % VL):
            part[v] = part[v] + x[0, K // VL * VL + v] * x[0, K // VL * VL + v]
        st[0] = T.float32(0)
        for v in range(VL):
            st[0] = st[0] + part[v]
        st[0] = T.rsqrt(st[0] / T.float32(K) + T.float32(eps))
        for k in T.vectorized(K):
            xn[0, k] = T.Cast(xn.dtype, x[0, k] * g[k] * st[0])

    @T.macro
    def prefetch(W, c, k):
        """Prefetch the STEP * VL weights ``PREFETCH_BYTES`` past W[c, k] (rows are contiguous, so
        past the row's end is the next row's start; past W's end is harmless)."""
        flat = T.decl_buffer((W.shape[0] * K,), W.dtype, data=W.data)
        step_prefetch(flat, c * K + k)

    one = dot_macro(K, wdt, 1, 1, STEP, xdt, prefetch)
    two = dot_macro(K, wdt, 1, 2, STEP, xdt)

    @T.macro
    def dot_row(xs, W, acc, R, r, c):
        """R[r, :] = the VL lane sums of xs . W[c, :], reading the row front to back."""
        one(xs, W, acc, 0, c)
        for v in T.vectorized(VL):
            R[r, v] = acc[0, 0, v]

    @T.macro
    def dot_row_pair(xs, W, acc, R, r, c):
        """R[r, :], R[r + 1, :] for rows c and c + 1, each x vector loaded once for both."""
        two(xs, W, acc, 0, c)
        for v in T.vectorized(VL):
            R[r, v] = acc[0, 0, v]
            R[r + 1, v] = acc[0, 1, v]

    @T.macro
    def tile_rows(xs, W, acc, R, S, s0, row0, n_valid, pairs=False):
        """S[s0 + r] = xs . W[row0 + r, :] for the first ``n_valid`` rows of an RG-row tile, 0
        after; with ``pairs``, two rows per pass over x."""
        if pairs:
            for r2 in range(RG // 2):
                if 2 * r2 + 1 < n_valid:
                    dot_row_pair(xs, W, acc, R, 2 * r2, row0 + 2 * r2)
                else:
                    for v in T.vectorized(VL):
                        R[2 * r2, v] = T.float32(0)
                        R[2 * r2 + 1, v] = T.float32(0)
                    if 2 * r2 < n_valid:
                        dot_row(xs, W, acc, R, 2 * r2, row0 + 2 * r2)
        else:
            for r in range(RG):
                if r < n_valid:
                    dot_row(xs, W, acc, R, r, row0 + r)
                else:
                    for v in T.vectorized(VL):
                        R[r, v] = T.float32(0)
        for r in range(RG):  # independent across rows: no serial chain per row
            lane_sum(R, r)
            S[s0 + r] = R[r, 0]

    return normalize, tile_rows


def row_pairs(K: int, wdt: str) -> bool:
    """Whether the GEMV reads two rows per pass over x: float32 weights whose float32 x would
    crowd the streamed rows out of L1 (K > 4096), so x is re-read half as often (float16 weights
    read x in float16 instead, see ``x_dtype``); at K <= 4096 pairs ran slower
    (docs/design.md)."""
    return wdt == "float32" and K * 4 > X_L1_BYTES


@cached
def gemv(N: int, K: int, wdt: str, epilogue: str = "none", norm_eps: float | None = None,
         locality: int = NTA):
    """y = rmsnorm?(x) @ W.T (+ bias | + res).  ``norm_eps`` set -> takes the norm gain g;
    ``locality``: the weights' software prefetch hint (the target's, ``cpu.prefetch_locality``)."""
    norm, xdt, pairs = norm_eps is not None, x_dtype(K, wdt), row_pairs(K, wdt)
    normalize, tile_rows = _macros(K, norm_eps or 0.0, wdt, locality)
    run_units, lanes = claimed_units(-(-N // RG), N * K >= PARALLEL_MIN_ELEMS)

    @T.macro
    def epilogue_store(y, bias, res, S, row, r):
        if epilogue == "bias":
            y[0, row] = S[r] + bias[row]
        elif epilogue == "residual":
            y[0, row] = S[r] + res[0, row]
        else:
            y[0, row] = S[r]

    @T.macro
    def unit(lane, u, R_all, xs, W, y, bias, res):
        """Rows [u * RG, u * RG + RG) below N, on ``lane``'s slice of the reduction scratch."""
        acc = scratch_buffer((1, 2, VL))
        S = scratch_buffer((RG,))
        R = lane_slice(R_all, lane, (RG, VL))
        tile_rows(xs, W, acc, R, S, 0, u * RG, T.min(RG, N - u * RG), pairs)
        for r in range(RG):
            if r < N - u * RG:
                epilogue_store(y, bias, res, S, u * RG + r, r)

    @T.macro
    def rows(xs, W, y, bias, res):
        R_all = T.decl_buffer((lanes, RG, VL), "float32")  # 1 KiB per lane: one heap block
        run_units(unit, R_all, xs, FORMATS[wdt].elements(W), y, bias, res)

    @T.macro
    def body(x, g, W, y, bias, res):
        if norm:
            xn = T.decl_buffer((1, K), xdt)
            normalize(x, g, xn)
            rows(xn, W, y, bias, res)
        elif xdt != "float32":
            xh = T.decl_buffer((1, K), xdt)
            for k in T.vectorized(K):
                xh[0, k] = T.Cast(xdt, x[0, k])
            rows(xh, W, y, bias, res)
        else:
            rows(x, W, y, bias, res)

    w_shape, w_dtype = FORMATS[wdt].storage(N, K)
    func = gemv_func(body, N, K, w_dtype, epilogue, norm, w_shape)
    tag = "_norm" if norm else ""
    return finalize(func, f"gemv{tag}_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")



@T.macro
def swiglu_store(act, gate, up, u, I):
    """act[0, u UR + r] = silu(gate[r]) * up[r] for unit u's rows below I (UR: the unit's
    SWIGLU_UNIT_ROWS; gate / up hold defined values past I)."""
    for r in T.vectorized(SWIGLU_UNIT_ROWS):
        gate[r] = silu_mul(gate[r], up[r])
    for r in range(T.min(SWIGLU_UNIT_ROWS, I - u * SWIGLU_UNIT_ROWS)):
        act[0, u * SWIGLU_UNIT_ROWS + r] = gate[r]

@cached
def gemv_swiglu(I: int, K: int, wdt: str, norm_eps: float, locality: int = NTA):
    """act = silu(xn @ Wg.T) * (xn @ Wu.T), xn = rmsnorm(x) * g; W (2I, K) = gate and up rows
    in alternating runs (``params.gate_up_row``); ``locality`` as for ``gemv``."""
    normalize, tile_rows = _macros(K, norm_eps, wdt, locality)
    xdt = x_dtype(K, wdt)
    UT = SWIGLU_UNIT_TILES
    UR = RG * UT  # act rows per unit
    run_units, lanes = claimed_units(-(-I // UR), 2 * I * K >= PARALLEL_MIN_ELEMS)
    assert RG == GATE_UP_ROWS  # a tile's gate (or up) rows are one run of W
    gate_row, up_row = gate_up_rows(I)
    w_shape, w_dtype = FORMATS[wdt].storage(2 * I, K)

    @T.macro
    def unit(lane, u, R_all, xn, W, act):
        """act rows [u * UR, u * UR + UR) below I: per RG-row tile its gate rows, then its up
        rows (adjacent in W, so the unit is one contiguous run of W), then silu(gate) * up."""
        acc = scratch_buffer((1, 2, VL))
        gate = scratch_buffer((UR,))
        up = scratch_buffer((UR,))
        R = lane_slice(R_all, lane, (RG, VL))
        for t in range(UT):
            if u * UR + t * RG < I:
                tile_rows(xn, W, acc, R, gate, t * RG, gate_row(u * UR + t * RG),
                          T.min(RG, I - u * UR - t * RG))
                tile_rows(xn, W, acc, R, up, t * RG, up_row(u * UR + t * RG),
                          T.min(RG, I - u * UR - t * RG))
            else:  # past I in the last unit: defined values for the vector SiLU (never stored)
                for r in T.vectorized(RG):
                    gate[t * RG + r] = T.float32(0)
                    up[t * RG + r] = T.float32(0)
        swiglu_store(act, gate, up, u, I)

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((1, K), "float32"), g: T.Buffer((K,), "float32"),
             W: T.Buffer(w_shape, w_dtype), act: T.Buffer((1, I), "float32")):
        with T.sblock("root"):
            xn = T.decl_buffer((1, K), xdt)
            normalize(x, g, xn)
            R_all = T.decl_buffer((lanes, RG, VL), "float32")
            run_units(unit, R_all, xn, FORMATS[wdt].elements(W), act)

    return finalize(func, f"gemv_swiglu_{I}x{K}_{dtype_tag(wdt)}")
