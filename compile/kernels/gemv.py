"""Decode GEMV: ``y[c] = sum_k xn[k] * W[c, k]`` for one token, W in its stored ``[N, K]`` layout.

Optionally fused with the RMSNorm that precedes it (``xn = x * rsqrt(mean(x^2) + eps) * g``),
with a bias or a residual epilogue, or with SwiGLU over gate/up rows.  Rows are split into a
fixed number of parallel chunks; each chunk computes the norm of x once (K multiply-adds, noise
next to streaming its rows) and then streams its weight rows exactly once, ``TN`` rows at a time
against one register-resident slice of x.  Small matrices run serially: waking the thread pool
costs more than they do.

Buffers (float32 activations; W in the weight dtype; N, K static):
  x (1, K)  [g (K,) float32]  W (N, K)  [bias (N,) | res (1, N)]  ->  y (1, N)
  SwiGLU: W (2I, K) gate rows then up rows -> act (1, I) = silu(gate) * up
"""

from __future__ import annotations

from tvm.script import tirx as T

from .fastmath import fexp
from .common import VL, cached, dtype_tag, finalize, pick_tile

MAX_CHUNKS = 64
PARALLEL_MIN_ELEMS = 1 << 16  # below this many weights a GEMV runs on one core


def _plan(rows: int, elems: int):
    """(TN rows per tile, tiles, parallel chunks, tiles per chunk, loop kind) for ``rows``
    output rows reading ``elems`` weights."""
    tn = pick_tile(rows, (8, 4, 2, 1))
    tiles = rows // tn
    par = elems >= PARALLEL_MIN_ELEMS
    chunks = min(tiles, MAX_CHUNKS) if par else 1
    return tn, tiles, chunks, -(-tiles // chunks), (T.parallel if par else T.serial)


def _macros(K: int, TN: int, norm: bool, eps: float):
    KO, KT = K // VL, K % VL

    @T.macro
    def norm_scale(x, st):
        """st[0] = rsqrt(mean(x^2) + eps), or 1 without a norm."""
        part = T.decl_buffer((VL,), "float32", scope="local")
        for v in T.vectorized(VL):
            part[v] = T.float32(0)
        if norm:
            for ko in range(KO):
                for v in T.vectorized(VL):
                    part[v] = part[v] + x[0, ko * VL + v] * x[0, ko * VL + v]
            for v in range(KT):
                part[v] = part[v] + x[0, KO * VL + v] * x[0, KO * VL + v]
        for v in range(1, VL):
            part[0] = part[0] + part[v]
        st[0] = T.rsqrt(part[0] / T.float32(K) + T.float32(eps)) if norm else T.float32(1)

    @T.macro
    def dot_rows(x, g, W, acc, c0):
        """acc[r, 0] = sum_k x[k] (* g[k]) * W[c0 + r, k] for r < TN."""
        xv = T.decl_buffer((VL,), "float32", scope="local")
        for r, v in T.grid(TN, VL):
            acc[r, v] = T.float32(0)
        for ko in range(KO):
            for v in T.vectorized(VL):
                xv[v] = x[0, ko * VL + v] * g[ko * VL + v] if norm else x[0, ko * VL + v]
            for r in T.unroll(TN):  # unrolled: acc stays in registers
                for v in T.vectorized(VL):
                    acc[r, v] = acc[r, v] + xv[v] * T.Cast("float32", W[c0 + r, ko * VL + v])
        for v in range(KT):
            xv[v] = x[0, KO * VL + v] * g[KO * VL + v] if norm else x[0, KO * VL + v]
            for r in range(TN):
                acc[r, v] = acc[r, v] + xv[v] * T.Cast("float32", W[c0 + r, KO * VL + v])
        for r in range(TN):
            for v in range(1, VL):
                acc[r, 0] = acc[r, 0] + acc[r, v]

    return norm_scale, dot_rows


@cached
def gemv(N: int, K: int, wdt: str, epilogue: str = "none", norm_eps: float | None = None):
    """y = rmsnorm?(x) @ W.T (+ bias | + res).  ``norm_eps`` set -> takes the norm gain g."""
    TN, tiles, chunks, per, loop = _plan(N, N * K)
    norm = norm_eps is not None
    norm_scale, dot_rows = _macros(K, TN, norm, norm_eps or 0.0)

    @T.macro
    def body(x, g, W, y, bias, res):
        for c in loop(chunks):
            acc = T.decl_buffer((TN, VL), "float32", scope="local")
            st = T.decl_buffer((1,), "float32", scope="local")
            norm_scale(x, st)
            for t in range(per):
                if c * per + t < tiles:
                    dot_rows(x, g, W, acc, (c * per + t) * TN)
                    for r in range(TN):
                        if epilogue == "bias":
                            y[0, (c * per + t) * TN + r] = acc[r, 0] * st[0] + bias[(c * per + t) * TN + r]
                        elif epilogue == "residual":
                            y[0, (c * per + t) * TN + r] = acc[r, 0] * st[0] + res[0, (c * per + t) * TN + r]
                        else:
                            y[0, (c * per + t) * TN + r] = acc[r, 0] * st[0]

    x_ty, y_ty = T.Buffer((1, K), "float32"), T.Buffer((1, N), "float32")
    if norm and epilogue == "bias":
        @T.prim_func(s_tir=True)
        def func(x: x_ty, g: T.Buffer((K,), "float32"), W: T.Buffer((N, K), wdt),
                 bias: T.Buffer((N,), "float32"), y: y_ty):
            with T.sblock("root"):
                body(x, g, W, y, bias, None)
    elif norm:
        @T.prim_func(s_tir=True)
        def func(x: x_ty, g: T.Buffer((K,), "float32"), W: T.Buffer((N, K), wdt), y: y_ty):
            with T.sblock("root"):
                body(x, g, W, y, None, None)
    elif epilogue == "residual":
        @T.prim_func(s_tir=True)
        def func(x: x_ty, W: T.Buffer((N, K), wdt), res: T.Buffer((1, N), "float32"), y: y_ty):
            with T.sblock("root"):
                body(x, None, W, y, None, res)
    else:
        assert epilogue == "none", epilogue
        @T.prim_func(s_tir=True)
        def func(x: x_ty, W: T.Buffer((N, K), wdt), y: y_ty):
            with T.sblock("root"):
                body(x, None, W, y, None, None)
    tag = "_norm" if norm else ""
    return finalize(func, f"gemv{tag}_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")


@cached
def gemv_swiglu(I: int, K: int, wdt: str, norm_eps: float):
    """act = silu(xn @ Wg.T) * (xn @ Wu.T), xn = rmsnorm(x) * g; W (2I, K) = gate | up rows."""
    TN, tiles, chunks, per, loop = _plan(I, 2 * I * K)
    norm_scale, dot_rows = _macros(K, TN, True, norm_eps)

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((1, K), "float32"), g: T.Buffer((K,), "float32"),
             W: T.Buffer((2 * I, K), wdt), act: T.Buffer((1, I), "float32")):
        with T.sblock("root"):
            for c in loop(chunks):
                gate = T.decl_buffer((TN, VL), "float32", scope="local")
                up = T.decl_buffer((TN, VL), "float32", scope="local")
                st = T.decl_buffer((1,), "float32", scope="local")
                norm_scale(x, st)
                for t in range(per):
                    if c * per + t < tiles:
                        dot_rows(x, g, W, gate, (c * per + t) * TN)
                        dot_rows(x, g, W, up, I + (c * per + t) * TN)
                        for r in range(TN):
                            gate[r, 0] = gate[r, 0] * st[0]
                            act[0, (c * per + t) * TN + r] = (
                                gate[r, 0] / (T.float32(1) + fexp(-gate[r, 0])) * up[r, 0] * st[0])

    return finalize(func, f"gemv_swiglu_{I}x{K}_{dtype_tag(wdt)}")
