"""GPU decode GEMV: ``y[c] = sum_k xn[k] * W[c, k]``, W in its stored ``[N, K]`` layout.

One warp (32 lanes along ``threadIdx.x``) computes ``TN`` output rows; a block holds ``R``
warps along ``threadIdx.y``.  Lane ``l`` reads ``VW`` consecutive weights at
``(ko * 32 + l) * VW``, so a warp reads one contiguous run of the row per step (coalesced along
K) and reuses each loaded slice of x for its ``TN`` rows.  The 32 lane partials of a row meet
in a cross-thread reduction (warp shuffles on CUDA / Metal).  The optional RMSNorm is fused as
on the CPU: the block's threads share the sum of squares of x (each reads K / (32 R) of it),
and the scale is applied to the reduced dot product.

Quantized weights (``formats.py``): lane ``l`` takes whole 32-weight units ``ko * 32 + l``
(one unit's bytes are contiguous, and a warp's 32 units are one contiguous run), keeps the
unit's 32 inputs in registers and, per row, adds ``scale * sum x q (+ offset * sum x)`` for
each 16-weight half, the quants decoded from the stored bytes (``WeightFormat.quant``); x
stays float32.  bfloat16 weights take the float path, each decoded from its two stored bytes
(``WeightFormat.weight``: no 16-bit loads, as for the quantized formats' scales).

Buffers and signatures are the CPU ones (``gemv.py``):
  x (1, K)  [g (K,) float32]  W (N, K)  [bias (N,) | res (1, N)]  ->  y (1, N)
  SwiGLU: W (2I, K) gate / up rows in alternating runs -> act (1, I) = silu(gate) * up
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS, QBLOCK
from ...params import GATE_UP_ROWS
from ..common import cached, dtype_tag, gate_up_rows, pick_tile
from ..signatures import gemv_func
from .common import WARP, finalize

R = 4  # warps per block
MIN_BLOCKS = 264  # two blocks per SM of the largest GPU we target: more rows per warp only above


def _rows_per_warp(rows: int) -> int:
    """TN: 4 or 2 rows per warp when that still leaves enough blocks, else 1."""
    for tn in (4, 2):
        if rows % (R * tn) == 0 and rows // (R * tn) >= MIN_BLOCKS:
            return tn
    return 1


def _macros(K: int, TN: int, NP: int, norm: bool, wdt: str):
    """Macros over a warp's rows; ``NP`` partial sums per lane (TN, or 2 TN for SwiGLU).
    ``VW``: the lane's x registers (a quantized format's: one unit)."""
    fmt = FORMATS[wdt]
    VW = QBLOCK if fmt.quantized else pick_tile(K, (4, 2, 1))
    KO = K // (WARP * VW)  # full coalesced steps
    K0 = KO * WARP * VW
    KT = -(-(K - K0) // WARP)  # tail steps, one element per lane
    NT = WARP * R
    SQ = -(-K // NT)

    @T.macro
    def sum_squares(x, part, t):
        """part[NP] = this thread's share of sum(x^2) (thread t of the block's NT)."""
        part[NP] = T.float32(0)
        if norm:
            for j in range(SQ):
                if j * NT + t < K:
                    part[NP] = part[NP] + x[0, j * NT + t] * x[0, j * NT + t]

    @T.macro
    def dot_rows(x, g, W, part, xv, wv, p0, row0, tx):
        """part[p0 + r] = this lane's share of sum_k x[k] (* g[k]) * W[row0 + r, k], r < TN."""
        for r in range(TN):
            part[p0 + r] = T.float32(0)
        for ko in range(KO):
            for v in T.vectorized(VW):
                xv[v] = x[0, (ko * WARP + tx) * VW + v]
            if norm:
                for v in range(VW):
                    xv[v] = xv[v] * g[(ko * WARP + tx) * VW + v]
            for r in T.unroll(TN):
                if fmt.byte_rows:  # bfloat16: decoded from its bytes, element by element
                    for v in T.unroll(VW):
                        wv[v] = fmt.weight(W, row0 + r, (ko * WARP + tx) * VW + v)
                else:
                    for v in T.vectorized(VW):
                        wv[v] = W[row0 + r, (ko * WARP + tx) * VW + v]
                for v in T.unroll(VW):
                    part[p0 + r] = part[p0 + r] + xv[v] * T.Cast("float32", wv[v])
        for kt in range(KT):
            if K0 + kt * WARP + tx < K:
                xv[0] = x[0, K0 + kt * WARP + tx]
                if norm:
                    xv[0] = xv[0] * g[K0 + kt * WARP + tx]
                for r in T.unroll(TN):
                    part[p0 + r] = part[p0 + r] + xv[0] * fmt.weight(
                        W, row0 + r, K0 + kt * WARP + tx)

    U = K // QBLOCK
    UO = -(-U // WARP)

    @T.macro
    def dot_rows_quant(x, g, W, part, xv, wv, p0, row0, tx):
        """``dot_rows`` over quantized W: lane tx takes units ``uo * 32 + tx``; ``wv`` holds
        the half's dot product and the unit's sum of x."""
        for r in range(TN):
            part[p0 + r] = T.float32(0)
        for uo in range(UO):
            if uo * WARP + tx < U:
                wv[1] = T.float32(0)
                for v in T.unroll(QBLOCK):
                    xv[v] = x[0, (uo * WARP + tx) * QBLOCK + v]
                    if norm:
                        xv[v] = xv[v] * g[(uo * WARP + tx) * QBLOCK + v]
                    if fmt.has_offset:
                        wv[1] = wv[1] + xv[v]
                for r in T.unroll(TN):
                    for h in T.unroll(2):
                        wv[0] = T.float32(0)
                        for v in T.unroll(16):
                            wv[0] = wv[0] + xv[16 * h + v] * T.Cast("float32", fmt.quant(
                                W, row0 + r, uo * WARP + tx, 16 * h + v))
                        part[p0 + r] = part[p0 + r] + wv[0] * fmt.unit_scale(
                            W, row0 + r, uo * WARP + tx, h)
                    if fmt.has_offset:
                        part[p0 + r] = part[p0 + r] + wv[1] * fmt.unit_offset(
                            W, row0 + r, uo * WARP + tx)

    @T.macro
    def warp_sums(part, rs, p, ty, tx):
        """rs[ty, p] = sum over the warp's lanes of part[p] (cross-thread reduction)."""
        with T.sblock("warp_sum"):
            vy = T.axis.spatial(R, ty)
            vp = T.axis.spatial(NP + 1, p)
            vtx = T.axis.reduce(WARP, tx)
            T.reads(part[vp])
            T.writes(rs[vy, vp])
            with T.init():
                rs[vy, vp] = T.float32(0)
            rs[vy, vp] = rs[vy, vp] + part[vp]

    @T.macro
    def norm_scale(rs, st, eps):
        """st[0] = rsqrt(mean(x^2) + eps) from the R warps' partial sums, or 1 without a norm."""
        st[0] = T.float32(0)
        for w in range(R):
            st[0] = st[0] + rs[w, NP]
        st[0] = T.rsqrt(st[0] / T.float32(K) + T.float32(eps)) if norm else T.float32(1)

    return (VW, sum_squares, dot_rows_quant if fmt.quantized else dot_rows, warp_sums,
            norm_scale)


def _local(wdt: str, VW: int) -> tuple[tuple[int], str]:
    """(shape, dtype) of a lane's weight registers ``wv``: VW weights (bfloat16's widened to
    float32), or a quantized unit's two float32 sums."""
    fmt = FORMATS[wdt]
    if fmt.quantized:
        return (2,), "float32"
    return (VW,), "float32" if fmt.byte_rows else wdt



@cached
def gemv(N: int, K: int, wdt: str, epilogue: str = "none", norm_eps: float | None = None):
    """y = rmsnorm?(x) @ W.T (+ bias | + res).  ``norm_eps`` set -> takes the norm gain g."""
    norm = norm_eps is not None
    TN = _rows_per_warp(N)
    assert N % TN == 0
    VW, sum_squares, dot_rows, warp_sums, norm_scale = _macros(K, TN, TN, norm, wdt)
    wv_shape, wv_dtype = _local(wdt, VW)
    BLOCKS = -(-N // (R * TN))

    @T.macro
    def body(x, g, W, y, bias, res):
        part = T.sblock_alloc_buffer((TN + 1,), "float32", scope="local")
        xv = T.sblock_alloc_buffer((VW,), "float32", scope="local")
        wv = T.sblock_alloc_buffer(wv_shape, wv_dtype, scope="local")
        st = T.sblock_alloc_buffer((1,), "float32", scope="local")
        rs = T.sblock_alloc_buffer((R, TN + 1), "float32", scope="shared")
        for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
            for ty in T.thread_binding(R, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    sum_squares(x, part, ty * WARP + tx)
                    if (bx * R + ty) * TN < N:
                        dot_rows(x, g, W, part, xv, wv, 0, (bx * R + ty) * TN, tx)
            for p in range(TN + 1 if norm else TN):
                for ty in T.thread_binding(R, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        warp_sums(part, rs, p, ty, tx)
            for ty in T.thread_binding(R, thread="threadIdx.y"):
                for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                    norm_scale(rs, st, norm_eps or 0.0)
                    if tx < TN and (bx * R + ty) * TN + tx < N:
                        if epilogue == "bias":
                            y[0, (bx * R + ty) * TN + tx] = rs[ty, tx] * st[0] + bias[
                                (bx * R + ty) * TN + tx]
                        elif epilogue == "residual":
                            y[0, (bx * R + ty) * TN + tx] = rs[ty, tx] * st[0] + res[
                                0, (bx * R + ty) * TN + tx]
                        else:
                            y[0, (bx * R + ty) * TN + tx] = rs[ty, tx] * st[0]

    w_shape, w_dtype = FORMATS[wdt].storage(N, K)
    func = gemv_func(body, N, K, w_dtype, epilogue, norm, w_shape)
    tag = "_norm" if norm else ""
    return finalize(func, f"gemv{tag}_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")


@cached
def gemv_swiglu(I: int, K: int, wdt: str, norm_eps: float):
    """act = silu(xn @ Wg.T) * (xn @ Wu.T), xn = rmsnorm(x) * g; W (2I, K) = gate and up rows
    in alternating runs (``params.gate_up_row``): a warp's TN gate (or up) rows are adjacent."""
    TN = _rows_per_warp(I)
    assert GATE_UP_ROWS % TN == 0
    gate_row, up_row = gate_up_rows(I)
    VW, sum_squares, dot_rows, warp_sums, norm_scale = _macros(K, TN, 2 * TN, True, wdt)
    wv_shape, wv_dtype = _local(wdt, VW)
    w_shape, w_dtype = FORMATS[wdt].storage(2 * I, K)
    BLOCKS = -(-I // (R * TN))

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((1, K), "float32"), g: T.Buffer((K,), "float32"),
             W: T.Buffer(w_shape, w_dtype), act: T.Buffer((1, I), "float32")):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((2 * TN + 1,), "float32", scope="local")
            xv = T.sblock_alloc_buffer((VW,), "float32", scope="local")
            wv = T.sblock_alloc_buffer(wv_shape, wv_dtype, scope="local")
            st = T.sblock_alloc_buffer((1,), "float32", scope="local")
            rs = T.sblock_alloc_buffer((R, 2 * TN + 1), "float32", scope="shared")
            for bx in T.thread_binding(BLOCKS, thread="blockIdx.x"):
                for ty in T.thread_binding(R, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        sum_squares(x, part, ty * WARP + tx)
                        if (bx * R + ty) * TN < I:
                            dot_rows(x, g, W, part, xv, wv, 0, gate_row((bx * R + ty) * TN), tx)
                            dot_rows(x, g, W, part, xv, wv, TN, up_row((bx * R + ty) * TN), tx)
                for p in range(2 * TN + 1):
                    for ty in T.thread_binding(R, thread="threadIdx.y"):
                        for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                            warp_sums(part, rs, p, ty, tx)
                for ty in T.thread_binding(R, thread="threadIdx.y"):
                    for tx in T.thread_binding(WARP, thread="threadIdx.x"):
                        norm_scale(rs, st, norm_eps)
                        if tx < TN and (bx * R + ty) * TN + tx < I:
                            act[0, (bx * R + ty) * TN + tx] = (
                                rs[ty, tx] * st[0] / (T.float32(1) + T.exp(-rs[ty, tx] * st[0]))
                                * rs[ty, TN + tx] * st[0])

    return finalize(func, f"gemv_swiglu_{I}x{K}_{dtype_tag(wdt)}")
