"""The k-quant quantizer's searches, compiled for this host: ggml's reference quantizers
(``quantize_row_q4_K_ref`` / ``q5_K`` / ``q6_K``, what ``llama-quantize`` runs without an
importance matrix) fit each sub-block's scale by trying a grid of candidate scales, 16-21
passes over the sub-block. In numpy that is minutes for a 1.1B model; as one TIR kernel, a
sub-block per vector lane, it is seconds.

The kernels repeat ggml's float32 operations in ggml's order, one rounding per operation, so the
bytes equal those of ggml's reference quantizer (for finite weights within float16's range: where
ggml's magic-number rounding overflows, on values ggml itself turns to garbage, a sub-block of
only subnormal weights or a super-block whose scale overflows float16, the unused quants or the
overflowed fields may differ). That needs multiply-adds left unfused: LLVM
fuses them into FMAs wherever the target has the instruction, so the kernels are built for the
host without it (x86: AVX2 without FMA, 8 lanes; see ``_target``). The super-block step after
the search (6- or 8-bit sub-block scales, requantizing against them) is cheap and stays in
numpy (``formats``)."""

from __future__ import annotations

import functools
import platform

import numpy as np
import tvm
from tvm.script import tirx as T

from paged_decode.runtime.host_memory import HostArena, to_tvm

from .targets import host_cpu

LANES = 8  # sub-blocks per vector: AVX2's 8 float32 lanes (AVX-512 implies FMA in LLVM)
_ALIGN = 64  # the alignment TIR assumes of a tensor it takes over from numpy


def _target() -> tvm.target.Target:
    """This host's CPU without FMA (x86: AVX2 where the CPU has it, else SSE). Elsewhere LLVM's
    default for the host, which may fuse: the bytes can then differ from ggml's in a few
    sub-blocks, the quantizer being the same."""
    host = {"kind": "llvm", "mcpu": host_cpu()}
    if platform.machine().lower() in ("x86_64", "amd64"):
        host["mattr"] = ["-fma", "-fma4"]
    return tvm.target.Target(host)


def _loader(m: int):
    """``load(xr, x, g, n)``: rows g V .. g V + V - 1 of xr (n, m) into x (1, m, V), a row per
    lane; lanes past the last row repeat it (their results are not stored)."""
    V = LANES

    @T.macro
    def load(xr, x, g, n):
        for v in range(V):
            for i in range(m):
                x[0, i, v] = xr[T.min(g * V + v, n - 1), i]

    return load


