"""Decode GEMV: ``y[c] = sum_k xn[k] * W[c, k]`` for one token, W in its stored ``[N, K]`` layout.

Optionally fused with the RMSNorm that precedes it (``xn = x * rsqrt(mean(x^2) + eps) * g``),
with a bias or a residual epilogue, or with SwiGLU over gate/up rows.  Rows are split into a
fixed number of parallel chunks; each chunk computes the norm of x once (K multiply-adds, noise
next to streaming its rows) and then reads its rows one after the other, each front to back
with ``KU`` independent accumulators: one sequential stream per core is what the hardware
prefetcher follows best (interleaving 8 rows ran ~25 % slower per core).  Small matrices run
serially: waking the thread pool costs more than they do.

Buffers (float32 activations; W in the weight dtype; N, K static):
  x (1, K)  [g (K,) float32]  W (N, K)  [bias (N,) | res (1, N)]  ->  y (1, N)
  SwiGLU: W (2I, K) gate rows then up rows -> act (1, I) = silu(gate) * up
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import VL, cached, dtype_tag, finalize, tree_sum_macro
from .fastmath import fexp
from .signatures import gemv_func

MAX_CHUNKS = 64
PARALLEL_MIN_ELEMS = 1 << 16  # below this many weights a GEMV runs on one core
KU = 4  # independent accumulators along K (hides the FMA latency)


def _plan(rows: int, elems: int):
    """(parallel chunks, rows per chunk, loop kind) for ``rows`` outputs reading ``elems``
    weights."""
    par = elems >= PARALLEL_MIN_ELEMS
    chunks = min(rows, MAX_CHUNKS) if par else 1
    return chunks, -(-rows // chunks), (T.parallel if par else T.serial)


def _macros(K: int, norm: bool, eps: float):
    KO, KT = K // (VL * KU), K % (VL * KU)
    tree_sum = tree_sum_macro(VL)
    tree_sum_acc = tree_sum_macro(VL, row0=True)

    @T.macro
    def norm_scale(x, st):
        """st[0] = rsqrt(mean(x^2) + eps), or 1 without a norm."""
        part = T.decl_buffer((VL,), "float32", scope="local")
        for v in T.vectorized(VL):
            part[v] = T.float32(0)
        if norm:
            for ko in range(K // VL):
                for v in T.vectorized(VL):
                    part[v] = part[v] + x[0, ko * VL + v] * x[0, ko * VL + v]
            for v in range(K % VL):
                part[v] = part[v] + x[0, K // VL * VL + v] * x[0, K // VL * VL + v]
        tree_sum(part)
        st[0] = T.rsqrt(part[0] / T.float32(K) + T.float32(eps)) if norm else T.float32(1)

    @T.macro
    def load_x(x, g, xv, k0, width):
        """xv[:width] = x[k0:k0+width] (* g[k0:k0+width])."""
        if norm:
            for v in T.vectorized(width):
                xv[v] = x[0, k0 + v] * g[k0 + v]
        else:
            for v in T.vectorized(width):
                xv[v] = x[0, k0 + v]

    @T.macro
    def dot_row(x, g, W, acc, c):
        """acc[0, 0] = sum_k x[k] (* g[k]) * W[c, k], reading the row front to back."""
        xv = T.decl_buffer((VL,), "float32", scope="local")
        for u, v in T.grid(KU, VL):
            acc[u, v] = T.float32(0)
        for ko in range(KO):
            for u in T.unroll(KU):
                load_x(x, g, xv, (ko * KU + u) * VL, VL)
                for v in T.vectorized(VL):
                    acc[u, v] = acc[u, v] + xv[v] * T.Cast("float32",
                                                           W[c, (ko * KU + u) * VL + v])
        for kt in range(KT // VL):
            load_x(x, g, xv, KO * KU * VL + kt * VL, VL)
            for v in T.vectorized(VL):
                acc[0, v] = acc[0, v] + xv[v] * T.Cast("float32", W[c, KO * KU * VL + kt * VL + v])
        if KT % VL != 0:
            load_x(x, g, xv, K - KT % VL, KT % VL)
            for v in range(KT % VL):
                acc[1, v] = acc[1, v] + xv[v] * T.Cast("float32", W[c, K - KT % VL + v])
        for u in range(1, KU):
            for v in T.vectorized(VL):
                acc[0, v] = acc[0, v] + acc[u, v]
        tree_sum_acc(acc)

    return norm_scale, dot_row


@cached
def gemv(N: int, K: int, wdt: str, epilogue: str = "none", norm_eps: float | None = None):
    """y = rmsnorm?(x) @ W.T (+ bias | + res).  ``norm_eps`` set -> takes the norm gain g."""
    chunks, per, loop = _plan(N, N * K)
    norm = norm_eps is not None
    norm_scale, dot_row = _macros(K, norm, norm_eps or 0.0)

    @T.macro
    def body(x, g, W, y, bias, res):
        for c in loop(chunks):
            acc = T.decl_buffer((KU, VL), "float32", scope="local")
            st = T.decl_buffer((1,), "float32", scope="local")
            norm_scale(x, st)
            for t in range(per):
                if c * per + t < N:
                    dot_row(x, g, W, acc, c * per + t)
                    if epilogue == "bias":
                        y[0, c * per + t] = acc[0, 0] * st[0] + bias[c * per + t]
                    elif epilogue == "residual":
                        y[0, c * per + t] = acc[0, 0] * st[0] + res[0, c * per + t]
                    else:
                        y[0, c * per + t] = acc[0, 0] * st[0]

    func = gemv_func(body, N, K, wdt, epilogue, norm)
    tag = "_norm" if norm else ""
    return finalize(func, f"gemv{tag}_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")


@cached
def gemv_swiglu(I: int, K: int, wdt: str, norm_eps: float):
    """act = silu(xn @ Wg.T) * (xn @ Wu.T), xn = rmsnorm(x) * g; W (2I, K) = gate | up rows."""
    chunks, per, loop = _plan(I, 2 * I * K)
    norm_scale, dot_row = _macros(K, True, norm_eps)

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((1, K), "float32"), g: T.Buffer((K,), "float32"),
             W: T.Buffer((2 * I, K), wdt), act: T.Buffer((1, I), "float32")):
        with T.sblock("root"):
            for c in loop(chunks):
                gate = T.decl_buffer((KU, VL), "float32", scope="local")
                up = T.decl_buffer((KU, VL), "float32", scope="local")
                st = T.decl_buffer((1,), "float32", scope="local")
                norm_scale(x, st)
                for t in range(per):
                    if c * per + t < I:
                        dot_row(x, g, W, gate, c * per + t)
                        dot_row(x, g, W, up, I + c * per + t)
                        gate[0, 0] = gate[0, 0] * st[0]
                        act[0, c * per + t] = (
                            gate[0, 0] / (T.float32(1) + fexp(-gate[0, 0])) * up[0, 0] * st[0])

    return finalize(func, f"gemv_swiglu_{I}x{K}_{dtype_tag(wdt)}")
