"""CPU kernels over quantized weights (``formats.py``): the packed blocks are read as stored and
decoded in registers; no dequantized copy of a matrix outlives a call.

Decode GEMV (optionally fused with the RMSNorm before it, or SwiGLU): the input vector is
quantized once per call to int8 in blocks of 32 (``dx = max|x| / 127``, round half to even), as
llama.cpp's decode does, and each weight block's contribution is an integer dot product
(AVX2 ``vpmaddubsw`` + ``vpmaddwd`` on 256 bits, eight int32 lanes) scaled by ``d * dx``, plus
the format's offset term (Q4_1's / Q5_1's m, Q4_0's -8 d, Q5_0's -16 d, the k-quants' -dmin m)
times ``dx * sum(xq)``, precomputed per block.  A row's blocks add into one accumulator in
block order, in the GEMVs and in the tiles alike, so a row's sum is the same whatever the batch
(batch invariance): a unit's integer dot products and scaling mostly hide the one add chain's
latency (the layers' GEMVs measured as fast as with four chains, the Q8_0 LM head 0.96-0.99x;
docs/design.md).  Rows are shared out in 16-row units as the float GEMV's are
(``claimed_units``).  The LM head quantizes its input to int16 instead (``wide_x``:
``vpmaddwd`` of widened quants), as accurate as float32 activations to ~1e-5 and faster than
decoding its blocks to float.

Prefill / batched matmul, two kinds.  The int8 tile (``linear_int8``: batch buckets of at most
``SMALL_ROWS`` rows, and prefill over rows of at least ``INT8_MIN_K`` weights) quantizes every
row of x once per call as the GEMV does and takes the GEMV's integer dot products, each unpacked
weight unit used for up to 8 tokens.  Otherwise each parallel task decodes its tile of weight
rows to float32 once (a scratch of ``TN x K``) and runs the float register tile of
``linear.py`` over its block of up to 64 tokens (activations stay float32), which measured
faster on short rows (docs/design.md).

Rows interleaved by 8 (``formats._Rows8`` / ``_Q5Rows8`` / ``_KRows8`` / ``_Q6KRows8``: the CPU
layout of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K matrices): the same integer arithmetic with the group's 8
rows in the 8 lanes of one vector, x broadcast 4 bytes at a time, so the unpacking, conversion
and scaling of a unit serve 8 rows and no lane sum remains.  The decode GEMVs fill their 16-row
units by groups (``_group_fill``, ``_group_tile_fill``), the int8 tiles have such variants
(``linear_int8_x8``, ...) and serve every batch bucket over them (about 2x the float tile at
4-128 rows), prefetching each group's row as the GEMVs do; the float tile reads them through
row-wise pieces.  A Q8_0 LM head is interleaved too: its int16 x
(``wide_x``) takes ``vpmaddwd`` of the widened quants, each row's pairs joined once per unit
(``_Rows8.group_dot_wide``).

Embedding: the rows of the ids, decoded (a tied embedding in the head's layout: each row's
bytes gathered from the chunks).
"""

from __future__ import annotations

import operator

from tvm.script import tirx as T

from ...formats import FORMATS, INTERLEAVED, QBLOCK, ROW_GROUP
from ...params import GATE_UP_ROWS
from ..common import EPILOGUES, cached, finalize, gate_up_rows, pick_tile, token_dim
from ..signatures import gemv_func, matmul_func, swiglu_matmul_func
from .fastmath import silu_mul
from .gemv import PARALLEL_MIN_ELEMS, RG, SWIGLU_UNIT_TILES, _macros, swiglu_store
from .linear import (DEFAULT_TILE, MB, _reduce_macro, _task, _tile_tag, store_macro,
                     swiglu_store_macro)
from .simd import L1, L2, NTA, VL, claimed_units, prefetch_ahead_macro, scratch_buffer

ACCS = 4  # blocks per step of a row loop (the prefetch's stride)
# How far ahead of a GEMV row's read position its bytes are prefetched: 1024 for the 4- to
# 6-bit formats; 512 for Q8_0, which covers twice their bytes per instruction (the distances
# and what measured them: docs/design.md#prefetch-distances-for-quantized-rows)
PREFETCH_BYTES = {"q8_0": 512}
PREFETCH_DEFAULT = 1024
# A decode GEMV over k-quant rows interleaved by 8 reads one stream 1184 / 1440 / 1680 bytes
# (Q4_K / Q5_K / Q6_K: a super-block of 8 rows) per step, so 1024 ahead would land within the
# step being read: these single-stream GEMVs, and the fused SwiGLU GEMV whose unit's 256 rows
# are one stream too, prefetch about ten steps ahead.
PREFETCH_ONE_STREAM = {"q4_k": 16384, "q5_k": 16384, "q6_k": 16384}
# Where that far prefetch stops at L2 (Zen 4's hint), a second one brings the lines of the step
# ``PREFETCH_NEAR`` bytes ahead on into L1 (``prefetcht0``): the Q6_K x8 GEMV's unit makes 16
# loads from 27 lines, which otherwise wait on L2.  Q4_K / Q5_K x8 run no faster with it.
PREFETCH_NEAR = {"q6_k": 1024}


def _one_stream_ahead(fmt) -> int:
    """How far ahead a single-stream kernel over rows interleaved by 8 prefetches ``fmt``."""
    name = fmt.base.name
    return PREFETCH_ONE_STREAM.get(name, PREFETCH_BYTES.get(name, PREFETCH_DEFAULT))


def _storage(fmt, N: int, K: int) -> tuple:
    return fmt.storage(N, K)[0]


def as_int8(W):
    return T.decl_buffer(W.shape, "int8", data=W.data)


