"""GPU prefill linear layers: ``y[m, c] = sum_k x[m, k] * W[c, k]``, tiled through shared memory.

A block of 16 x 16 threads computes a ``BM x BN`` = 32 tokens x 64 columns tile; per ``BK`` = 16
step it stages the x tile and the W tile (cast to float32) in shared memory, padded by one
column so the row-strided reads hit distinct banks, and each thread accumulates a 2 x 4
micro-tile in registers.  Tokens beyond ``n``, columns beyond ``N`` and k beyond ``K`` load as
zero, so any shape works; shared tiles have static sizes, only the grid's token dimension is
symbolic.  The SwiGLU variant stages the gate and the up tile and keeps two accumulators.

Quantized and bfloat16 weights (``formats.py``) are decoded element by element as the W tile
is staged (``WeightFormat.weight``: the stored bytes, no float16 loads), so the tile and its
arithmetic are the float ones.

Buffers (as the CPU ``linear.py``; x and y float32, W in the weight dtype, n symbolic):
  x (n, K)  W (N, K)  [bias (N,) float32 | res (n, N) float32]  ->  y (n, N)
  SwiGLU: W (2I, K) gate / up rows in alternating runs (``params.gate_up_row``) -> act (n, I)
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from ..common import EPILOGUES, cached, dtype_tag, gate_up_rows, token_dim
from ..signatures import matmul_func, swiglu_matmul_func
from .common import finalize, weight_at

TX, TY = 16, 16  # threads: columns x tokens
MI, NJ = 2, 4  # micro-tile per thread: tokens x columns
BM, BN, BK = TY * MI, TX * NJ, 16
BKP = BK + 1  # padded row stride of the shared tiles (flat, so compaction keeps the pad)
LOADS = TX * TY


def _same_row(c):
    return c


def _macros(K: int, wdt: str):
    KB = -(-K // BK)

    @T.macro
    def load_x(x, xs, n, m0, kb, t):
        """xs[r, kk] = x[m0 + r, kb * BK + kk] (0 outside), BM * BK elements over the block."""
        for it in range(BM * BK // LOADS):
            if m0 + (it * LOADS + t) // BK < n and kb * BK + (it * LOADS + t) % BK < K:
                xs[(it * LOADS + t) // BK * BKP + (it * LOADS + t) % BK] = x[
                    m0 + (it * LOADS + t) // BK, kb * BK + (it * LOADS + t) % BK]
            else:
                xs[(it * LOADS + t) // BK * BKP + (it * LOADS + t) % BK] = T.float32(0)

    @T.macro
    def load_w(W, ws, rows, c0, kb, t, w_row=_same_row):
        """ws[c, kk] = W[w_row(c0 + c), kb * BK + kk] as float32 (0 past ``rows`` or K)."""
        for it in range(BN * BK // LOADS):
            if c0 + (it * LOADS + t) // BK < rows and kb * BK + (it * LOADS + t) % BK < K:
                ws[(it * LOADS + t) // BK * BKP + (it * LOADS + t) % BK] = weight_at(
                    wdt, W, w_row(c0 + (it * LOADS + t) // BK), kb * BK + (it * LOADS + t) % BK)
            else:
                ws[(it * LOADS + t) // BK * BKP + (it * LOADS + t) % BK] = T.float32(0)

    @T.macro
    def mma(xs, ws, acc, ty, tx):
        """acc[i, j] += sum_kk xs[ty + TY i, kk] * ws[tx + TX j, kk] (flat tiles, stride BKP)."""
        for kk in range(BK):
            for i in T.unroll(MI):
                for j in T.unroll(NJ):
                    acc[i, j] = acc[i, j] + xs[(ty + TY * i) * BKP + kk] * ws[
                        (tx + TX * j) * BKP + kk]

    return KB, load_x, load_w, mma


@cached
def linear(N: int, K: int, wdt: str, epilogue: str = "none"):
    """y = x @ W.T (+ bias | + res) for a symbolic number of tokens n."""
    assert epilogue in EPILOGUES
    KB, load_x, load_w, mma = _macros(K, wdt)
    NBLK = -(-N // BN)

    @T.macro
    def body(x, W, y, bias, res, n):
        xs = T.sblock_alloc_buffer((BM * BKP,), "float32", scope="shared")
        ws = T.sblock_alloc_buffer((BN * BKP,), "float32", scope="shared")
        acc = T.sblock_alloc_buffer((MI, NJ), "float32", scope="local")
        for by in T.thread_binding((n + BM - 1) // BM, thread="blockIdx.y"):
            for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
                for ty in T.thread_binding(TY, thread="threadIdx.y"):
                    for tx in T.thread_binding(TX, thread="threadIdx.x"):
                        for i, j in T.grid(MI, NJ):
                            acc[i, j] = T.float32(0)
                        for kb in range(KB):
                            load_x(x, xs, n, by * BM, kb, ty * TX + tx)
                            load_w(W, ws, N, bx * BN, kb, ty * TX + tx)
                            T.tvm_storage_sync("shared")
                            mma(xs, ws, acc, ty, tx)
                            T.tvm_storage_sync("shared")
                        for i, j in T.grid(MI, NJ):
                            if by * BM + ty + TY * i < n and bx * BN + tx + TX * j < N:
                                if epilogue == "bias":
                                    y[by * BM + ty + TY * i, bx * BN + tx + TX * j] = acc[i, j] + bias[
                                        bx * BN + tx + TX * j]
                                elif epilogue == "residual":
                                    y[by * BM + ty + TY * i, bx * BN + tx + TX * j] = acc[i, j] + res[
                                        by * BM + ty + TY * i, bx * BN + tx + TX * j]
                                else:
                                    y[by * BM + ty + TY * i, bx * BN + tx + TX * j] = acc[i, j]

    w_shape, w_dtype = FORMATS[wdt].storage(N, K)
    func = matmul_func(body, N, K, w_dtype, epilogue, token_dim(None), w_shape)
    return finalize(func, f"matmul_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")


@cached
def linear_swiglu(I: int, K: int, wdt: str):
    """act = silu(x @ Wg.T) * (x @ Wu.T), W (2I, K) = gate and up rows in alternating runs
    (``params.gate_up_row``); act (n, I)."""
    gate_row, up_row = gate_up_rows(I)
    KB, load_x, load_w, mma = _macros(K, wdt)
    NBLK = -(-I // BN)

    @T.macro
    def body(x, W, act, n):
        xs = T.sblock_alloc_buffer((BM * BKP,), "float32", scope="shared")
        wg = T.sblock_alloc_buffer((BN * BKP,), "float32", scope="shared")
        wu = T.sblock_alloc_buffer((BN * BKP,), "float32", scope="shared")
        ag = T.sblock_alloc_buffer((MI, NJ), "float32", scope="local")
        au = T.sblock_alloc_buffer((MI, NJ), "float32", scope="local")
        for by in T.thread_binding((n + BM - 1) // BM, thread="blockIdx.y"):
            for bx in T.thread_binding(NBLK, thread="blockIdx.x"):
                for ty in T.thread_binding(TY, thread="threadIdx.y"):
                    for tx in T.thread_binding(TX, thread="threadIdx.x"):
                        for i, j in T.grid(MI, NJ):
                            ag[i, j] = T.float32(0)
                            au[i, j] = T.float32(0)
                        for kb in range(KB):
                            load_x(x, xs, n, by * BM, kb, ty * TX + tx)
                            load_w(W, wg, I, bx * BN, kb, ty * TX + tx, gate_row)
                            load_w(W, wu, I, bx * BN, kb, ty * TX + tx, up_row)
                            T.tvm_storage_sync("shared")
                            mma(xs, wg, ag, ty, tx)
                            mma(xs, wu, au, ty, tx)
                            T.tvm_storage_sync("shared")
                        for i, j in T.grid(MI, NJ):
                            if by * BM + ty + TY * i < n and bx * BN + tx + TX * j < I:
                                act[by * BM + ty + TY * i, bx * BN + tx + TX * j] = (
                                    ag[i, j] / (T.float32(1) + T.exp(-ag[i, j])) * au[i, j])

    w_shape, w_dtype = FORMATS[wdt].storage(2 * I, K)
    func = swiglu_matmul_func(body, I, K, w_dtype, token_dim(None), w_shape)
    return finalize(func, f"matmul_swiglu_{I}x{K}_{dtype_tag(wdt)}")
