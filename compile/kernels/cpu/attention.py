"""Paged attention through the block table, grouped-query, online softmax per block.

Buffers (D = head_dim, group = Hq / Hkv, n symbolic for prefill or 1 for decode):
  q (n, Hq D) float32 (RoPE applied)
  k_pool, v_pool (num_blocks, Hkv, block_size, D) cache dtype
  block_table (1, max_blocks_cap) int32 -- entries past the context are never read
  decode:  context_len int64 -- the query (position context_len - 1) sees positions < context_len
  decode_dev: context_len as a (1,) int64 buffer (``paged_attention_decode_dev``)
  prefill: start_pos int64   -- query row i sees positions <= start_pos + i (causal)
  -> out (n, Hq D) float32
Keyword options (``signatures.attention_options``): ``window`` (a query at position q sees
only q - window < p <= q; the block walk starts at the window's first block, so blocks before it
are never read nor checked, and only that block's rows before the window are masked),
``softcap`` (scores capped as softcap * tanh(s / softcap)), ``scale`` (the q.k multiplier).
The ``group`` query heads of one kv head share every K/V load.  Decode splits a long
context's blocks among the parallel lanes, each lane taking every head of a block before the
next block, and merges the lanes' softmax states (see ``PART_ROWS``); prefill splits by (query
row, kv head).  A block holds each kv head's rows contiguously (``[block, kv_head, ...]``, a
block's heads one after the other), so a block of one head is one ``block_size x D`` run and a
block of all heads one run of Hkv times that, whatever block the table points at: the hardware
prefetcher follows runs and restarts at every jump.
Within its run a V block is ``[slot, dim]`` and a K block ``[dim, slot]`` (``K_BLOCK_LAYOUT``,
written so by ``rope_kv``): a block's scores are then vector multiply-adds over its slots, one
dim (one q element per head) at a time, with no horizontal sum per row (``scores``).  The
running max / sum update is vectorised over the group's heads (over the block's rows when the
group is one head), and each V row is read once per ``SV_HEADS`` heads; no scratch grows with
the context.  Why each of these, with the measurements: docs/design.md.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ..common import cached, dtype_tag, finalize, pick_tile, token_dim
from ..signatures import attention_options
from .fastmath import fexp, ftanh
from .simd import STACK_BYTES, k_block_view, lane_slice, prefetch_ahead_macro, scratch_buffer


PARALLEL_MIN_WORK = 1 << 15  # multiply-adds of q.K below which decode attention runs serially
# A block's scores: for each dim, one q element times a vector of the block's slots (K stored
# [dim, slot]), for GQ query heads at a time (as many as keep GQ x block_size <= SCORE_FLOATS
# partial scores in registers) in KP partial sums (at least SCORE_CHAINS independent vector
# chains).  192 rather than 128 lets SmolLM2's 3 query heads per kv head share each K column read
# with 64-token blocks.  A V row is read once per SV_HEADS heads, their sums in stack scratch.
SV_HEADS = 3
SCORE_FLOATS, SCORE_CHAINS = 192, 8
# Decode over several blocks splits the blocks, not the heads, among the lanes (``split_parts``:
# whole blocks, at most about PART_ROWS rows per part, at least two parts, at most MAX_PARTS), so
# a lane reads one run of Hkv * block_size * D elements per block from K and one from V.
PART_ROWS, MAX_PARTS = 128, 16
# Software prefetch as data read once (``prefetchnta``), ROW_PREFETCH_BYTES ahead of each K
# column step / V row, past a block's end into the table's next block (``ahead_index``): the
# hardware prefetcher restarts at every jump of a scattered table.
ROW_PREFETCH_BYTES = 4096


def pool_flat(pool):
    """A K or V pool as one flat run of elements (its blocks one after the other), for the
    prefetches' addresses."""
    return T.decl_buffer((1 << 62,), pool.dtype, data=pool.data)


def cvt_width(n: int, cdt: str) -> int:
    """Lanes per vector that reads ``cdt`` as float32: 8 for float16 (``vcvtph2ps`` into a
    256-bit register converts twice as many elements per cycle as into a 512-bit one; see
    docs/design.md), 16 for float32; the largest that divides ``n``."""
    return pick_tile(n, (8, 4, 2, 1) if cdt == "float16" else (16, 8, 4, 2, 1))


