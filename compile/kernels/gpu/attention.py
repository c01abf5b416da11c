"""GPU paged attention and the RoPE + KV write, with the CPU kernels' signatures and layouts.

Attention: one block per (query row, query head) with ``NT`` threads (``NT = D * PG``, 128 for
head_dim 16 / 32 / 64 / 128).  The context is walked in chunks of ``NT`` positions (online
softmax per chunk): thread t scores position ``c NT + t`` (q . k through the block table, q
staged in shared memory), a block max and a block sum rescale the running max / sum, and for
P.V thread t owns dimension ``t % D`` of position group ``t / D``, so a warp reads contiguous
V rows.  The ``PG`` group accumulators are summed through shared memory at the end.
With a ``window`` (``signatures.attention_options``, as ``softcap`` and ``scale``) the walk
starts at the window's first position, so nothing before it is read.

RoPE + KV write: one block per head (q | k | v heads of the qkv row), one thread per rotated
pair (d, d + D/2); prefill adds the token as a second grid dimension.

Buffers (D = head_dim, n symbolic for prefill or 1 for decode):
  attention: q (n, Hq D) float32, k_pool / v_pool (num_blocks, Hkv, block_size, D) cache dtype,
             block_table (1, max_blocks_cap) int32, context_len | start_pos int64
             -> out (n, Hq D) float32
  rope_kv:   qkv (n, (Hq + 2 Hkv) D) float32, k_pool, v_pool (written in place),
             inv_freq (D/2,) float32, block_table, write_off + context_len | start_pos
             -> q_rot (n, Hq D) float32
Batched decode (``*_batch``): B rows, one more grid dimension; tables (B, max_blocks_cap),
context_lens / write_offs (B,) int64 device data, so their checks are guards as below.
Scalar bounds (context_len, write_off, start_pos) are asserted on the host before the launch.
The ``*_decode_dev`` variants take context_len / write_off as (1,) int64 device buffers (for
CUDA-graph replay); there the bounds are guards: out of range writes nothing, and attention
clamps the context to max_blocks_cap * block_size.
Block-table entries are device data: an entry outside [0, num_blocks) is skipped (its positions
get no attention weight, its K/V is not written) instead of raising; a decode ``write_off`` that
does not match the table at ``context_len - 1`` writes nothing.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..common import cached, dtype_tag, token_dim
from ..signatures import attention_batch_func, attention_options, rope_kv_batch_func
from .common import block_reduce, finalize

NEG = -3.0e38  # the score of a masked position; exp(NEG - max) is 0


def _attend_macro(Hq, Hkv, D, bs, nb, window=0, softcap=0.0, scale=0.0):
    """``window``, ``softcap``, ``scale`` as ``signatures.attention_options`` resolves them."""
    G, scale = Hq // Hkv, scale or 1.0 / math.sqrt(D)
    PG = max(1, 128 // D)
    NT = D * PG
    block_max = block_reduce(NT, "max", "score_max")
    block_sum = block_reduce(NT, "sum", "prob_sum")

    def at(ctx, i):  # the position of the ``i``-th one walked: from the window's first, which
        # need not start a block (positions are looked up one by one), so nothing is masked
        return T.max(ctx - window, T.int64(0)) + i if window else i

    def v_at(ctx, c, j, tx):  # the position whose V row thread ``tx`` reads at step ``j``
        return at(ctx, c * NT + j * PG + tx // D)

    def walked(ctx):  # how many positions are walked
        return ctx - T.max(ctx - window, T.int64(0)) if window else ctx

    def capped(x):  # a scaled score, soft-capped where the model caps them
        return T.float32(softcap) * T.tanh(x / T.float32(softcap)) if softcap else x

    @T.macro
    def attend(q, k_pool, v_pool, bt, out, row, h, ctx, qs, ps, accs, mx, sm, st, trow=0):
        """out[row, h] = softmax(q k^T * scale) V over positions [0, ctx) (the last ``window``
        of them) of table row ``trow`` (0 when ``ctx`` is 0: no position, no weight).

        st (local): running max, running sum, rescale, this thread's score, its accumulator."""
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if tx < D:
                qs[tx] = q[row, h * D + tx]
            st[0] = T.float32(NEG)
            st[1] = T.float32(0)
            st[4] = T.float32(0)
        for c in range((walked(ctx) + NT - 1) // NT):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                st[3] = T.float32(NEG)
                if at(ctx, c * NT + tx) < ctx:
                    if 0 <= bt[trow, at(ctx, c * NT + tx) // bs] and T.Cast(
                            "int64", bt[trow, at(ctx, c * NT + tx) // bs]) < nb:
                        st[3] = T.float32(0)
                        for d in range(D):
                            st[3] = st[3] + qs[d] * T.Cast("float32", k_pool[
                                T.Cast("int64", bt[trow, at(ctx, c * NT + tx) // bs]), h // G,
                                at(ctx, c * NT + tx) % bs, d])
                        st[3] = capped(st[3] * T.float32(scale))
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                block_max(tx, st, 3, mx, 0)
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                st[2] = T.exp(st[0] - T.max(st[0], mx[0]))
                st[0] = T.max(st[0], mx[0])
                st[3] = T.exp(st[3] - st[0])
                ps[tx] = st[3]
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                block_sum(tx, st, 3, sm, 0)
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                st[1] = st[1] * st[2] + sm[0]
                st[4] = st[4] * st[2]
                for j in range(NT // PG):
                    if v_at(ctx, c, j, tx) < ctx:
                        if 0 <= bt[trow, v_at(ctx, c, j, tx) // bs] and T.Cast(
                                "int64", bt[trow, v_at(ctx, c, j, tx) // bs]) < nb:
                            st[4] = st[4] + ps[j * PG + tx // D] * T.Cast("float32", v_pool[
                                T.Cast("int64", bt[trow, v_at(ctx, c, j, tx) // bs]),
                                h // G, v_at(ctx, c, j, tx) % bs, tx % D])
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            accs[tx] = st[4]
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            if tx < D:
                st[4] = T.float32(0)
                for p in range(PG):
                    st[4] = st[4] + accs[p * D + tx]
                out[row, h * D + tx] = T.if_then_else(st[1] > 0, st[4] / st[1], T.float32(0))

    return attend, NT


def _attention_grid(Hq, Hkv, D, bs, cap, nb, kind: str, opts=()):
    """``grid(q, k_pool, v_pool, bt, out, rows, ctx)``: the shared scratch, then one block per
    (row, query head), row i on ``blockIdx.y``.  ``kind`` says what ``ctx`` is: "decode" the
    context length (an int64 expression; one row), "prefill" the start position (row i
    attends over ``ctx + i + 1`` positions), "batch" the (B,) context lengths (row i over
    ``ctx[i]`` clamped to [0, max_blocks_cap * block_size], through table row i).  ``opts``:
    (window, softcap, scale) as ``signatures.attention_options`` resolves them."""
    attend, NT = _attend_macro(Hq, Hkv, D, bs, nb, *opts)

    @T.macro
    def grid(q, k_pool, v_pool, bt, out, rows, ctx):
        qs = T.sblock_alloc_buffer((D,), "float32", scope="shared")
        ps = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
        accs = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
        mx = T.sblock_alloc_buffer((1,), "float32", scope="shared")
        sm = T.sblock_alloc_buffer((1,), "float32", scope="shared")
        st = T.sblock_alloc_buffer((5,), "float32", scope="local")
        for i in T.thread_binding(rows, thread="blockIdx.y"):
            for h in T.thread_binding(Hq, thread="blockIdx.x"):
                if kind == "decode":
                    attend(q, k_pool, v_pool, bt, out, i, h, ctx, qs, ps, accs, mx, sm, st)
                elif kind == "prefill":
                    attend(q, k_pool, v_pool, bt, out, i, h, ctx + i + 1, qs, ps, accs, mx,
                           sm, st)
                else:
                    attend(q, k_pool, v_pool, bt, out, i, h,
                           T.max(T.min(ctx[i], T.int64(cap * bs)), T.int64(0)), qs, ps, accs,
                           mx, sm, st, i)

    return grid


@cached
def paged_attention_decode(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, *,
                           window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """One query token per head against context_len cached positions (the last ``window`` of
    them; ``softcap``, ``scale``: ``signatures.attention_options``)."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    grid = _attention_grid(Hq, Hkv, D, bs, cap, nb, "decode", opts)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.int64,
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            assert 1 <= context_len and context_len <= cap * bs, "context_len outside [1, max_blocks_cap * block_size]"
            grid(q, k_pool, v_pool, bt, out, 1, context_len)

    return finalize(func, f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")


@cached
def paged_attention_decode_dev(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str,
                               *, window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """``paged_attention_decode`` with ``context_len`` in a (1,) int64 device buffer.  The
    host cannot assert on device data, so the range check becomes a guard: the context is
    clamped to ``max_blocks_cap * block_size`` (no read past the table) and a context below 1
    attends nothing (the output is 0)."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    grid = _attention_grid(Hq, Hkv, D, bs, cap, nb, "decode", opts)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((1, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((1, cap), "int32"), context_len: T.Buffer((1,), "int64"),
             out: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            grid(q, k_pool, v_pool, bt, out, 1,
                 T.max(T.min(context_len[0], T.int64(cap * bs)), T.int64(0)))

    return finalize(func,
                    f"attn_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}_dev")


@cached
def paged_attention_prefill(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, *,
                            window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """n query tokens (positions start_pos + i), causal over the cached prefix and themselves;
    row i over its own window, the last ``window`` positions up to start_pos + i."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    grid = _attention_grid(Hq, Hkv, D, bs, cap, nb, "prefill", opts)
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
            grid(q, k_pool, v_pool, bt, out, n, start_pos)

    return finalize(func, f"attn_pre_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")


def _rope_macro(Hq, Hkv, D, cdt):
    half = D // 2

    @T.macro
    def rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, i, pos, blk, slot, ok, hd, d):
        """Head hd of token i: q heads rotate into q_rot, k heads rotate into the pool, v heads
        copy; thread d handles the pair (d, d + half).  ``ok`` gates the pool writes."""
        c = T.cos(T.Cast("float32", pos) * inv_freq[d])
        s = T.sin(T.Cast("float32", pos) * inv_freq[d])
        x0 = qkv[i, hd * D + d]
        x1 = qkv[i, hd * D + d + half]
        if hd < Hq:
            q_rot[i, hd * D + d] = x0 * c - x1 * s
            q_rot[i, hd * D + d + half] = x1 * c + x0 * s
        elif hd < Hq + Hkv:
            if ok:
                k_pool[blk, hd - Hq, slot, d] = T.Cast(cdt, x0 * c - x1 * s)
                k_pool[blk, hd - Hq, slot, d + half] = T.Cast(cdt, x1 * c + x0 * s)
        elif ok:
            v_pool[blk, hd - Hq - Hkv, slot, d] = T.Cast(cdt, x0)
            v_pool[blk, hd - Hq - Hkv, slot, d + half] = T.Cast(cdt, x1)

    return rope_write


def _decode_rope_body(Hq, Hkv, D, bs, cdt):
    """Decode RoPE + KV write, shared by the scalar and the device-tensor variants; ``ok``
    (computed by the caller) gates the pool writes."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)
    H = Hq + 2 * Hkv

    @T.macro
    def body(qkv, k_pool, v_pool, inv_freq, q_rot, write_off, context_len, ok):
        for hd in T.thread_binding(H, thread="blockIdx.x"):
            for d in T.thread_binding(D // 2, thread="threadIdx.x"):
                rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, 0, context_len - 1,
                           write_off // bs, write_off % bs, ok, hd, d)

    return body


@cached
def rope_kv_write_decode(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """Decode variant: one token at the flattened offset ``write_off``."""
    QKV, bs = (Hq + 2 * Hkv) * D, block_size
    nb = tirx.Var("num_blocks", "int64")
    body = _decode_rope_body(Hq, Hkv, D, bs, cdt)

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((1, QKV), "float32"), var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((1, cap), "int32"),
             write_off: T.int64, context_len: T.int64, q_rot: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            assert 1 <= context_len and context_len <= cap * bs, "context_len outside [1, max_blocks_cap * block_size]"
            assert 0 <= write_off and write_off < nb * bs, "write_off outside the pool"
            body(qkv, k_pool, v_pool, inv_freq, q_rot, write_off, context_len,
                 T.Cast("int64", bt[0, (context_len - 1) // bs]) * bs
                 + (context_len - 1) % bs == write_off)

    return finalize(func, f"rope_kv_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


def _device_write_ok(bt, row, ctx, off, cap: int, bs: int, nb):
    """The write guard of a decode token whose ``ctx`` and ``off`` are device data (no host
    assert can check them): ``ctx`` in [1, max_blocks_cap * block_size], ``off`` inside the pool
    and equal to table row ``row``'s slot for position ``ctx - 1`` (the table index clamped
    into [0, max_blocks_cap), so a bad ``ctx`` reads no further)."""
    slot = T.Cast("int64", bt[row, T.max(T.min((ctx - 1) // bs, T.int64(cap - 1)),
                                         T.int64(0))]) * bs + (ctx - 1) % bs
    return tirx.all(1 <= ctx, ctx <= cap * bs, 0 <= off, off < nb * bs, slot == off)


@cached
def rope_kv_write_decode_dev(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """``rope_kv_write_decode`` with ``write_off`` and ``context_len`` in (1,) int64 device
    buffers.  The host cannot assert on device data, so both range checks join the table
    match in the write guard: an out-of-range or inconsistent call writes nothing (q_rot is
    still produced); the table row read is clamped into [0, max_blocks_cap)."""
    QKV, bs = (Hq + 2 * Hkv) * D, block_size
    nb = tirx.Var("num_blocks", "int64")
    body = _decode_rope_body(Hq, Hkv, D, bs, cdt)

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((1, QKV), "float32"), var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((1, cap), "int32"),
             write_off: T.Buffer((1,), "int64"), context_len: T.Buffer((1,), "int64"),
             q_rot: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(qkv, k_pool, v_pool, inv_freq, q_rot, write_off[0], context_len[0],
                 _device_write_ok(bt, 0, context_len[0], write_off[0], cap, bs, nb))

    return finalize(func, f"rope_kv_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}_dev")


@cached
def rope_kv_write_prefill(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """Prefill variant: n tokens at positions start_pos + i, placed through the block table."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)
    QKV, bs, H = (Hq + 2 * Hkv) * D, block_size, Hq + 2 * Hkv
    nb = tirx.Var("num_blocks", "int64")
    n = token_dim(None)

    @T.prim_func(s_tir=True)
    def func(var_qkv: T.handle, var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((1, cap), "int32"),
             start_pos: T.int64, var_q: T.handle):
        qkv = T.match_buffer(var_qkv, (n, QKV), "float32")
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        q_rot = T.match_buffer(var_q, (n, Hq * D), "float32")
        with T.sblock("root"):
            assert 0 <= start_pos and start_pos + n <= cap * bs, "prompt past max_blocks_cap * block_size"
            for i in T.thread_binding(n, thread="blockIdx.y"):
                for hd in T.thread_binding(H, thread="blockIdx.x"):
                    for d in T.thread_binding(D // 2, thread="threadIdx.x"):
                        rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, i, start_pos + i,
                                   T.Cast("int64", bt[0, (start_pos + i) // bs]),
                                   (start_pos + i) % bs,
                                   0 <= bt[0, (start_pos + i) // bs]
                                   and T.Cast("int64", bt[0, (start_pos + i) // bs]) < nb, hd, d)

    return finalize(func, f"rope_kv_pre_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


@cached
def rope_kv_write_batch(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, B: int):
    """Ragged batched decode (the CPU kernel's signature, ``kernels/cpu/batch.py``): row ``r`` at
    position ``context_lens[r] - 1`` written at ``write_offs[r]``, one block per (row, head).
    The lengths and offsets are device data, so the range checks are guards, as in the
    ``_dev`` variant: a row whose context is outside [1, max_blocks_cap * block_size], whose
    offset is outside the pool or does not match its table at ``context_len - 1`` writes
    nothing (context 0: a padding row)."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)
    bs, H = block_size, Hq + 2 * Hkv
    nb = tirx.Var("num_blocks", "int64")

    @T.macro
    def body(qkv, k_pool, v_pool, inv_freq, bt, write_offs, context_lens, q_rot):
        for r in T.thread_binding(B, thread="blockIdx.y"):
            for hd in T.thread_binding(H, thread="blockIdx.x"):
                for d in T.thread_binding(D // 2, thread="threadIdx.x"):
                    rope_write(
                        qkv, k_pool, v_pool, inv_freq, q_rot, r,
                        T.max(context_lens[r] - 1, T.int64(0)),
                        write_offs[r] // bs, write_offs[r] % bs,
                        _device_write_ok(bt, r, context_lens[r], write_offs[r], cap, bs, nb),
                        hd, d)

    func = rope_kv_batch_func(body, Hq, Hkv, D, bs, cap, cdt, B, nb)
    return finalize(func, f"rope_kv_bat{B}_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


@cached
def paged_attention_batch(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str,
                          B: int, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """Row ``r``'s query against its ``context_lens[r]`` cached positions (the last ``window``
    of them) through its own table row, one block per (row, query head); the context is
    clamped to [0, max_blocks_cap * block_size] (device data: a guard), and a padding row
    (context 0) gets zeros."""
    bs, nb = block_size, tirx.Var("num_blocks", "int64")
    *opts, tag = attention_options(D, cap * bs, window, softcap, scale)
    grid = _attention_grid(Hq, Hkv, D, bs, cap, nb, "batch", opts)

    @T.macro
    def body(q, k_pool, v_pool, bt, context_lens, out):
        grid(q, k_pool, v_pool, bt, out, B, context_lens)

    func = attention_batch_func(body, Hq, Hkv, D, bs, cap, cdt, B, nb)

    return finalize(func, f"attn_bat{B}_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")