def as_f16(W):
    return T.decl_buffer((W.shape[0], W.shape[1] // 2), "float16", data=W.data)


def _row_step(fmt, K: int) -> tuple[int, int, int]:
    """(bytes per row, units per step of the row loop, bytes per step rounded up: the
    prefetch's stride).  A k-quant row steps a whole super-block (8 units), so each unit's
    sub-block index, and with it the decoding of its 6-bit scale, is a constant."""
    RB = fmt.row_bytes(K)
    U = max(ACCS, fmt.block // QBLOCK)
    return RB, U, -(-U * QBLOCK * RB // K)


def _halves(v, lanes: int, op):
    """``op`` over a ``lanes``-lane vector's two halves, down to one lane (a tree of shuffles,
    as LLVM's own reductions are)."""
    while lanes > 1:
        lanes //= 2
        v = op(T.Shuffle([v], list(range(lanes))), T.Shuffle([v], list(range(lanes, 2 * lanes))))
    return v


def _plain_at(K: int):
    """(element of token m's block b in the quantized x, index of its dx / sum): rows one after
    another, the decode GEMVs' layout."""
    NB = K // QBLOCK
    return (lambda m, b: m * K + b * QBLOCK), (lambda m, b: m * NB + b)


def _tiled_at(K: int):
    """``_plain_at`` for the int8 tiles: the tokens in blocks of ``TT``, each block unit after
    unit with its ``TT`` tokens' 32 quants side by side (and their dx, sums likewise), so a tile
    of ``TT`` tokens reads x front to back as one stream (rows one after another: ``TT``
    streams K bytes apart, the Q4_K x8 tile 1.2x slower over 64 rows; docs/design.md)."""
    NB = K // QBLOCK
    return ((lambda m, b: ((m // TT) * NB + b) * (TT * QBLOCK) + (m % TT) * QBLOCK),
            (lambda m, b: ((m // TT) * NB + b) * TT + m % TT))


def _row_quantizer(K: int, wide: bool = False, at=None, halves: bool = False):
    """``quantize(xs, m, xq, xd, xsum)``: row m of xs (n, K) float32 quantized per 32-block to
    int8 (``wide``: int16) in ``xq``, the blocks' dx = max|x| / 127 (32767) in ``xd``, ``dx *
    sum(xq)`` over each block in ``xsum``, at the places ``at`` (``_plain_at`` by default)
    gives; ``halves`` (the kernels of a format with ``half_sums``): in place of that sum, -32
    times each 16-quant half's sum as two int32 at ``2 s`` and ``2 s + 1`` of ``xsum`` (of
    twice the size; ``_sums_view``).  Each block is one 32-lane vector, its max and its quants'
    sums reduced by shuffles (in int32: exact, as a float sum of these integers is).  The
    decode GEMVs quantize x on one core before sharing out the rows, so this is serial time of
    every call (docs/design.md)."""
    NB = K // QBLOCK
    QMAX, QT = (32767.0, "int16") if wide else (127.0, "int8")
    q_at, s_at = at or _plain_at(K)
    H = QBLOCK // 2

    @T.macro
    def store_sum(xsum, xd, m, b, q):
        xsum[s_at(m, b)] = T.Cast("float32", _halves(q, QBLOCK, operator.add)) * xd[s_at(m, b)]

    @T.macro
    def store_halves(xsum, xd, m, b, q):
        sums = _sums_view(xsum)
        sums[2 * s_at(m, b)] = T.int32(-32) * _halves(
            T.Shuffle([q], list(range(H))), H, operator.add)
        sums[2 * s_at(m, b) + 1] = T.int32(-32) * _halves(
            T.Shuffle([q], list(range(H, QBLOCK))), H, operator.add)

    store_sums = store_halves if halves else store_sum

    @T.macro
    def quantize(xs, m, xq, xd, xsum):
        st = T.decl_buffer((2,), "float32")  # max |x|, 1 / dx
        for b in range(NB):
            st[0] = _halves(T.fabs(xs[m, T.ramp(b * QBLOCK, 1, QBLOCK)]), QBLOCK, T.max)
            xd[s_at(m, b)] = st[0] / T.float32(QMAX)
            st[1] = T.if_then_else(st[0] > T.float32(0), T.float32(QMAX) / st[0], T.float32(0))
            q = T.Cast(f"int32x{QBLOCK}", T.nearbyint(
                xs[m, T.ramp(b * QBLOCK, 1, QBLOCK)] * T.broadcast(st[1], QBLOCK)))
            xq[T.ramp(q_at(m, b), 1, QBLOCK)] = T.Cast(f"{QT}x{QBLOCK}", q)
            store_sums(xsum, xd, m, b, q)

    return quantize


def _row_dot(fmt, K: int, wide: bool = False, locality: int = NTA):
    """``dot(W, Wi, Wh, xq, xd, xsum, Y, r, c)``: Y[r] = row c of W . x, x quantized per
    32-block to int8 (``int_dot``), or ``wide`` to int16 (``wide_dot``: the LM head)."""
    NB = K // QBLOCK
    RB, U, STEP = _row_step(fmt, K)
    prefetch = prefetch_ahead_macro(STEP if U > ACCS else 64, "uint8",
                                    PREFETCH_BYTES.get(fmt.name, PREFETCH_DEFAULT), locality)
    unit_dot = fmt.wide_dot if wide else fmt.int_dot  # int32x8 (AVX2)

    @T.macro
    def block(Wv, c, b, xq, xd, xsum, acc, macc):
        acc[T.ramp(0, 1, 8)] = acc[T.ramp(0, 1, 8)] + T.Cast(
            "float32x8", unit_dot(Wv, c, b, xq, b * QBLOCK)) * T.broadcast(
            fmt.scale(Wv, c, b) * xd[b], 8)
        if fmt.has_offset:
            macc[0] = macc[0] + fmt.offset(Wv, c, b) * xsum[b]

    @T.macro
    def dot(W, Wi, Wh, xq, xd, xsum, Y, r, c):
        # one chain in block order, reduced as ``_tile_dot`` reduces each token's (batch
        # invariance: a row's sum is the same in the GEMV and in every tile)
        acc = T.decl_buffer((8,), "float32")
        macc = T.decl_buffer((1,), "float32")
        acc[T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
        macc[0] = T.float32(0)
        flat = T.decl_buffer((W.shape[0] * W.shape[1],), "uint8", data=W.data)
        for bo in range(NB // U):
            prefetch(flat, c * RB + bo * STEP)
            for a in T.unroll(U):
                block((W, Wi, Wh), c, bo * U + a, xq, xd, xsum, acc, macc)
        for a in T.unroll(NB % U):
            block((W, Wi, Wh), c, NB // U * U + a, xq, xd, xsum, acc, macc)
        for v in T.vectorized(4):
            acc[v] = acc[v] + acc[v + 4]
        Y[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + macc[0]

    return dot


def _prepare_x(K: int, eps: float, norm: bool, wide: bool = False, halves: bool = False):
    """``prepare(x, g, xq, xd, xsum)``: quantize x, or rmsnorm(x) * g, once per call (to int8;
    ``wide``: int16; ``halves`` as ``_row_quantizer``)."""
    normalize = _macros(K, eps, "float32", NTA)[0]
    quantize = _row_quantizer(K, wide, None, halves)

    @T.macro
    def prepare(x, g, xq, xd, xsum):
        if norm:
            xn = T.decl_buffer((1, K), "float32")
            normalize(x, g, xn)
            quantize(xn, 0, xq, xd, xsum)
        else:
            quantize(x, 0, xq, xd, xsum)

    return prepare


def _check_fits(fmt, K: int, N: int | None = None):
    if not fmt.fits(K):
        raise ValueError(f"{fmt.name} stores rows in blocks of {fmt.block}; K={K} is not a "
                         "multiple")
    if N is not None and fmt.grouped and N % ROW_GROUP:
        raise ValueError(f"{fmt.name} stores rows in groups of {ROW_GROUP}; N={N} is not a "
                         "multiple")


def _row_fill(fmt, K: int, N: int, wide_x: bool, locality: int):
    """``fill(W, xq, xd, xsum, Y, u)``: Y[r] = row u RG + r of W . x for the 16-row unit's
    rows below N (``_row_dot``)."""
    dot = _row_dot(fmt, K, wide_x, locality)

    @T.macro
    def fill(W, xq, xd, xsum, Y, u):
        Wi, Wh = as_int8(W), as_f16(W)
        for r in range(RG):
            if u * RG + r < N:
                dot(W, Wi, Wh, xq, xd, xsum, Y, r, u * RG + r)

    return fill


def _group_fill(fmt, K: int, N: int, wide_x: bool, locality: int, vnni: bool = False):
    """``_row_fill`` over rows interleaved by 8: the unit's two groups (``_group_dot``)."""
    dot = _group_dot(fmt, K, wide_x, locality, _one_stream_ahead(fmt), vnni)
    GU, G = RG // ROW_GROUP, N // ROW_GROUP  # groups per unit, in all

    @T.macro
    def fill(W, xq, xd, xsum, Y, u):
        for gi in range(GU):
            if u * GU + gi < G:
                dot((W, as_int8(W), as_f16(W)), _x_view(xq), xd, xsum, 0, Y, gi * ROW_GROUP,
                    u * GU + gi)

    return fill


@cached
def gemv(N: int, K: int, wfmt: str, epilogue: str = "none", norm_eps: float | None = None,
         wide_x: bool = False, locality: int = NTA, vnni: bool = False):
    """y = rmsnorm?(x) @ W.T (+ bias | + res), W quantized in ``wfmt``; ``wide_x``: x quantized
    to int16, not int8 (the LM head, whose logits pick the token: int8 activations there flip
    near ties; docs/design.md); of the layouts interleaved by 8, Q8_0's takes it.
    ``locality``: the weights' software prefetch hint (``cpu.prefetch_locality``); ``vnni``:
    rows interleaved by 8 take their int8 dot products by ``vpdpbusd`` (``cpu.has_vnni``)."""
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K, N)
    if fmt.grouped:
        _check_wide_x(fmt, wide_x)
    norm, NB = norm_eps is not None, K // QBLOCK
    halves = _halves_for(fmt, wide_x)
    prepare = _prepare_x(K, norm_eps or 0.0, norm, wide_x, halves)
    fill = (_group_fill(fmt, K, N, wide_x, locality, vnni) if fmt.grouped
            else _row_fill(fmt, K, N, wide_x, locality))
    xdt = "int16" if wide_x else "int8"
    run_units, _lanes = claimed_units(-(-N // RG), N * K >= PARALLEL_MIN_ELEMS)

    @T.macro
    def unit(lane, u, W, xq, xd, xsum, y, bias, res):
        Y = T.decl_buffer((RG,), "float32")
        fill(W, xq, xd, xsum, Y, u)
        for r in range(RG):
            if u * RG + r < N:
                if epilogue == "bias":
                    y[0, u * RG + r] = Y[r] + bias[u * RG + r]
                elif epilogue == "residual":
                    y[0, u * RG + r] = Y[r] + res[0, u * RG + r]
                else:
                    y[0, u * RG + r] = Y[r]

    @T.macro
    def body(x, g, W, y, bias, res):
        xq = T.decl_buffer((K,), xdt)
        xd = T.decl_buffer((NB,), "float32")
        xsum = T.decl_buffer((_sums_len(NB, halves),), "float32")
        prepare(x, g, xq, xd, xsum)
        run_units(unit, W, xq, xd, xsum, y, bias, res)

    func = gemv_func(body, N, K, "uint8", epilogue, norm, _storage(fmt, N, K))
    tag = ("_norm" if norm else "") + ("_wx" if wide_x else "")
    return finalize(func, f"gemv{tag}_{epilogue}_{N}x{K}_{wfmt}")


def _row_tile_fill(fmt, K: int, I: int, gate_row, up_row, locality: int):
    """``fill(W, xq, xd, xsum, gate, up, a0, o)``: gate[o + r] / up[o + r] = act row a0 + r's
    gate / up dot product for the RG rows of a tile (0 past I: defined values for the vector
    SiLU, never stored).  The tile's gate rows, then its up rows: W in memory order.  Taking
    each act row's gate and up rows in turn (jumping between the two runs) made the SwiGLU GEMV
    1.3-1.8x slower than a GEMV over the same bytes (docs/design.md)."""
    dot = _row_dot(fmt, K, False, locality)

    def rows_of(row):  # the tile's gate (or up) rows into out
        @T.macro
        def fill(W, Wi, Wh, xq, xd, xsum, out, a0, o):
            for r in range(RG):
                if a0 + r < I:
                    dot(W, Wi, Wh, xq, xd, xsum, out, o + r, row(a0) + r)
                else:
                    out[o + r] = T.float32(0)

        return fill

    gate_rows, up_rows = rows_of(gate_row), rows_of(up_row)

    @T.macro
    def fill(W, xq, xd, xsum, gate, up, a0, o):
        Wi, Wh = as_int8(W), as_f16(W)
        gate_rows(W, Wi, Wh, xq, xd, xsum, gate, a0, o)
        up_rows(W, Wi, Wh, xq, xd, xsum, up, a0, o)

    return fill


def _group_tile_fill(fmt, K: int, I: int, gate_row, up_row, locality: int,
                     vnni: bool = False):
    """``_row_tile_fill`` over rows interleaved by 8 (I a multiple of 8: a group never
    straddles a gate run and an up run): the tile's two groups of gate rows, then its two of up
    rows, in memory order as ``_row_tile_fill``'s."""
    dot = _group_dot(fmt, K, False, locality, _one_stream_ahead(fmt), vnni=vnni)

    def groups_of(row):  # the tile's groups of gate (or up) rows into out
        @T.macro
        def fill(Wv, xq, xd, xsum, out, a0, o):
            for gi in range(RG // ROW_GROUP):
                if a0 + gi * ROW_GROUP < I:
                    dot(Wv, _x_view(xq), xd, xsum, 0, out, o + gi * ROW_GROUP,
                        row(a0) // ROW_GROUP + gi)
                else:
                    out[T.ramp(o + gi * ROW_GROUP, 1, 8)] = T.broadcast(T.float32(0), 8)

        return fill

    gate_groups, up_groups = groups_of(gate_row), groups_of(up_row)

    @T.macro
    def fill(W, xq, xd, xsum, gate, up, a0, o):
        Wv = (W, as_int8(W), as_f16(W))
        gate_groups(Wv, xq, xd, xsum, gate, a0, o)
        up_groups(Wv, xq, xd, xsum, up, a0, o)

    return fill


@cached
def gemv_swiglu(I: int, K: int, wfmt: str, norm_eps: float, locality: int = NTA,
                vnni: bool = False):
    """act = silu(xn @ Wg.T) * (xn @ Wu.T), xn = rmsnorm(x) * g, W (2I, K) quantized, gate and up
    rows in alternating runs (``params.gate_up_row``); ``locality``, ``vnni`` as for
    ``gemv``."""
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K, I)
    NB = K // QBLOCK
    halves = _halves_for(fmt, False)
    prepare = _prepare_x(K, norm_eps, True, False, halves)
    UT = SWIGLU_UNIT_TILES
    UR = RG * UT
    run_units, _lanes = claimed_units(-(-I // UR), 2 * I * K >= PARALLEL_MIN_ELEMS)
    assert RG == GATE_UP_ROWS
    gate_row, up_row = gate_up_rows(I)
    fill = (_group_tile_fill(fmt, K, I, gate_row, up_row, locality, vnni) if fmt.grouped
            else _row_tile_fill(fmt, K, I, gate_row, up_row, locality))

    @T.macro
    def unit(lane, u, W, xq, xd, xsum, act):
        gate = T.decl_buffer((UR,), "float32")
        up = T.decl_buffer((UR,), "float32")
        for t in range(UT):
            fill(W, xq, xd, xsum, gate, up, u * UR + t * RG, t * RG)
        swiglu_store(act, gate, up, u, I)

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((1, K), "float32"), g: T.Buffer((K,), "float32"),
             W: T.Buffer(_storage(fmt, 2 * I, K), "uint8"), act: T.Buffer((1, I), "float32")):
        with T.sblock("root"):
            xq = T.decl_buffer((K,), "int8")
            xd = T.decl_buffer((NB,), "float32")
            xsum = T.decl_buffer((_sums_len(NB, halves),), "float32")
            prepare(x, g, xq, xd, xsum)
            run_units(unit, W, xq, xd, xsum, act)

    return finalize(func, f"gemv_swiglu_{I}x{K}_{wfmt}")


def _row_decoder(fmt, K: int):
    """``decode(W, Wi, Wh, out, o, c)``: out[o, :] = row c of W as float32."""
    NB = K // QBLOCK

    @T.macro
    def decode(W, Wi, Wh, out, o, c):
        for b in range(NB):
            out[o, T.ramp(b * QBLOCK, 1, 16)] = fmt.dequant16((W, Wi, Wh), c, b, 0)
            out[o, T.ramp(b * QBLOCK + 16, 1, 16)] = fmt.dequant16((W, Wi, Wh), c, b, 1)

    return decode


# Rows at least this long take the int8 tile in prefill too (docs/design.md: Quantized weights)
INT8_MIN_K = 2048


@cached
def linear(N: int, K: int, wfmt: str, epilogue: str = "none", tile=DEFAULT_TILE,
           wide_x: bool = False, vnni: bool = False, locality: int = NTA):
    """y = x @ W.T (+ bias | + res) over n tokens, W quantized in ``wfmt``: the int8 tile where
    K >= ``INT8_MIN_K``, else the float tile over decoded weights (x float32, so ``wide_x``,
    the LM head's int16 x for the int8 tile, changes nothing there; nor ``vnni``, ``locality``)."""
    if K >= INT8_MIN_K:
        return linear_int8(N, K, wfmt, epilogue, wide_x, vnni, locality)
    assert epilogue in EPILOGUES
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K)
    TM, TN = tile[0], pick_tile(N, tuple(t for t in (4, 2, 1) if t <= tile[1]))
    acc_main = _reduce_macro(K, "float32", TM, TN)
    acc_tail = _reduce_macro(K, "float32", 1, TN)
    decode = _row_decoder(fmt, K)
    NT = N // TN
    m0, co, rows = _task(NT)

    store = store_macro(epilogue, TN)

    @T.macro
    def body(x, W, y, bias, res, n):
        Wi, Wh = as_int8(W), as_f16(W)
        for task in T.parallel((n + MB - 1) // MB * NT):
            wt = T.decl_buffer((TN, K), "float32", scope="local")
            for c in range(TN):
                decode(W, Wi, Wh, wt, c, co(task) * TN + c)
            acc = scratch_buffer((TM, TN, VL))
            for mo in range(rows(task, n) // TM):
                acc_main(x, wt, acc, m0(task) + mo * TM, 0)
                store(y, acc, m0(task) + mo * TM, co(task) * TN, TM, bias, res)
            for mt in range(rows(task, n) % TM):
                acc_tail(x, wt, acc, m0(task) + rows(task, n) // TM * TM + mt, 0)
                store(y, acc, m0(task) + rows(task, n) // TM * TM + mt, co(task) * TN, 1,
                      bias, res)

    func = matmul_func(body, N, K, "uint8", epilogue, token_dim(None), _storage(fmt, N, K))
    return finalize(func, f"matmul_{epilogue}_{N}x{K}_{wfmt}{_tile_tag(tile)}")


@cached
def linear_swiglu(I: int, K: int, wfmt: str, tile=DEFAULT_TILE, vnni: bool = False,
                  locality: int = NTA):
    """act = silu(x @ Wg.T) * (x @ Wu.T) over n tokens, W (2I, K) quantized, gate and up rows
    in alternating runs (the int8 tile where K >= ``INT8_MIN_K``)."""
    if K >= INT8_MIN_K:
        return linear_swiglu_int8(I, K, wfmt, vnni, locality)
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K)
    TM, TN = tile[0], pick_tile(I, tuple(t for t in (4, 2, 1) if t <= tile[1]))
    assert GATE_UP_ROWS % TN == 0
    gate_row, up_row = gate_up_rows(I)
    NT = I // TN
    m0, co, rows = _task(NT)
    acc_main = _reduce_macro(K, "float32", TM, TN)
    acc_tail = _reduce_macro(K, "float32", 1, TN)
    decode = _row_decoder(fmt, K)
    n = token_dim(None)

    store = swiglu_store_macro(TN)

    @T.macro
    def body(x, W, act, n):
        Wi, Wh = as_int8(W), as_f16(W)
        for task in T.parallel((n + MB - 1) // MB * NT):
            wt = T.decl_buffer((2 * TN, K), "float32", scope="local")  # gate rows, up rows
            for c in range(TN):
                decode(W, Wi, Wh, wt, c, gate_row(co(task) * TN) + c)
                decode(W, Wi, Wh, wt, TN + c, up_row(co(task) * TN) + c)
            g = scratch_buffer((TM, TN, VL))
            u = scratch_buffer((TM, TN, VL))
            for mo in range(rows(task, n) // TM):
                acc_main(x, wt, g, m0(task) + mo * TM, 0)
                acc_main(x, wt, u, m0(task) + mo * TM, TN)
                store(act, g, u, m0(task) + mo * TM, co(task) * TN, TM)
            for mt in range(rows(task, n) % TM):
                acc_tail(x, wt, g, m0(task) + rows(task, n) // TM * TM + mt, 0)
                acc_tail(x, wt, u, m0(task) + rows(task, n) // TM * TM + mt, TN)
                store(act, g, u, m0(task) + rows(task, n) // TM * TM + mt, co(task) * TN, 1)

    func = swiglu_matmul_func(body, I, K, "uint8", n, _storage(fmt, 2 * I, K))

    return finalize(func, f"matmul_swiglu_{I}x{K}_{wfmt}{_tile_tag(tile)}")


@cached
def embedding(V: int, H: int, wfmt: str, n_static: int | None = None):
    """The decoded rows of the ids; an id outside [0, V) fails the call before any write."""
    fmt = FORMATS[wfmt]
    _check_fits(fmt, H)
    n = token_dim(n_static)
    decode = _row_decoder(fmt, H)

    @T.prim_func(s_tir=True)
    def func(var_ids: T.handle, table: T.Buffer(_storage(fmt, V, H), "uint8"),
             var_x: T.handle):
        ids = T.match_buffer(var_ids, (n,), "int32")
        x = T.match_buffer(var_x, (n, H), "float32")
        with T.sblock("root"):
            for i in range(n):
                assert 0 <= ids[i] and ids[i] < V, "token id out of range of the vocabulary"
            Wi, Wh = as_int8(table), as_f16(table)
            for i in range(n):
                decode(table, Wi, Wh, x, i, T.Cast("int64", ids[i]))

    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"embedding_{tag}_{V}x{H}_{wfmt}")


# ------------------------------------------------------------------ int8 prefill / batched tile
# tokens per register tile: each unpacked weight vector serves 8 tokens, 8 float32x8
# accumulators (4 tokens x 2 rows and 3 x 4 measured 0.85-0.95x of it at 64 tokens on AVX2);
# the last n % 8 tokens of a block take tiles of 4, 2 and 1
TT = 8


def _rows_quantizer(K: int, wide: bool, halves: bool = False):
    """``quantize_rows(x, xq, xd, xsum, n)``: every row of x (n, K) quantized as the decode
    GEMV quantizes its vector (``_row_quantizer``), rows in parallel, in the tiles' layout
    (``_tiled_at``; ``_x_scratch`` holds it)."""
    quantize = _row_quantizer(K, wide, _tiled_at(K), halves)

    @T.macro
    def quantize_rows(x, xq, xd, xsum, n):
        for m in T.parallel(n):
            quantize(x, m, xq, xd, xsum)

    return quantize_rows


def _tile_dot(fmt, K: int, tt: int, wide: bool):
    """``tile(Wv, c, xq, xd, xsum, m0, Y)``: Y[t] = row c of W . token m0 + t of x (quantized
    by ``_rows_quantizer``) for ``tt`` tokens, each 32-weight unit an integer dot product as in
    the decode GEMV.  A unit's weights are loaded and unpacked once for all ``tt`` tokens (LLVM
    keeps the one unpacked vector: nothing is stored to memory between the uses).  One float32x8
    accumulator per token, its units added in block order and reduced as the decode GEMV's
    (``_row_dot``): a token's sum depends neither on ``tt`` nor on the other tokens."""
    NB = K // QBLOCK
    _RB, U, _STEP = _row_step(fmt, K)
    unit_dot = fmt.wide_dot if wide else fmt.int_dot
    q_at, s_at = _tiled_at(K)
    # Q4_K / Q5_K: the super-block's scales and offsets decoded as vectors once per step
    vector_scales = hasattr(fmt, "sub_scales8")

    def scale(Wv, c, b, a, sm):
        return sm[0, a] if vector_scales else fmt.scale(Wv, c, b)

    def offset(Wv, c, b, a, sm):
        return sm[1, a] if vector_scales else fmt.offset(Wv, c, b)

    @T.macro
    def unit(Wv, c, b, a, sm, xq, xd, xsum, m0, acc, macc):
        for t in T.unroll(tt):
            acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + T.Cast(
                "float32x8", unit_dot(Wv, c, b, xq, q_at(m0 + t, b))
            ) * T.broadcast(scale(Wv, c, b, a, sm) * xd[s_at(m0 + t, b)], 8)
            if fmt.has_offset:
                macc[t] = macc[t] + offset(Wv, c, b, a, sm) * xsum[s_at(m0 + t, b)]

    @T.macro
    def tile(Wv, c, xq, xd, xsum, m0, Y):
        acc = T.decl_buffer((tt, 8), "float32")
        macc = T.decl_buffer((tt,), "float32")
        for t in T.unroll(tt):
            acc[t, T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
            macc[t] = T.float32(0)
        sm = T.decl_buffer((2, 8), "float32")
        for bo in range(NB // U):
            if vector_scales:
                sm[0, T.ramp(0, 1, 8)] = fmt.sub_scales8(Wv, c, bo * fmt.block_bytes, False)
                sm[1, T.ramp(0, 1, 8)] = fmt.sub_scales8(Wv, c, bo * fmt.block_bytes, True)
            for a in T.unroll(U):
                unit(Wv, c, bo * U + a, a, sm, xq, xd, xsum, m0, acc, macc)
        for a in T.unroll(NB % U):
            unit(Wv, c, NB // U * U + a, a, sm, xq, xd, xsum, m0, acc, macc)
        for t in T.unroll(tt):
            for v in T.vectorized(4):
                acc[t, v] = acc[t, v] + acc[t, v + 4]
            Y[t] = ((acc[t, 0] + acc[t, 1]) + (acc[t, 2] + acc[t, 3])) + macc[t]

    return tile


def _run_tiles(tiles):
    """``run(Wv, c, xq, xd, xsum, m0, rows, Y, a0, a1, a2, a3)``: ``tiles[tt]`` = (tile macro,
    store macro) for ``tt`` in (TT, 4, 2, 1) over ``rows`` tokens from m0: tiles of ``TT``,
    then of 4, 2, 1 for the rest; each store is ``(Y, m, c, a0, a1, a2, a3)``."""

    @T.macro
    def run(Wv, c, xq, xd, xsum, m0, rows, Y, a0, a1, a2, a3):
        for mo in range(rows // TT):
            tiles[TT][0](Wv, c, xq, xd, xsum, m0 + mo * TT, Y)
            tiles[TT][1](Y, m0 + mo * TT, c, a0, a1, a2, a3)
        if rows % TT >= 4:
            tiles[4][0](Wv, c, xq, xd, xsum, m0 + rows // TT * TT, Y)
            tiles[4][1](Y, m0 + rows // TT * TT, c, a0, a1, a2, a3)
        if rows % 4 >= 2:
            tiles[2][0](Wv, c, xq, xd, xsum, m0 + rows // 4 * 4, Y)
            tiles[2][1](Y, m0 + rows // 4 * 4, c, a0, a1, a2, a3)
        if rows % 2 == 1:
            tiles[1][0](Wv, c, xq, xd, xsum, m0 + rows // 2 * 2, Y)
            tiles[1][1](Y, m0 + rows // 2 * 2, c, a0, a1, a2, a3)

    return run


def _token_tiles(fmt, K: int, wide: bool, finish):
    """``_run_tiles`` of row c against ``rows`` tokens (``_tile_dot``); ``finish(tt)`` gives
    the store of each tile of ``tt`` tokens."""
    return _run_tiles({tt: (_tile_dot(fmt, K, tt, wide), finish(tt)) for tt in (TT, 4, 2, 1)})


def _x_scratch(K: int, n, wide: bool, halves: bool = False):
    """Scratch for x quantized (``_rows_quantizer``; n rounded up to whole ``TT`` blocks): one
    workspace per call."""
    NB, blocks = K // QBLOCK, (n + TT - 1) // TT * TT
    return (T.decl_buffer((blocks * K,), "int16" if wide else "int8", scope="local"),
            T.decl_buffer((blocks * NB,), "float32", scope="local"),
            T.decl_buffer((_sums_len(blocks * NB, halves),), "float32", scope="local"))


def _sums_len(blocks, halves: bool):
    """float32 slots of ``xsum`` for ``blocks`` x blocks: one sum each, or two half sums."""
    return blocks * (2 if halves else 1)


def _halves_for(fmt, wide: bool) -> bool:
    """Whether kernels over ``fmt`` take x's half sums (``_row_quantizer``'s ``halves``): a
    layout whose int8 dot products start from them (``half_sums``)."""
    return fmt.grouped and not wide and fmt.half_sums


@cached
def linear_int8(N: int, K: int, wfmt: str, epilogue: str = "none", wide_x: bool = False,
                vnni: bool = False, locality: int = NTA):
    """y = x @ W.T (+ bias | + res) over n tokens, W quantized in ``wfmt``, x quantized once
    per call as the decode GEMV's (int8 per 32-block; ``wide_x``: int16, the LM head's): the
    GEMV's integer dot products in register tiles of up to 8 tokens per weight row (``vnni``
    as for ``gemv``; ``locality``: rows interleaved by 8 prefetch with the GEMV's hint)."""
    assert epilogue in EPILOGUES
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K)
    if fmt.grouped:
        return linear_int8_x8(N, K, wfmt, epilogue, wide_x, vnni, locality)
    quantize_rows = _rows_quantizer(K, wide_x)

    def finish(tt):
        @T.macro
        def store(Y, m, c, y, bias, res, unused):
            for t in range(tt):
                if epilogue == "bias":
                    y[m + t, c] = Y[t] + bias[c]
                elif epilogue == "residual":
                    y[m + t, c] = Y[t] + res[m + t, c]
                else:
                    y[m + t, c] = Y[t]

        return store

    run = _token_tiles(fmt, K, wide_x, finish)
    m0, co, rows = _task(N)

    @T.macro
    def body(x, W, y, bias, res, n):
        Wi, Wh = as_int8(W), as_f16(W)
        xq, xd, xsum = _x_scratch(K, n, wide_x)
        quantize_rows(x, xq, xd, xsum, n)
        for task in T.parallel((n + MB - 1) // MB * N):
            Y = T.decl_buffer((TT,), "float32")
            run((W, Wi, Wh), co(task), xq, xd, xsum, m0(task), rows(task, n), Y, y, bias, res,
                0)

    func = matmul_func(body, N, K, "uint8", epilogue, token_dim(None), _storage(fmt, N, K))
    return finalize(func, f"matmul_i8{'_wx' if wide_x else ''}_{epilogue}_{N}x{K}_{wfmt}")


@cached
def linear_swiglu_int8(I: int, K: int, wfmt: str, vnni: bool = False, locality: int = NTA):
    """act = silu(x @ Wg.T) * (x @ Wu.T) over n tokens, W (2I, K) quantized, gate and up rows
    in alternating runs; x quantized to int8 as ``linear_int8``'s."""
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K)
    if fmt.grouped:
        return linear_swiglu_int8_x8(I, K, wfmt, vnni, locality)
    gate_row, up_row = gate_up_rows(I)
    quantize_rows = _rows_quantizer(K, False)
    m0, co, rows = _task(I)
    n = token_dim(None)

    def finish_gate(tt):
        @T.macro
        def keep(Y, m, row, G, first, act, c):
            for t in range(tt):
                G[m - first + t] = Y[t]

        return keep

    def finish_up(tt):
        @T.macro
        def store(Y, m, row, G, first, act, c):
            for t in range(tt):
                act[m + t, c] = silu_mul(G[m - first + t], Y[t])

        return store

    run_gate = _token_tiles(fmt, K, False, finish_gate)
    run_up = _token_tiles(fmt, K, False, finish_up)

    @T.macro
    def body(x, W, act, n):
        Wi, Wh = as_int8(W), as_f16(W)
        xq, xd, xsum = _x_scratch(K, n, False)
        quantize_rows(x, xq, xd, xsum, n)
        for task in T.parallel((n + MB - 1) // MB * I):
            Y = T.decl_buffer((TT,), "float32")
            G = T.decl_buffer((MB,), "float32")
            run_gate((W, Wi, Wh), gate_row(co(task)), xq, xd, xsum, m0(task), rows(task, n),
                     Y, G, m0(task), act, co(task))
            run_up((W, Wi, Wh), up_row(co(task)), xq, xd, xsum, m0(task), rows(task, n), Y,
                   G, m0(task), act, co(task))

    func = swiglu_matmul_func(body, I, K, "uint8", n, _storage(fmt, 2 * I, K))

    return finalize(func, f"matmul_i8_swiglu_{I}x{K}_{wfmt}")


# batch buckets over quantized weights take the int8 tiles at every size: their x quantized
# and their sums ordered as the decode GEMV's, so a row's logits are the same in every bucket
# and at B = 1 (batch invariance).  The float tile over decoded weights measured faster from 8
# rows on over row layouts, which only matrices that cannot be interleaved still take (an LM
# head in a format without int16 x, shapes not a multiple of 8 rows; docs/design.md).
SMALL_ROWS = 1 << 20
# interleaved rows: the int8 tile at every bucket (about 2x the float tile at 4-128 rows on
# SmolLM2's and the 1.1B shape's matrices; docs/design.md)
SMALL_ROWS_INTERLEAVED = 1 << 20


def linear_rows(N: int, K: int, wfmt: str, epilogue: str, rows: int, wide_x: bool = False,
                vnni: bool = False, locality: int = NTA):
    """``linear_int8`` for a batch bucket of ``rows`` rows (its tiles take any count)."""
    return linear_int8(N, K, wfmt, epilogue, wide_x, vnni, locality)


def linear_swiglu_rows(I: int, K: int, wfmt: str, rows: int, vnni: bool = False,
                       locality: int = NTA):
    """``linear_swiglu_int8`` for a batch bucket of ``rows`` rows."""
    return linear_swiglu_int8(I, K, wfmt, vnni, locality)


# ------------------------------------------------------------------ rows interleaved by 8
# (``formats._Grouped``): lanes are the group's rows, so every kernel below computes 8 rows' dot
# products in one float32x8 accumulator and reduces nothing across lanes
def _sums_view(xsum):
    """``xsum`` as int32: the half sums ``_row_quantizer(halves=True)`` stores, two a block."""
    return T.decl_buffer((xsum.shape[0],), "int32", data=xsum.data)


def _group_unit(fmt, wide: bool, vnni: bool):
    """``unit(Wv, g, b, x4, e, xd, xsum, s)``: float32x8, unit b's contribution to group g's
    8 rows, its x from element ``e`` of ``x4`` (``_x_view``), its block's dx / sum at ``s``
    (half sums: ``_halves_for``, their -32 sum x broadcast as each half's chain start)."""
    if wide:
        return lambda Wv, g, b, x4, e, xd, xsum, s: fmt.group_unit(
            Wv, g, b, fmt.group_dot_wide(Wv, g, b, x4, e), xd[s], xsum[s])
    if _halves_for(fmt, wide):
        def unit(Wv, g, b, x4, e, xd, xsum, s):
            sums = _sums_view(xsum)
            neg = [T.broadcast(sums[2 * s + h], ROW_GROUP) for h in range(2)]
            return fmt.group_unit(Wv, g, b, fmt.group_dot(Wv, g, b, x4, e, vnni, neg=neg),
                                  xd[s], None)
        return unit
    return lambda Wv, g, b, x4, e, xd, xsum, s: fmt.group_unit(
        Wv, g, b, fmt.group_dot(Wv, g, b, x4, e, vnni), xd[s], xsum[s])


def _x_view(xq):
    """The quantized x, four weights per element (``group_dot`` broadcasts them): int8 x as
    int32, int16 x (``wide_x``) as int64."""
    return T.decl_buffer((xq.shape[0] // 4,), "int64" if xq.dtype == "int16" else "int32",
                         data=xq.data)


def _group_dot(fmt, K: int, wide: bool = False, locality: int = NTA, ahead: int | None = None,
               vnni: bool = False):
    """``dot(Wv, x4, xd, xsum, x0, Y, y0, g)``: Y[y0 : y0 + 8] = the 8 rows of group g . x,
    x quantized per 32-block to int8 (``wide``: int16; ``x4`` its ``_x_view`` from element
    ``x0 / 4``, its blocks' ``xd`` / ``xsum`` from ``x0 / 32``).  The units add into one
    accumulator in block order, as each token's in ``_group_tile`` (batch invariance); a k-quant
    steps whole super-blocks (8 units), so each unit's sub-block is a constant.  ``ahead``: the
    prefetch distance in bytes (default: the format's); ``vnni`` as for ``gemv``."""
    NB = K // QBLOCK
    U = max(ACCS, fmt.block // QBLOCK)
    ahead = ahead or PREFETCH_BYTES.get(fmt.base.name, PREFETCH_DEFAULT)
    prefetch = prefetch_ahead_macro(U * fmt.step_bytes, "uint8", ahead, locality)
    near_ahead = PREFETCH_NEAR.get(fmt.base.name, 0) if locality == L2 else 0
    near = prefetch_ahead_macro(U * fmt.step_bytes, "uint8", near_ahead, L1)
    has_near = near_ahead > 0
    group_unit = _group_unit(fmt, wide, vnni)

    def unit(Wv, g, b, x4, xd, xsum, x0):
        return group_unit(Wv, g, b, x4, x0 // 4 + b * 8, xd, xsum, x0 // QBLOCK + b)

    @T.macro
    def dot(Wv, x4, xd, xsum, x0, Y, y0, g):
        acc = T.decl_buffer((8,), "float32")
        acc[T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
        flat = T.decl_buffer((Wv[0].shape[0] * Wv[0].shape[1],), "uint8", data=Wv[0].data)
        for bo in range(NB // U):
            prefetch(flat, g * (NB * fmt.step_bytes) + bo * (U * fmt.step_bytes))
            if has_near:
                near(flat, g * (NB * fmt.step_bytes) + bo * (U * fmt.step_bytes))
            for a in T.unroll(U):
                acc[T.ramp(0, 1, 8)] = acc[T.ramp(0, 1, 8)] + unit(
                    Wv, g, bo * U + a, x4, xd, xsum, x0)
        for a in T.unroll(NB % U):
            acc[T.ramp(0, 1, 8)] = acc[T.ramp(0, 1, 8)] + unit(
                Wv, g, NB // U * U + a, x4, xd, xsum, x0)
        Y[T.ramp(y0, 1, 8)] = acc[T.ramp(0, 1, 8)]

    return dot


def _check_wide_x(fmt, wide_x: bool):
    if wide_x and not fmt.wide_x:  # an LM head in this format keeps rows (``interleaved``)
        wide = ", ".join(f.base.gguf_type for f in INTERLEAVED.values() if f.wide_x)
        raise ValueError(f"{fmt.name}: these interleaved rows take int8 x only (wide_x: "
                         f"int16 x is taken by {wide})")


def _group_tile(fmt, K: int, tt: int, wide: bool = False, vnni: bool = False,
                locality: int = NTA):
    """``tile(Wv, g, x4, xd, xsum, m0, Y)``: Y[8 t + r] = row r of group g . token m0 + t for
    ``tt`` tokens; each unit's quants are loaded once for all of them (LLVM keeps the unpacked
    vectors between the unrolled tokens' uses).  One accumulator per token, units in block
    order, as the decode GEMV's (``_group_dot``); a k-quant steps whole super-blocks.  The
    group's row is prefetched ahead as the decode GEMV's (its distance, ``locality`` its
    hint): without it the tile read Q6_K / Q4_K weights at 8-20 GB/s (docs/design.md)."""
    NB = K // QBLOCK
    U = max(ACCS // tt, fmt.block // QBLOCK, 1)
    group_unit = _group_unit(fmt, wide, vnni)
    prefetch = prefetch_ahead_macro(U * fmt.step_bytes, "uint8", _one_stream_ahead(fmt),
                                    locality)
    q_at, s_at = _tiled_at(K)

    def unit(Wv, g, b, x4, xd, xsum, m):
        return group_unit(Wv, g, b, x4, q_at(m, b) // 4, xd, xsum, s_at(m, b))

    @T.macro
    def tile(Wv, g, x4, xd, xsum, m0, Y):
        acc = T.decl_buffer((tt, 8), "float32")
        for t in T.unroll(tt):
            acc[t, T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
        flat = T.decl_buffer((Wv[0].shape[0] * Wv[0].shape[1],), "uint8", data=Wv[0].data)
        for bo in range(NB // U):
            prefetch(flat, g * (NB * fmt.step_bytes) + bo * (U * fmt.step_bytes))
            for a in T.unroll(U):
                for t in T.unroll(tt):
                    acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + unit(
                        Wv, g, bo * U + a, x4, xd, xsum, m0 + t)
        for a in T.unroll(NB % U):
            for t in T.unroll(tt):
                acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + unit(
                    Wv, g, NB // U * U + a, x4, xd, xsum, m0 + t)
        for t in T.unroll(tt):
            Y[T.ramp(t * 8, 1, 8)] = acc[t, T.ramp(0, 1, 8)]

    return tile


def _group_token_tiles(fmt, K: int, finish, wide: bool = False, vnni: bool = False,
                       locality: int = NTA):
    """``_run_tiles`` of group g (in place of row c) against ``rows`` tokens (``_group_tile``;
    x as ``_x_view``)."""
    return _run_tiles({tt: (_group_tile(fmt, K, tt, wide, vnni, locality), finish(tt))
                       for tt in (TT, 4, 2, 1)})


@cached
def linear_int8_x8(N: int, K: int, wfmt: str, epilogue: str = "none", wide_x: bool = False,
                   vnni: bool = False, locality: int = NTA):
    """``linear_int8`` over rows interleaved by 8: parallel tasks of (token block, group)."""
    assert epilogue in EPILOGUES
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K, N)
    _check_wide_x(fmt, wide_x)
    G = N // ROW_GROUP
    halves = _halves_for(fmt, wide_x)
    quantize_rows = _rows_quantizer(K, wide_x, halves)

    def finish(tt):
        @T.macro
        def store(Y, m, g, y, bias, res, unused):
            for t, r in T.grid(tt, ROW_GROUP):
                if epilogue == "bias":
                    y[m + t, g * ROW_GROUP + r] = Y[t * 8 + r] + bias[g * ROW_GROUP + r]
                elif epilogue == "residual":
                    y[m + t, g * ROW_GROUP + r] = Y[t * 8 + r] + res[m + t, g * ROW_GROUP + r]
                else:
                    y[m + t, g * ROW_GROUP + r] = Y[t * 8 + r]

        return store

    run = _group_token_tiles(fmt, K, finish, wide_x, vnni, locality)
    m0, co, rows = _task(G)

    @T.macro
    def body(x, W, y, bias, res, n):
        xq, xd, xsum = _x_scratch(K, n, wide_x, halves)
        quantize_rows(x, xq, xd, xsum, n)
        for task in T.parallel((n + MB - 1) // MB * G):
            Y = T.decl_buffer((TT * 8,), "float32")
            run((W, as_int8(W), as_f16(W)), co(task), _x_view(xq), xd, xsum, m0(task),
                rows(task, n), Y, y, bias, res, 0)

    func = matmul_func(body, N, K, "uint8", epilogue, token_dim(None), _storage(fmt, N, K))
    return finalize(func, f"matmul_i8{'_wx' if wide_x else ''}_{epilogue}_{N}x{K}_{wfmt}")


@cached
def linear_swiglu_int8_x8(I: int, K: int, wfmt: str, vnni: bool = False,
                          locality: int = NTA):
    """``linear_swiglu_int8`` over rows interleaved by 8: tasks of (token block, one run of
    ``GATE_UP_ROWS`` act rows), its groups of gate rows, then its groups of up rows (W in memory
    order, as the SwiGLU GEMV's)."""
    fmt = FORMATS[wfmt]
    _check_fits(fmt, K, I)
    gate_row, up_row = gate_up_rows(I)
    halves = _halves_for(fmt, False)
    quantize_rows = _rows_quantizer(K, False, halves)
    GR = GATE_UP_ROWS // ROW_GROUP  # groups per run (the last run may hold fewer)
    RUNS = -(-I // GATE_UP_ROWS)
    m0, co, rows = _task(RUNS)
    n = token_dim(None)

    def group(task, h):  # act group h of the task's run
        return co(task) * GR + h

    def finish_gate(tt):
        @T.macro
        def keep(Y, m, grp, G, first, act, c):
            for t in T.unroll(tt):
                G[T.ramp((m - first + t) * 8, 1, 8)] = Y[T.ramp(t * 8, 1, 8)]

        return keep

    def finish_up(tt):
        @T.macro
        def store(Y, m, grp, G, first, act, c):
            for t, r in T.grid(tt, ROW_GROUP):
                act[m + t, c * ROW_GROUP + r] = silu_mul(G[(m - first + t) * 8 + r],
                                                         Y[t * 8 + r])

        return store

    run_gate = _group_token_tiles(fmt, K, finish_gate, vnni=vnni, locality=locality)
    run_up = _group_token_tiles(fmt, K, finish_up, vnni=vnni, locality=locality)

    @T.macro
    def body(x, W, act, n):
        xq, xd, xsum = _x_scratch(K, n, False, halves)
        quantize_rows(x, xq, xd, xsum, n)
        for task in T.parallel((n + MB - 1) // MB * RUNS):
            Wv = (W, as_int8(W), as_f16(W))
            Y = T.decl_buffer((TT * 8,), "float32")
            G = T.decl_buffer((GR * MB * 8,), "float32")  # group h's gate from token h * MB on
            for h in range(GR):
                if group(task, h) * ROW_GROUP < I:
                    run_gate(Wv, gate_row(group(task, h) * ROW_GROUP) // ROW_GROUP,
                             _x_view(xq), xd, xsum, m0(task), rows(task, n), Y, G,
                             m0(task) - h * MB, act, group(task, h))
            for h in range(GR):
                if group(task, h) * ROW_GROUP < I:
                    run_up(Wv, up_row(group(task, h) * ROW_GROUP) // ROW_GROUP,
                           _x_view(xq), xd, xsum, m0(task), rows(task, n), Y, G,
                           m0(task) - h * MB, act, group(task, h))

    func = swiglu_matmul_func(body, I, K, "uint8", n, _storage(fmt, 2 * I, K))
    return finalize(func, f"matmul_i8_swiglu_{I}x{K}_{wfmt}")