def _min_scale_search(nmax: int, nstep: int):
    """``search(x, cand, out, L)``: ggml's ``make_qkx2_quants`` over 32-weight sub-blocks with
    the weights ``sqrt(mean(x^2)) + |x|``, a row of x (n, 32) per sub-block, LANES of them per
    vector; ``cand`` the nstep + 1 numerators ``rmin + rdelta * is + nmax``; out (n, 2) gets
    (scale, min) with x ~ scale * L - min, L (n, 32) the quants. A taken candidate moves the
    minimum the next candidates start from, as in ggml."""
    V, NM = LANES, float(nmax)
    load = _loader(32)

    @T.prim_func
    def search(x_h: T.handle, cand: T.Buffer((nstep + 1,), "float32"), out_h: T.handle,
               l_h: T.handle):
        T.func_attr({"global_symbol": "search", "tirx.noalias": True})
        n = T.int64()
        xr = T.match_buffer(x_h, (n, 32), "float32")
        out = T.match_buffer(out_h, (n, 2), "float32")
        L = T.match_buffer(l_h, (n, 32), "uint8")
        for g in T.parallel((n + V - 1) // V):
            x = T.decl_buffer((1, 32, V), "float32")
            w = T.decl_buffer((32, V), "float32")
            la = T.decl_buffer((32, V), "float32")  # this candidate's quants
            lb = T.decl_buffer((32, V), "float32")  # the best so far
            # 0 min, 1 max, 2 sum_w, 3 sum_x, 4 av_x, 5 iscale, 6 scale, 7 best error,
            # 8 sum_l, 9 sum_l2, 10 sum_xl, 11 this scale, 12 this min, 13 error, 14 the clamped
            # minimum before the search
            s = T.decl_buffer((15, V), "float32")
            load(xr, x, g, n)
            for v in T.vectorized(V):
                s[4, v] = T.float32(0)
            for i in range(32):
                for v in T.vectorized(V):
                    s[4, v] = s[4, v] + x[0, i, v] * x[0, i, v]
            for v in T.vectorized(V):
                s[4, v] = T.sqrt(s[4, v] / T.float32(32))
            for i in range(32):
                for v in T.vectorized(V):
                    w[i, v] = s[4, v] + T.fabs(x[0, i, v])
            for v in T.vectorized(V):
                s[0, v] = x[0, 0, v]
                s[1, v] = x[0, 0, v]
                s[2, v] = w[0, v]
                s[3, v] = w[0, v] * x[0, 0, v]
            for i in range(1, 32):
                for v in T.vectorized(V):
                    s[0, v] = T.if_then_else(x[0, i, v] < s[0, v], x[0, i, v], s[0, v])
                    s[1, v] = T.if_then_else(x[0, i, v] > s[1, v], x[0, i, v], s[1, v])
                    s[2, v] = s[2, v] + w[i, v]
                    s[3, v] = s[3, v] + w[i, v] * x[0, i, v]
            for v in T.vectorized(V):
                s[0, v] = T.if_then_else(s[0, v] > T.float32(0), T.float32(0), s[0, v])
                s[14, v] = s[0, v]
                s[5, v] = T.float32(NM) / (s[1, v] - s[0, v])
                s[6, v] = T.float32(1) / s[5, v]
                s[7, v] = T.float32(0)
            for i in range(32):
                for v in T.vectorized(V):
                    lb[i, v] = T.max(T.min(T.nearbyint(s[5, v] * (x[0, i, v] - s[0, v])),
                                           T.float32(NM)), T.float32(0))
                    s[13, v] = s[6, v] * lb[i, v] + s[0, v] - x[0, i, v]
                    s[7, v] = s[7, v] + w[i, v] * (s[13, v] * s[13, v])
            for c in range(nstep + 1):
                for v in T.vectorized(V):
                    s[5, v] = cand[c] / (s[1, v] - s[0, v])
                    s[8, v] = T.float32(0)
                    s[9, v] = T.float32(0)
                    s[10, v] = T.float32(0)
                for i in range(32):
                    for v in T.vectorized(V):
                        la[i, v] = T.max(T.min(T.nearbyint(s[5, v] * (x[0, i, v] - s[0, v])),
                                               T.float32(NM)), T.float32(0))
                        s[8, v] = s[8, v] + w[i, v] * la[i, v]
                        s[9, v] = s[9, v] + w[i, v] * la[i, v] * la[i, v]
                        s[10, v] = s[10, v] + w[i, v] * la[i, v] * x[0, i, v]
                for v in T.vectorized(V):
                    # D = sum_w sum_l2 - sum_l^2 lands in s[13] until the error needs it
                    s[13, v] = s[2, v] * s[9, v] - s[8, v] * s[8, v]
                    s[11, v] = (s[2, v] * s[10, v] - s[3, v] * s[8, v]) / s[13, v]
                    s[12, v] = (s[9, v] * s[3, v] - s[8, v] * s[10, v]) / s[13, v]
                    s[11, v] = T.if_then_else(s[12, v] > T.float32(0), s[10, v] / s[9, v],
                                              s[11, v])
                    s[12, v] = T.if_then_else(s[12, v] > T.float32(0), T.float32(0), s[12, v])
                    # a candidate without D > 0 is never taken: its error becomes +inf
                    s[13, v] = T.if_then_else(s[13, v] > T.float32(0), T.float32(0),
                                              T.float32("inf"))
                for i in range(32):
                    for v in T.vectorized(V):
                        s[8, v] = s[11, v] * la[i, v] + s[12, v] - x[0, i, v]
                        s[13, v] = s[13, v] + w[i, v] * (s[8, v] * s[8, v])
                for i in range(32):
                    for v in T.vectorized(V):
                        lb[i, v] = T.if_then_else(s[13, v] < s[7, v], la[i, v], lb[i, v])
                for v in T.vectorized(V):
                    s[6, v] = T.if_then_else(s[13, v] < s[7, v], s[11, v], s[6, v])
                    s[0, v] = T.if_then_else(s[13, v] < s[7, v], s[12, v], s[0, v])
                    s[7, v] = T.if_then_else(s[13, v] < s[7, v], s[13, v], s[7, v])
            # max == min: every quant 0, scale 0, the minimum as found
            for v in T.vectorized(V):
                s[13, v] = T.if_then_else(s[1, v] == s[14, v], T.float32(0), s[6, v])
                s[12, v] = -T.if_then_else(s[1, v] == s[14, v], s[14, v], s[0, v])
            for i in range(32):
                for v in T.vectorized(V):
                    lb[i, v] = T.if_then_else(s[1, v] == s[14, v], T.float32(0), lb[i, v])
            for v in range(V):
                if g * V + v < n:
                    out[g * V + v, 0] = s[13, v]
                    out[g * V + v, 1] = s[12, v]
                    for i in range(32):
                        L[g * V + v, i] = T.Cast("uint8", lb[i, v])

    return search


def _symmetric_search(nmax: int, n: int):
    """``search(x, cand, out, L)``: ggml's ``make_qx_quants`` with ``rmse_type`` 1 (weights
    x^2) over n-weight sub-blocks, a row of x (rows, n) each: ``cand`` the 18 numerators
    ``-(nmax + 0.1 is)`` for is = -9..9 but 0; out (rows,) the scale, L (rows, n) the
    quants + nmax."""
    V, NM = LANES, float(nmax)
    load = _loader(n)

    @T.prim_func
    def search(x_h: T.handle, cand: T.Buffer((18,), "float32"), out_h: T.handle, l_h: T.handle):
        T.func_attr({"global_symbol": "search", "tirx.noalias": True})
        rows = T.int64()
        xr = T.match_buffer(x_h, (rows, n), "float32")
        out = T.match_buffer(out_h, (rows,), "float32")
        L = T.match_buffer(l_h, (rows, n), "uint8")
        for g in T.parallel((rows + V - 1) // V):
            x = T.decl_buffer((1, n, V), "float32")
            la = T.decl_buffer((n, V), "float32")
            lb = T.decl_buffer((n, V), "float32")
            # 0 amax, 1 max, 2 iscale, 3 sumlx, 4 suml2, 5 scale, 6 best, 7 w
            s = T.decl_buffer((8, V), "float32")
            load(xr, x, g, rows)
            for v in T.vectorized(V):
                s[0, v] = T.float32(0)
                s[1, v] = T.float32(0)
            for i in range(n):
                for v in T.vectorized(V):
                    s[1, v] = T.if_then_else(T.fabs(x[0, i, v]) > s[0, v], x[0, i, v], s[1, v])
                    s[0, v] = T.if_then_else(T.fabs(x[0, i, v]) > s[0, v], T.fabs(x[0, i, v]),
                                             s[0, v])
            for v in T.vectorized(V):
                s[2, v] = T.float32(-NM) / s[1, v]
                s[3, v] = T.float32(0)
                s[4, v] = T.float32(0)
            for i in range(n):
                for v in T.vectorized(V):
                    lb[i, v] = T.max(T.min(T.nearbyint(s[2, v] * x[0, i, v]), T.float32(NM - 1)),
                                     T.float32(-NM))
                    s[7, v] = x[0, i, v] * x[0, i, v]
                    s[3, v] = s[3, v] + s[7, v] * x[0, i, v] * lb[i, v]
                    s[4, v] = s[4, v] + s[7, v] * lb[i, v] * lb[i, v]
            for v in T.vectorized(V):
                s[5, v] = T.if_then_else(s[4, v] != T.float32(0), s[3, v] / s[4, v],
                                         T.float32(0))
                s[6, v] = s[5, v] * s[3, v]
            for c in range(18):
                for v in T.vectorized(V):
                    s[2, v] = cand[c] / s[1, v]
                    s[3, v] = T.float32(0)
                    s[4, v] = T.float32(0)
                for i in range(n):
                    for v in T.vectorized(V):
                        la[i, v] = T.max(T.min(T.nearbyint(s[2, v] * x[0, i, v]),
                                               T.float32(NM - 1)), T.float32(-NM))
                        s[7, v] = x[0, i, v] * x[0, i, v]
                        s[3, v] = s[3, v] + s[7, v] * x[0, i, v] * la[i, v]
                        s[4, v] = s[4, v] + s[7, v] * la[i, v] * la[i, v]
                for v in T.vectorized(V):
                    # taken: suml2 > 0 and sumlx^2 > best * suml2; s[7] holds the verdict
                    s[7, v] = T.if_then_else(
                        T.And(s[4, v] > T.float32(0), s[3, v] * s[3, v] > s[6, v] * s[4, v]),
                        T.float32(1), T.float32(0))
                for i in range(n):
                    for v in T.vectorized(V):
                        lb[i, v] = T.if_then_else(s[7, v] > T.float32(0), la[i, v], lb[i, v])
                for v in T.vectorized(V):
                    s[5, v] = T.if_then_else(s[7, v] > T.float32(0), s[3, v] / s[4, v], s[5, v])
                    s[6, v] = T.if_then_else(s[7, v] > T.float32(0), s[5, v] * s[3, v], s[6, v])
            # every |x| below ggml's GROUP_MAX_EPS: scale 0, quants 0
            for v in T.vectorized(V):
                s[5, v] = T.if_then_else(s[0, v] < T.float32(1e-15), T.float32(0), s[5, v])
            for i in range(n):
                for v in T.vectorized(V):
                    lb[i, v] = T.if_then_else(s[0, v] < T.float32(1e-15), T.float32(0),
                                              lb[i, v] + T.float32(NM))
            for v in range(V):
                if g * V + v < rows:
                    out[g * V + v] = s[5, v]
                    for i in range(n):
                        L[g * V + v, i] = T.Cast("uint8", lb[i, v])

    return search


@functools.lru_cache(maxsize=None)
def _built(kind: str, nmax: int, param: int):
    func = _min_scale_search(nmax, param) if kind == "min" else _symmetric_search(nmax, param)
    return tvm.compile(func, target=_target())["search"]


def _run(fn, sub: np.ndarray, cand: np.ndarray, out_shape: tuple[int, ...]):
    """Run a search over the rows of sub (n, m): (out (n, *out_shape) float32, quants (n, m))."""
    n, m = sub.shape
    copy = (sub.ctypes.data % _ALIGN or not sub.flags.c_contiguous or sub.dtype != np.float32
            or not sub.flags.writeable)  # a read-only array (a GGUF memmap) does not export
    arena = HostArena.for_arrays([((n, *out_shape), "float32"), ((n, m), "uint8")]
                                 + ([(sub.shape, "float32")] if copy else []))
    out, quants = arena.take((n, *out_shape), "float32"), arena.take((n, m), "uint8")
    if copy:
        held, sub = sub, arena.take(sub.shape, "float32")
        sub[...] = held
    if n:  # the numpy buffers themselves: no copy
        fn(to_tvm(sub), tvm.runtime.tensor(cand), to_tvm(out), to_tvm(quants))
    return out, quants


def fit_min_scale(sub: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's ``make_qkx2_quants(32, nmax, x, av_x + |x|, ..., rmin, rdelta, nstep)`` on each
    row of sub (n, 32) float32: (scale (n,), min (n,), quants (n, 32) uint8) with
    x ~ scale * q - min."""
    steps = np.arange(nstep + 1, dtype=np.float32)
    cand = (np.float32(rmin) + np.float32(rdelta) * steps) + np.float32(nmax)
    out, q = _run(_built("min", nmax, nstep), sub, cand, (2,))
    return out[:, 0], out[:, 1], q


def fit_symmetric(sub: np.ndarray, nmax: int):
    """ggml's ``make_qx_quants(n, nmax, x, L, 1, NULL)`` on each row of sub (n, m) float32:
    (scale (n,), quants + nmax (n, m) uint8) with x ~ scale * (q - nmax)."""
    steps = np.array([i for i in range(-9, 10) if i], np.float32)
    cand = -(np.float32(nmax) + np.float32(0.1) * steps)
    out, q = _run(_built("sym", nmax, sub.shape[1]), sub, cand, ())
    return out, q
