"""Paged attention through the block table, grouped-query, online softmax per block.

Buffers (D = head_dim, group = Hq / Hkv, n symbolic for prefill or 1 for decode):
  q (n, Hq D) float32 (RoPE applied)
  k_pool, v_pool (num_blocks, Hkv, block_size, D) cache dtype
  block_table (1, max_blocks_cap) int32 -- entries past the context are never read
  decode:  context_len int64 -- the query (position context_len - 1) sees positions < context_len
  decode_dev: context_len as a (1,) int64 buffer (``paged_attention_decode_dev``)
  prefill: start_pos int64   -- query row i sees positions <= start_pos + i (causal)
  -> out (n, Hq D) float32
Work is split by kv head: the ``group`` query heads of one kv head share every K/V row load.
A block holds each kv head's rows contiguously (``[block, kv_head, slot, dim]``), so one head
reads one ``block_size x D`` run per block, whatever block the table points at: with the
``[block, slot, kv_head, dim]`` order, a head's rows were strided and a scattered table broke
the prefetcher's stride at every block (attention 1.6x slower than on an identity table).
Scores are computed a block at a time into a block_size scratch, their lane sums for all rows of
the block taken together, then folded into the running max / sum / accumulator (exp vectorised
over the block), so no scratch grows with the context.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .common import (CACHE_LINE, cached, dtype_tag, finalize, lane_slice, lane_sum_macro, pick_tile,
                     prefetch_l2, scratch_buffer)
from .fastmath import fexp
from .linear import token_dim


PARALLEL_MIN_WORK = 1 << 15  # multiply-adds of q.K below which decode attention runs serially
# A block of one head is a single block_size x D run (4 KB in f32 at D 64), which the hardware
# prefetcher meets cold at every block (it does not follow the table); the kernel prefetches the
# block PREFETCH_BLOCKS ahead into L2 instead.  At 160M shape, context 1024, with the pools out of
# cache, that made attention 1.6-1.8x faster (scattered table, f32 and f16).  With one query head
# per kv head the block's compute is short, and issuing all of a block's prefetches at once
# (64-128 of them) stalled the core on its miss buffers: there the prefetches are spread, one
# row of the future block per row processed (160M shape, ctx 1024 from DRAM: 0.77-0.96 of the
# burst's time; 0.3-0.4 with the K/V in cache).  With 8 query heads per kv head (TinyLlama) the
# block's compute hides the burst, and spreading ran 1.13-1.18x slower, so it stays a burst.
PREFETCH_BLOCKS = 2


def _attend_macro(Hq, Hkv, D, bs, cap, cdt):
    """Attention of the ``group`` query heads sharing kv head ``kvh``: each block's K/V rows come
    from memory once for the whole group (the group re-reads them from L1)."""
    G, scale = Hq // Hkv, 1.0 / math.sqrt(D)
    DV = pick_tile(D, (16, 8, 4, 2, 1))
    lane_sum = lane_sum_macro(DV)
    per_line = CACHE_LINE // {"float32": 4, "float16": 2}[cdt]  # elements per cache line
    spread = G == 1  # see PREFETCH_BLOCKS

    def block(bt, b):  # the table entry as an int64 index (an expression: see scratch_buffer)
        return T.Cast("int64", bt[0, b])

    @T.macro
    def prefetch_block(k_pool, v_pool, bt, kvh, b, n_blocks):
        """Prefetch the K and V rows of head ``kvh`` in the block ``b`` of the table, if any."""
        if b < n_blocks:
            for line in range(-(-(bs * D) // per_line)):
                prefetch_l2(T.address_of(k_pool[block(bt, b), kvh,
                                                line * per_line // D, line * per_line % D]))
                prefetch_l2(T.address_of(v_pool[block(bt, b), kvh,
                                                line * per_line // D, line * per_line % D]))

    @T.macro
    def prefetch_row(k_pool, v_pool, bt, kvh, b, n_blocks, t):
        """Prefetch row ``t`` of head ``kvh``'s K and V in block ``b`` of the table, if any."""
        if b < n_blocks:
            for line in T.unroll(-(-D // per_line)):
                prefetch_l2(T.address_of(k_pool[block(bt, b), kvh, t, line * per_line]))
                prefetch_l2(T.address_of(v_pool[block(bt, b), kvh, t, line * per_line]))

    @T.macro
    def attend(q, k_pool, v_pool, bt, out, row, kvh, ctx, acc, R):
        """``acc`` (G, D) and ``R`` (bs, DV): the caller's float32 scratch for this head."""
        s = scratch_buffer((G, bs))
        st = scratch_buffer((G, 4))  # running max, sum, block max, rescale
        for g in range(G):
            st[g, 0] = T.float32(-3.0e38)
            st[g, 1] = T.float32(0)
            for d in T.vectorized(D):
                acc[g, d] = T.float32(0)
        for b in range((ctx + bs - 1) // bs):
            if not spread:
                prefetch_block(k_pool, v_pool, bt, kvh, b + PREFETCH_BLOCKS, (ctx + bs - 1) // bs)
            for g, t in T.grid(G, bs):
                s[g, t] = T.float32(-3.0e38)
            for g in range(G):  # q.K for the block's rows, reduced together (no serial chain)
                for t in range(T.min(bs, ctx - b * bs)):
                    for v in T.vectorized(DV):
                        R[t, v] = T.float32(0)
                    for do in range(D // DV):
                        for v in T.vectorized(DV):
                            R[t, v] = R[t, v] + q[row, (kvh * G + g) * D + do * DV + v] * T.Cast(
                                "float32", k_pool[block(bt, b), kvh, t, do * DV + v])
                for t in range(T.min(bs, ctx - b * bs)):
                    lane_sum(R, t)
                    s[g, t] = R[t, 0] * T.float32(scale)
            for g in range(G):
                st[g, 2] = s[g, 0]
                for t in range(1, bs):
                    st[g, 2] = T.max(st[g, 2], s[g, t])
                st[g, 3] = fexp(st[g, 0] - T.max(st[g, 0], st[g, 2]))
                st[g, 0] = T.max(st[g, 0], st[g, 2])
                st[g, 1] = st[g, 1] * st[g, 3]
                for d in T.vectorized(D):
                    acc[g, d] = acc[g, d] * st[g, 3]
                for t in T.vectorized(bs):
                    s[g, t] = fexp(s[g, t] - st[g, 0])
            for t in range(T.min(bs, ctx - b * bs)):
                if spread:
                    prefetch_row(k_pool, v_pool, bt, kvh, b + PREFETCH_BLOCKS, (ctx + bs - 1) // bs, t)
                for g in range(G):
                    st[g, 1] = st[g, 1] + s[g, t]
                    for d in T.vectorized(D):
                        acc[g, d] = acc[g, d] + s[g, t] * T.Cast("float32", v_pool[block(bt, b), kvh, t, d])
        for g in range(G):
            for d in T.vectorized(D):
                out[row, (kvh * G + g) * D + d] = acc[g, d] / st[g, 1]

    return attend, (G, D), (bs, DV)


def _decode_body(Hq, Hkv, D, bs, cap, nb, cdt):
    """The decode checks + attention, shared by the scalar and the device-tensor variants:
    ``context_len`` is an int64 expression (a scalar param or ``buf[0]``)."""
    attend, acc_shape, r_shape = _attend_macro(Hq, Hkv, D, bs, cap, cdt)

    @T.macro
    def body(q, k_pool, v_pool, bt, out, context_len):
        assert 1 <= context_len and context_len <= cap * bs, "context_len outside [1, max_blocks_cap * block_size]"
        for b in range((context_len + bs - 1) // bs):
            assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
        acc_all = T.decl_buffer((Hkv,) + acc_shape, "float32")  # per-head scratch, one block
        r_all = T.decl_buffer((Hkv,) + r_shape, "float32")
        if context_len * Hq * D >= PARALLEL_MIN_WORK:
            for kvh in T.parallel(Hkv):
                attend(q, k_pool, v_pool, bt, out, 0, kvh, context_len,
                       lane_slice(acc_all, kvh, acc_shape), lane_slice(r_all, kvh, r_shape))
        else:  # a short context costs less than waking the thread pool
            for kvh in T.serial(Hkv):
                attend(q, k_pool, v_pool, bt, out, 0, kvh, context_len,
                       lane_slice(acc_all, kvh, acc_shape), lane_slice(r_all, kvh, r_shape))

    return body


@cached
def paged_attention_decode(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """One query token per head against context_len cached positions."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    body = _decode_body(Hq, Hkv, D, bs, cap, nb, cdt)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.int64,
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(q, k_pool, v_pool, bt, out, context_len)

    return finalize(func, f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


@cached
def paged_attention_decode_dev(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """``paged_attention_decode`` with ``context_len`` read from a (1,) int64 buffer."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    body = _decode_body(Hq, Hkv, D, bs, cap, nb, cdt)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.Buffer((1,), "int64"),
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(q, k_pool, v_pool, bt, out, context_len[0])

    return finalize(func, f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}_dev")


@cached
def paged_attention_prefill(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """n query tokens (positions start_pos + i), causal over the cached prefix and themselves."""
    attend, acc_shape, r_shape = _attend_macro(Hq, Hkv, D, block_size, cap, cdt)
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
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
            for b in range((start_pos + n + bs - 1) // bs):
                assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
            for ik in T.parallel(n * Hkv):
                attend(q, k_pool, v_pool, bt, out, ik // Hkv, ik % Hkv, start_pos + ik // Hkv + 1,
                       scratch_buffer(acc_shape), scratch_buffer(r_shape))

    return finalize(func, f"attn_pre_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")