def first_block(ctx, window: int, bs: int):
    """The first block the query at position ``ctx - 1`` reads: the one holding position ``ctx -
    window``, its window's first (0, a Python int that leaves the loops as written, without a
    window).  Blocks before it are not read at all, so a sliding layer's cost stays flat as the
    context grows."""
    return T.max(ctx - window, T.int64(0)) // bs if window else 0


def first_row(ctx, b, window: int, bs: int):
    """The first row of block ``b`` in the window of the query at position ``ctx - 1`` (0 past
    the window's first block, and without a window)."""
    return T.max(ctx - window - b * bs, T.int64(0)) if window else 0


def _attend_macro(Hq, Hkv, D, bs, cap, cdt, window=0, softcap=0.0, scale=0.0):
    """Attention of the ``group`` query heads sharing kv head ``kvh``: each block's K/V rows come
    from memory once for the whole group (re-read from L1 per GQ / GV heads).  ``window``,
    ``softcap``, ``scale`` as ``signatures.attention_options`` resolves them (scale 0:
    ``1 / sqrt(D)``)."""
    G, scale = Hq // Hkv, scale or 1.0 / math.sqrt(D)
    DV = cvt_width(D, cdt)
    CW = cvt_width(bs, cdt)  # rows per vector of scores
    # Query heads whose scores (GQ x bs, KP partial sums each) accumulate in registers while
    # one K column of the block is read; KP partial sums per score give at least SCORE_CHAINS
    # independent vector chains.  The s.V sums (GV x D) of GV heads accumulate in stack scratch
    # (under STACK_BYTES) while one V row is read; with head_dim >= 256 not even one head's
    # s.V sums fit, and they go straight into ``acc``.
    GQ = max(d for d in range(1, G + 1) if G % d == 0 and (d == 1 or d * bs <= SCORE_FLOATS))
    KP = max(d for d in (1, 2, 4) if D % d == 0
             and (d == 1 or (d // 2) * GQ * bs < SCORE_CHAINS * CW))
    GV = max(d for d in range(1, SV_HEADS + 1)
             if G % d == 0 and (d == 1 or d * D * 4 < STACK_BYTES))
    v_scratch = GV * D * 4 < STACK_BYTES
    # the prefetch of one K column step (KP dims of the block's rows) and of one V row, at the
    # index ``ahead_index`` gives
    k_ahead = prefetch_ahead_macro(KP * bs, cdt, 0)
    v_ahead = prefetch_ahead_macro(D, cdt, 0)

    def block(bt, b):  # the table entry as an int64 index (an expression: see scratch_buffer)
        return T.Cast("int64", bt[0, b])

    @T.macro
    def init(acc, st):
        """A head group's state before its first block: no rows seen."""
        for g in range(G):
            st[0, g] = T.float32(-3.0e38)
            st[1, g] = T.float32(0)
            for d in T.vectorized(D):
                acc[g, d] = T.float32(0)

    @T.macro
    def finish(out, row, kvh, acc, st):
        for g in range(G):
            for d in T.vectorized(D):
                out[row, (kvh * G + g) * D + d] = acc[g, d] / st[1, g]

    RUN = Hkv * bs * D  # elements of a block (every head)
    AHEAD = ROW_PREFETCH_BYTES // np.dtype(cdt).itemsize

    def successor(bt, b, ctx):  # the block after table entry ``b`` of a ``ctx``-row context:
        # the next entry's, or past the context's last block the physically next (the entries
        # past the context are not read for it; the clamped read stays inside the table)
        return T.Select((b + 1) * bs < ctx, T.Cast("int64", bt[0, T.min(b + 1, cap - 1)]),
                        block(bt, b) + 1)

    def ahead_index(bt, kvh, b, o, ctx):  # the element ROW_PREFETCH_BYTES past element ``o``
        # of kv head ``kvh``'s run in entry ``b``, in the table's next block past this one's end
        pos = kvh * bs * D + o + AHEAD
        return T.Select(pos < RUN, block(bt, b) * RUN + pos,
                        successor(bt, b, ctx) * RUN + pos - RUN)

    @T.macro
    def prefetch_run(pool, bt, kvh, b, o, ahead, ctx):
        """``ahead``, one of ``k_ahead`` (a K column step) and ``v_ahead`` (a V row),
        ROW_PREFETCH_BYTES past element ``o`` of kv head ``kvh``'s run in table entry ``b`` of a
        ``ctx``-row context: past the head's run in the next head's, past the block in the
        table's next block (``ahead_index``)."""
        ahead(pool_flat(pool), ahead_index(bt, kvh, b, o, ctx))

    def in_context(t, ctx, b):  # whether row ``t`` of block ``b`` is a position < ctx (and
        # inside the window of the query at ctx - 1)
        if window:
            return tirx.all(T.Cast("int64", t) < ctx - b * bs,
                            T.Cast("int64", t) >= ctx - window - b * bs)
        return T.Cast("int64", t) < ctx - b * bs

    # The rows of block ``b`` in the context (and the window): ``n_rows`` of them from
    # ``first_row``, loop row ``t`` being block slot ``slot(ctx, b, t)``.  The loops count from
    # 0: TVM's loop canonicalisation (0.27) loses the outer loop's shift in an inner loop whose
    # start depends on an outer loop that does not start at 0 (a block loop).
    def n_rows(ctx, b):
        if window:
            return T.min(bs, ctx - b * bs) - first_row(ctx, b, window, bs)
        return T.min(bs, ctx - b * bs)

    def slot(ctx, b, t):
        return first_row(ctx, b, window, bs) + t if window else t

    def capped(x):  # a scaled score, soft-capped where the model caps them
        if softcap:
            return T.float32(softcap) * ftanh(x * T.float32(1.0 / softcap))
        return x

    def fold(R, gi, t):  # the KP partial sums of one score (an expression)
        total = R[0, gi, t]
        for kp in range(1, KP):
            total = total + R[kp, gi, t]
        return total

    @T.macro
    def scores(q, k_pool, bt, row, kvh, g0, b, ctx, R, s):
        """s[t, g0 + gi] = scale * q_h . K row t of block ``b``, for the GQ heads h = kvh G + g0
        + gi, rows past the context -3e38: the block's K columns (one dim of every row) times
        one q element each, KP partial sums per score in ``R`` (KP, GQ, bs)."""
        kt = k_block_view(k_pool, Hkv, D, bs)
        for kp, gi, tc in T.grid(KP, GQ, bs // CW):
            for v in T.vectorized(CW):
                R[kp, gi, tc * CW + v] = T.float32(0)
        for dd in range(D // KP):
            prefetch_run(k_pool, bt, kvh, b, dd * KP * bs, k_ahead, ctx)
            for kp in T.unroll(KP):
                for tc in T.unroll(bs // CW):
                    for gi in T.unroll(GQ):
                        for v in T.vectorized(CW):
                            R[kp, gi, tc * CW + v] = R[kp, gi, tc * CW + v] + q[
                                row, (kvh * G + g0 + gi) * D + dd * KP + kp] * T.Cast(
                                "float32", kt[block(bt, b), kvh, dd * KP + kp, tc * CW + v])
        for gi, tc in T.grid(GQ, bs // CW):
            for v in T.vectorized(CW):
                s[tc * CW + v, g0 + gi] = T.Select(
                    in_context(tc * CW + v, ctx, b),
                    capped(fold(R, gi, tc * CW + v) * T.float32(scale)), T.float32(-3.0e38))

    @T.macro
    def sv_update(v_pool, bt, kvh, b, ctx, s, acc, st):
        """acc[g] = acc[g] * st[3, g] + s[:, g] . V for every query head g of kv head ``kvh``,
        over block ``b``'s rows in the context: a V row read once per GV heads, prefetching
        ``ahead`` in the run."""
        if v_scratch:
            for gv in range(G // GV):
                a = scratch_buffer((GV, D))
                for gi, do in T.grid(GV, D // DV):
                    for v in T.vectorized(DV):
                        a[gi, do * DV + v] = T.float32(0)
                for t in range(n_rows(ctx, b)):
                    prefetch_run(v_pool, bt, kvh, b, slot(ctx, b, t) * D, v_ahead, ctx)
                    for do in T.unroll(D // DV):
                        for gi in T.unroll(GV):
                            for v in T.vectorized(DV):
                                a[gi, do * DV + v] = a[gi, do * DV + v] + s[
                                    slot(ctx, b, t), gv * GV + gi] * T.Cast("float32", v_pool[
                                        block(bt, b), kvh, slot(ctx, b, t), do * DV + v])
                for gi, do in T.grid(GV, D // DV):
                    for v in T.vectorized(DV):
                        acc[gv * GV + gi, do * DV + v] = (
                            acc[gv * GV + gi, do * DV + v] * st[3, gv * GV + gi]
                            + a[gi, do * DV + v])
        else:  # not even one head's sums fit the stack: straight into acc
            for g in range(G):
                for d in T.vectorized(D):
                    acc[g, d] = acc[g, d] * st[3, g]
            for t in range(n_rows(ctx, b)):
                prefetch_run(v_pool, bt, kvh, b, slot(ctx, b, t) * D, v_ahead, ctx)
                for g in range(G):
                    for d in T.vectorized(D):
                        acc[g, d] = acc[g, d] + s[slot(ctx, b, t), g] * T.Cast(
                            "float32", v_pool[block(bt, b), kvh, slot(ctx, b, t), d])

    @T.macro
    def step_one(q, k_pool, v_pool, bt, row, kvh, b, ctx, acc, st, R, s):
        """Block ``b`` of the table for one query head per kv head: ``acc`` (1, D), ``st``
        (4, 1) the running state, ``R`` (KP, 1, bs) and ``s`` (bs, 1) scratch."""
        scores(q, k_pool, bt, row, kvh, 0, b, ctx, R, s)
        m = scratch_buffer((2, CW))  # lane-wise max, then sum, of the block's scores
        for v in T.vectorized(CW):
            m[0, v] = s[v, 0]
        for tc in range(1, bs // CW):
            for v in T.vectorized(CW):
                m[0, v] = T.max(m[0, v], s[tc * CW + v, 0])
        st[2, 0] = m[0, 0]
        for v in range(1, CW):
            st[2, 0] = T.max(st[2, 0], m[0, v])
        st[3, 0] = fexp(st[0, 0] - T.max(st[0, 0], st[2, 0]))
        st[0, 0] = T.max(st[0, 0], st[2, 0])
        for v in T.vectorized(CW):
            m[1, v] = T.float32(0)
        for tc in range(bs // CW):
            for v in T.vectorized(CW):  # rows past the context stay out of the sum
                s[tc * CW + v, 0] = T.Select(in_context(tc * CW + v, ctx, b),
                                             fexp(s[tc * CW + v, 0] - st[0, 0]), T.float32(0))
                m[1, v] = m[1, v] + s[tc * CW + v, 0]
        st[1, 0] = st[1, 0] * st[3, 0]
        for v in range(CW):
            st[1, 0] = st[1, 0] + m[1, v]
        sv_update(v_pool, bt, kvh, b, ctx, s, acc, st)

    @T.macro
    def step(q, k_pool, v_pool, bt, row, kvh, b, ctx, acc, st, R, s):
        """Block ``b`` of the table for the ``G`` query heads of kv head ``kvh``: ``acc`` (G, D),
        ``st`` (4, G) the running state (max, sum, block max, rescale), ``R`` (KP, GQ, bs) and
        ``s`` (bs, G) scratch (the block's scores, [row, query head]).  The caller declares the
        scratch once per lane: from 256 scores on (16 query heads per kv head with 16-token
        blocks, 8 with 32-token ones) ``s`` is 1 KiB or more, which TVM heap-allocates at every
        entry of the loop that declares it (once per lane here, per task in prefill)."""
        for gq in range(G // GQ):  # q.K: each K column read once per GQ heads
            scores(q, k_pool, bt, row, kvh, gq * GQ, b, ctx, R, s)
        # the online-softmax update, vectorised over the query heads
        for g in T.vectorized(G):
            st[2, g] = s[0, g]
        for t in range(1, bs):
            for g in T.vectorized(G):
                st[2, g] = T.max(st[2, g], s[t, g])
        for g in T.vectorized(G):
            st[3, g] = fexp(st[0, g] - T.max(st[0, g], st[2, g]))
            st[0, g] = T.max(st[0, g], st[2, g])
            st[1, g] = st[1, g] * st[3, g]
        for t in range(bs):
            for g in T.vectorized(G):
                s[t, g] = fexp(s[t, g] - st[0, g])
        # rows outside the context (and the window) stay out of it
        for t in range(n_rows(ctx, b)):
            for g in T.vectorized(G):
                st[1, g] = st[1, g] + s[slot(ctx, b, t), g]
        sv_update(v_pool, bt, kvh, b, ctx, s, acc, st)

    block_step = step_one if G == 1 else step

    @T.macro
    def attend(q, k_pool, v_pool, bt, out, row, kvh, ctx, acc, st, R, s):
        """Every block of a ``ctx``-row context (from the window's first) for kv head ``kvh``'s
        query heads (query row ``row``), one after the other, into ``out``; scratch as for the
        block step."""
        init(acc, st)
        for b in range(first_block(ctx, window, bs), (ctx + bs - 1) // bs):
            block_step(q, k_pool, v_pool, bt, row, kvh, b, ctx, acc, st, R, s)
        finish(out, row, kvh, acc, st)

    return init, block_step, attend, ((G, D), (4, G), (KP, GQ, bs), (bs, G))


def split_parts(n_blocks, bs, lo=min, hi=max, const=int):
    """How many parts decode attention cuts a context of ``n_blocks`` blocks into: whole blocks,
    at most ``max(1, PART_ROWS // bs)`` each unless that makes more than MAX_PARTS parts, at least
    two (one for a single block).  ``lo`` / ``hi`` / ``const``: min / max / a constant, Python's
    or TIR's (the kernel passes T.min, T.max, T.int64)."""
    part_blocks = max(1, PART_ROWS // bs)
    return lo(lo(const(MAX_PARTS), n_blocks),
              hi(const(2), (n_blocks + part_blocks - 1) // part_blocks))


class DecodeSplit:
    """How decode attention cuts one query's context among parallel parts, and how it merges
    them: the B = 1 kernels' choice, which the batched kernel takes for each of its rows so a
    row's softmax sums are added in the same order whatever the batch (batch invariance).
    Contexts under ``PARALLEL_MIN_WORK`` multiply-adds are one part, finished directly."""

    def __init__(self, Hq: int, Hkv: int, D: int, bs: int, window: int):
        self.Hq, self.Hkv, self.D, self.bs, self.window = Hq, Hkv, D, bs, window
        self.G = Hq // Hkv
        self.merge = self._merge_macro()

    def first(self, ctx):  # the first block read (0 without a window)
        return first_block(ctx, self.window, self.bs)

    def rows_read(self, ctx):  # the rows of the blocks read
        return ctx - self.first(ctx) * self.bs if self.window else ctx

    def n_blocks(self, ctx):
        return (ctx + self.bs - 1) // self.bs

    def blocks_read(self, ctx):
        return self.n_blocks(ctx) - self.first(ctx) if self.window else self.n_blocks(ctx)

    def split(self, ctx):  # whether the context is cut into parts (else one part, finished)
        return self.rows_read(ctx) * self.Hq * self.D >= PARALLEL_MIN_WORK

    def parts(self, ctx):  # parts of a split context
        return split_parts(self.blocks_read(ctx), self.bs, T.min, T.max, T.int64)

    def part_start(self, p, parts, ctx):  # part ``p``'s first block, of ``parts``
        if self.window:
            return self.first(ctx) + p * self.blocks_read(ctx) // parts
        return p * self.n_blocks(ctx) // parts

    def _merge_macro(self):
        Hkv, G, D = self.Hkv, self.G, self.D

        @T.macro
        def merge(out, row, acc_p, st_p, parts, kv0, kv1):
            """out[row] = the ``parts`` partial softmax states of kv heads [kv0, kv1)'s query
            heads combined: each part's sums rescaled to the overall max, divided by the overall
            sum."""
            for kvh in range(kv0, kv1):
                for g in range(G):
                    m = scratch_buffer((2,))  # overall max, overall sum
                    m[0] = st_p[0, kvh, 0, g]
                    for p in range(1, parts):
                        m[0] = T.max(m[0], st_p[p, kvh, 0, g])
                    m[1] = T.float32(0)
                    for p in range(parts):  # slot 2: the part's weight exp(max_p - max)
                        st_p[p, kvh, 2, g] = fexp(st_p[p, kvh, 0, g] - m[0])
                        m[1] = m[1] + st_p[p, kvh, 1, g] * st_p[p, kvh, 2, g]
                    for d in T.vectorized(D):
                        out[row, (kvh * G + g) * D + d] = T.float32(0)
                    for p in range(parts):
                        for d in T.vectorized(D):
                            out[row, (kvh * G + g) * D + d] = (out[row, (kvh * G + g) * D + d]
                                                               + acc_p[p, kvh, g, d]
                                                               * st_p[p, kvh, 2, g])
                    for d in T.vectorized(D):
                        out[row, (kvh * G + g) * D + d] = out[row, (kvh * G + g) * D + d] / m[1]

        return merge


def _decode_body(Hq, Hkv, D, bs, cap, nb, cdt, window, softcap, scale):
    """The decode checks + attention, shared by the scalar and the device-tensor variants:
    ``context_len`` is an int64 expression (a scalar param or ``buf[0]``).  The checks, the
    parallel split and the parts cover the blocks the query reads: from the window's first."""
    init, step, attend, shapes = _attend_macro(Hq, Hkv, D, bs, cap, cdt, window, softcap, scale)
    acc_shape, st_shape, r_shape, s_shape = shapes
    sp = DecodeSplit(Hq, Hkv, D, bs, window)
    first, part_start = sp.first, sp.part_start

    @T.macro
    def body(q, k_pool, v_pool, bt, out, context_len):
        assert 1 <= context_len and context_len <= cap * bs, "context_len outside [1, max_blocks_cap * block_size]"
        n_blocks = (context_len + bs - 1) // bs
        for b in range(first(context_len), n_blocks):
            assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
        if sp.split(context_len):
            parts = sp.parts(context_len)
            acc_p = T.decl_buffer((MAX_PARTS, Hkv) + acc_shape, "float32")
            st_p = T.decl_buffer((MAX_PARTS, Hkv) + st_shape, "float32")
            r_p = T.decl_buffer((MAX_PARTS,) + r_shape, "float32")
            for p in T.parallel(parts):  # a run of whole blocks, every head, block by block
                scores = scratch_buffer(s_shape)
                for kvh in range(Hkv):
                    init(lane_slice(acc_p, p * Hkv + kvh, acc_shape),
                         lane_slice(st_p, p * Hkv + kvh, st_shape))
                for b in range(part_start(p, parts, context_len),
                               part_start(p + 1, parts, context_len)):
                    for kvh in range(Hkv):
                        step(q, k_pool, v_pool, bt, 0, kvh, b, context_len,
                             lane_slice(acc_p, p * Hkv + kvh, acc_shape),
                             lane_slice(st_p, p * Hkv + kvh, st_shape),
                             lane_slice(r_p, p, r_shape), scores)
            sp.merge(out, 0, acc_p, st_p, parts, 0, Hkv)
        else:  # a short context costs less than waking the thread pool
            acc = scratch_buffer(acc_shape)
            st = scratch_buffer(st_shape)
            r = T.decl_buffer(r_shape, "float32")
            scores = scratch_buffer(s_shape)
            for kvh in range(Hkv):
                attend(q, k_pool, v_pool, bt, out, 0, kvh, context_len, acc, st, r, scores)

    return body


@cached
def paged_attention_decode(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, *,
                           window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """One query token per head against context_len cached positions (the last ``window`` of
    them; ``softcap``, ``scale``: ``signatures.attention_options``)."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    body = _decode_body(Hq, Hkv, D, bs, cap, nb, cdt, *opts)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.int64,
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(q, k_pool, v_pool, bt, out, context_len)

    return finalize(func, f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")


@cached
def paged_attention_decode_dev(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str,
                               *, window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """``paged_attention_decode`` with ``context_len`` read from a (1,) int64 buffer."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    body = _decode_body(Hq, Hkv, D, bs, cap, nb, cdt, *opts)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.Buffer((1,), "int64"),
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(q, k_pool, v_pool, bt, out, context_len[0])

    return finalize(func,
                    f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}_dev")


@cached
def paged_attention_prefill(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, *,
                            window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """n query tokens (positions start_pos + i), causal over the cached prefix and themselves;
    row i over its own window, the last ``window`` positions up to start_pos + i."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    window, softcap, scale, tag = attention_options(D, cap * bs, window, softcap, scale)
    _, _, attend, shapes = _attend_macro(Hq, Hkv, D, bs, cap, cdt, window, softcap, scale)
    acc_shape, st_shape, r_shape, s_shape = shapes
    n = token_dim(None)

    @T.prim_func(s_tir=True)
    def func(var_q: T.handle, var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), start_pos: T.int64, var_out: T.handle):
        q = T.match_buffer(var_q, (n, Hq * D), "float32")
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        out = T.match_buffer(var_out, (n, Hq * D), "float32")
        with T.sblock("root"):
            assert 0 <= start_pos and start_pos + n <= cap * bs, "prompt past max_blocks_cap * block_size"
            for b in range(first_block(start_pos + 1, window, bs), (start_pos + n + bs - 1) // bs):
                assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
            for ik in T.parallel(n * Hkv):  # (query row, kv head) tasks, each over its blocks
                acc = scratch_buffer(acc_shape)
                st = scratch_buffer(st_shape)
                r = scratch_buffer(r_shape)
                scores = scratch_buffer(s_shape)
                attend(q, k_pool, v_pool, bt, out, ik // Hkv, ik % Hkv, start_pos + ik // Hkv + 1,
                       acc, st, r, scores)

    return finalize(func, f"attn_pre_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")
