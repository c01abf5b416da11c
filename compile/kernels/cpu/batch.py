"""Ragged batched decode: one new token for each of ``B`` sequences, each with its own block
table, context length and write offset.

Buffers (B static, D = head_dim, QKV = (Hq + 2 Hkv) D):
  rope_kv_write_batch:
    qkv (B, QKV) float32, k_pool / v_pool (num_blocks, Hkv, block_size, D) written in place,
    inv_freq (D/2,) float32, block_tables (B, max_blocks_cap) int32,
    write_offs (B,) int64, context_lens (B,) int64  ->  q_rot (B, Hq D) float32
  paged_attention_batch:
    q (B, Hq D) float32, k_pool, v_pool, block_tables (B, cap) int32, context_lens (B,) int64
    ->  out (B, Hq D) float32
A row whose ``context_len`` is 0 is padding: it writes nothing to the pool and its outputs are
zeros.  Every live row's indices are checked before the first write, as in the B = 1 kernels.
The linear layers of a batched step are the prefill matmuls (rows are independent there), or,
in buckets of at most ``SMALL_ROWS`` rows over float weights, the small-batch GEMVs below.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...formats import FORMATS
from ...params import GATE_UP_ROWS
from ..common import EPILOGUES, cached, dtype_tag, finalize, gate_up_rows
from ..signatures import (attention_batch_func, attention_options, matmul_func,
                          rope_kv_batch_func)
from .attention import MAX_PARTS, DecodeSplit, _attend_macro, first_block
from .fastmath import silu_mul
from .gemv import PREFETCH_BYTES, STEP
from .float_dot import dot_macro
from .rope_kv import _rope_macro
from .simd import (NTA, VL, lane_slice, prefetch_ahead_macro, scratch_buffer,
                   transpose_sums)


def _row_table(bt, r, cap: int):
    """Row ``r`` of the ``(B, cap)`` block tables as a ``(1, cap)`` view (what the B = 1
    macros index as ``bt[0, b]``)."""
    return T.decl_buffer((1, cap), "int32", data=bt.data, elem_offset=r * cap)


def _check_rows(B: int, bs: int, cap: int, nb, window: int = 0):
    """Each row's context length and the table entries it reads (those of its last ``window``
    positions, 0: all)."""
    @T.macro
    def check(bt, context_lens):
        for r in range(B):
            assert 0 <= context_lens[r] and context_lens[r] <= cap * bs, "context_len outside [0, max_blocks_cap * block_size]"
            for b in range(first_block(context_lens[r], window, bs),
                           (context_lens[r] + bs - 1) // bs):
                assert 0 <= bt[r, b] and T.Cast("int64", bt[r, b]) < nb, "block table entry outside the pool"

    return check


@cached
def rope_kv_write_batch(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str, B: int):
    """RoPE and the K/V write of ``B`` rows, row ``r`` at position ``context_lens[r] - 1``."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)
    bs = block_size
    nb = tirx.Var("num_blocks", "int64")
    check = _check_rows(B, bs, cap, nb)

    @T.macro
    def body(qkv, k_pool, v_pool, inv_freq, bt, write_offs, context_lens, q_rot):
        check(bt, context_lens)
        for r in range(B):
            if context_lens[r] > 0:
                assert T.Cast("int64", bt[r, (context_lens[r] - 1) // bs]) * bs + (context_lens[r] - 1) % bs == write_offs[r], "write_off does not match the block table at context_len - 1"
        for r in T.parallel(B):
            if context_lens[r] > 0:
                rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, r, context_lens[r] - 1,
                           write_offs[r] // bs, write_offs[r] % bs)
            else:
                for c in T.vectorized(Hq * D):
                    q_rot[r, c] = T.float32(0)

    func = rope_kv_batch_func(body, Hq, Hkv, D, bs, cap, cdt, B, nb)
    return finalize(func, f"rope_kv_bat{B}_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


# Batched attention splits each row's kv heads into slices so a step has at least this many
# parallel tasks (rows x slices), for machines with more cores than a small bucket has rows.
MIN_ATTN_TASKS = 16


@cached
def paged_attention_batch(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str,
                          B: int, *, window: int = 0, softcap: float = 0.0, scale: float = 0.0):
    """Row ``r``'s query against its ``context_lens[r]`` cached positions through its own
    table (the last ``window`` of them; ``softcap``, ``scale``: ``attention_options``).  A task
    is a row and a slice of its kv heads.  Its blocks are cut into the parts the B = 1 decode
    kernel cuts the same context into (``attention.DecodeSplit``), taken one after the other
    in table order, and the parts' softmax states merged as there (one part: finished as the
    serial walk finishes), so a row's output is bit-identical to the B = 1 step's whatever the
    other rows hold (batch invariance).  Within a part it walks the blocks and, in each block,
    its heads in turn (each head's online-softmax state kept apart), so it reads each block's
    K and V runs front to back, one stream the hardware prefetcher follows (docs/design.md)."""
    bs, nb, G = block_size, tirx.Var("num_blocks", "int64"), Hq // Hkv
    window, softcap, scale, tag = attention_options(D, cap * bs, window, softcap, scale)
    init, step, _, shapes = _attend_macro(Hq, Hkv, D, bs, cap, cdt, window, softcap, scale)
    acc_shape, st_shape, r_shape, s_shape = shapes
    sp = DecodeSplit(Hq, Hkv, D, bs, window)
    check = _check_rows(B, bs, cap, nb, window)
    S = min(Hkv, -(-MIN_ATTN_TASKS // B))  # kv-head slices per row

    def h0(sl):  # first kv head of slice ``sl``
        return sl * Hkv // S

    @T.macro
    def keep(acc, st, acc_p, st_p, p, sl):  # part p's state of the slice's heads
        for kvh in range(h0(sl), h0(sl + 1)):
            for g in range(G):
                for d in T.vectorized(D):
                    acc_p[p, kvh, g, d] = acc[kvh, g, d]
                for i in range(st_shape[0]):
                    st_p[p, kvh, i, g] = st[kvh, i, g]

    @T.macro
    def walk(q, k_pool, v_pool, bt, r, sl, ctx, acc, st, acc_p, st_p, rs, scores):
        """The slice's heads' running state of row ``r`` in ``acc`` / ``st`` over its blocks in
        table order; in a split context each part's state is kept in ``acc_p`` / ``st_p`` at
        the part's last block and the walk starts afresh (one block loop: a loop over the parts
        around it made the kernel 1.5x slower, the split rows and the others alike)."""
        pc = T.decl_buffer((1,), "int64")  # the part being walked
        pc[0] = T.int64(0)
        for kvh in range(h0(sl), h0(sl + 1)):
            init(lane_slice(acc, kvh, acc_shape), lane_slice(st, kvh, st_shape))
        for b in range(first_block(ctx, window, bs), (ctx + bs - 1) // bs):
            for kvh in range(h0(sl), h0(sl + 1)):
                step(q, k_pool, v_pool, _row_table(bt, r, cap), r, kvh, b, ctx,
                     lane_slice(acc, kvh, acc_shape), lane_slice(st, kvh, st_shape), rs, scores)
            if sp.split(ctx):
                if b + 1 == sp.part_start(pc[0] + 1, sp.parts(ctx), ctx):
                    keep(acc, st, acc_p, st_p, pc[0], sl)
                    for kvh in range(h0(sl), h0(sl + 1)):
                        init(lane_slice(acc, kvh, acc_shape), lane_slice(st, kvh, st_shape))
                    pc[0] = pc[0] + 1

    @T.macro
    def body(q, k_pool, v_pool, bt, context_lens, out):
        check(bt, context_lens)
        acc_ps = T.decl_buffer((B * S, MAX_PARTS, Hkv) + acc_shape, "float32")  # parts' states
        st_ps = T.decl_buffer((B * S, MAX_PARTS, Hkv) + st_shape, "float32")
        for task in T.parallel(B * S):  # (row, slice of kv heads)
            acc_p = lane_slice(acc_ps, task, (MAX_PARTS, Hkv) + acc_shape)
            st_p = lane_slice(st_ps, task, (MAX_PARTS, Hkv) + st_shape)
            if context_lens[task // S] > 0:
                acc = scratch_buffer((Hkv,) + acc_shape)  # the part's running state
                st = scratch_buffer((Hkv,) + st_shape)
                rs = scratch_buffer(r_shape)
                scores = scratch_buffer(s_shape)
                walk(q, k_pool, v_pool, bt, task // S, task % S, context_lens[task // S], acc,
                     st, acc_p, st_p, rs, scores)
                if sp.split(context_lens[task // S]):
                    sp.merge(out, task // S, acc_p, st_p, sp.parts(context_lens[task // S]),
                             h0(task % S), h0(task % S + 1))
                else:  # one part: the B = 1 kernel's serial walk's finish
                    for kvh in range(h0(task % S), h0(task % S + 1)):
                        for g in range(G):
                            for d in T.vectorized(D):
                                out[task // S, (kvh * G + g) * D + d] = (
                                    acc[kvh, g, d] / st[kvh, 1, g])
            else:
                for kvh in range(h0(task % S), h0(task % S + 1)):
                    for c in T.vectorized(G * D):
                        out[task // S, kvh * G * D + c] = T.float32(0)

    func = attention_batch_func(body, Hq, Hkv, D, bs, cap, cdt, B, nb)
    return finalize(func, f"attn_bat{B}_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}{tag}")


# -- small-batch GEMVs ---------------------------------------------------------------------------
# A batched step of at most SMALL_ROWS rows is a weight stream, like a B = 1 step: these kernels
# read each weight row once, front to back with the GEMVs' software prefetch, and sum it against
# every row of x in ``float_dot``'s order, the B = 1 GEMV's (batch invariance): one accumulator
# of 16 lanes per row of x, in registers with the operands, ``_pass_rows`` rows a pass.
SMALL_ROWS = 8
# ... while the B rows of x fit in a 32 KiB L1D: each weight row sweeps all of them, from L2
# past that, where the matmul (which reuses a weight tile across token tiles) is faster
SMALL_ROWS_X_BYTES = 32 << 10
ROWS_PER_TASK = 16  # weight rows per parallel task (a contiguous run of the matrix)


def _pass_rows(B: int) -> int:
    """Rows of x one pass over a weight row sums against: all 8 of a full bucket, else 2 (on
    SmolLM2's float16 LM head a 4-row pass ran 0.73x the 4-row kernel it replaced, two 2-row
    passes 1.17x; 8 rows in one pass 1.00x, in four 0.95x)."""
    return B if B >= SMALL_ROWS else min(B, 2)


def _rows_dot_macro(K: int, wdt: str, B: int, locality: int):
    """``dot(x, W, c, out, o)``: out[o, r] = x[r] . W[c] for the B rows (float32), W's row
    prefetched ahead with hint ``locality`` (the decode GEMV's, ``cpu.prefetch_locality``);
    ``_pass_rows`` rows of x a pass over the row (the first streams it from memory, the others
    re-read it from L1)."""
    fmt = FORMATS[wdt]
    step_prefetch = prefetch_ahead_macro(STEP * VL, fmt.element_dtype, PREFETCH_BYTES[wdt],
                                         locality)
    P = 1 << (B - 1).bit_length()  # B sums padded to a power of two
    RG = _pass_rows(B)
    groups = [(g0, min(RG, B - g0)) for g0 in range(0, B, RG)]
    assert len(groups) <= 4

    @T.macro
    def prefetch(W, c, k):
        flat = T.decl_buffer((W.shape[0] * K,), W.dtype, data=W.data)
        step_prefetch(flat, c * K + k)

    passes = [dot_macro(K, wdt, n, 1, STEP, prefetch=prefetch if g0 == 0 else None)
              for g0, n in groups]

    def sums(acc):  # the B sums in lanes 0..B-1 (zero vectors pad the list to P)
        zero = T.broadcast(T.float32(0), VL)
        return transpose_sums([acc[r, 0, T.ramp(0, 1, VL)] if r < B else zero
                               for r in range(P)], VL)

    def group_view(acc, g0):
        return T.decl_buffer((B - g0, 1, VL), "float32", data=acc.data, elem_offset=g0 * VL)

    @T.macro
    def dot(x, W8, c, out, o):
        acc = T.decl_buffer((B, 1, VL), "float32")
        passes[0](x, fmt.elements(W8), group_view(acc, 0), 0, c)
        if len(groups) > 1:
            passes[1](x, fmt.elements(W8), group_view(acc, groups[1][0]), groups[1][0], c)
        if len(groups) > 2:
            passes[2](x, fmt.elements(W8), group_view(acc, groups[2][0]), groups[2][0], c)
        if len(groups) > 3:
            passes[3](x, fmt.elements(W8), group_view(acc, groups[3][0]), groups[3][0], c)
        acc[0, 0, T.ramp(0, 1, P) if P > 1 else 0] = sums(acc)
        for r in range(B):
            out[o, r] = acc[0, 0, r]

    return dot


def _task_rows(N: int, B: int, wdt: str, K: int, locality: int):
    """``rows(x, W, w0, a0, out, finish, *args)``: out[i, :] = the B dot products of weight row
    ``w0 + i`` for the ``ROWS_PER_TASK`` outputs ``a0 + i`` below N, then ``finish(out, i,
    *args)`` for each."""
    dot = _rows_dot_macro(K, wdt, B, locality)

    @T.macro
    def rows(x, W, w0, a0, out, finish, *args):
        for i in range(ROWS_PER_TASK):
            if a0 + i < N:
                dot(x, W, w0 + i, out, i)
                finish(out, i, *args)

    return rows


@cached
def gemv_rows(N: int, K: int, wdt: str, epilogue: str, B: int, locality: int = NTA):
    """y = x @ W.T (+ bias | + res) for B rows (B <= ``SMALL_ROWS``), each weight row read once."""
    assert epilogue in EPILOGUES and B <= SMALL_ROWS
    rows = _task_rows(N, B, wdt, K, locality)
    tasks = -(-N // ROWS_PER_TASK)

    @T.macro
    def store(out, i, y, bias, res, row0):
        for r in range(B):
            if epilogue == "bias":
                y[r, row0 + i] = out[i, r] + bias[row0 + i]
            elif epilogue == "residual":
                y[r, row0 + i] = out[i, r] + res[r, row0 + i]
            else:
                y[r, row0 + i] = out[i, r]

    @T.macro
    def body(x, W, y, bias, res, n):
        for task in T.parallel(tasks):
            out = T.decl_buffer((ROWS_PER_TASK, B), "float32")
            rows(x, W, task * ROWS_PER_TASK, task * ROWS_PER_TASK, out, store, y, bias, res,
                 task * ROWS_PER_TASK)

    w_shape, w_dtype = FORMATS[wdt].storage(N, K)
    func = matmul_func(body, N, K, w_dtype, epilogue, B, w_shape)
    return finalize(func, f"gemv_rows{B}_{epilogue}_{N}x{K}_{dtype_tag(wdt)}")


@cached
def gemv_rows_swiglu(I: int, K: int, wdt: str, B: int, locality: int = NTA):
    """act = silu(x @ Wg.T) * (x @ Wu.T) for B rows, W (2I, K) with gate and up rows in
    alternating runs (``params.gate_up_row``), each row read once.  A task is one run: its gate
    rows, then its up rows, W in memory order (as the quantized SwiGLU GEMV's, docs/design.md)."""
    assert B <= SMALL_ROWS and ROWS_PER_TASK == GATE_UP_ROWS
    rows = _task_rows(I, B, wdt, K, locality)
    gate_row, up_row = gate_up_rows(I)
    tasks = -(-I // ROWS_PER_TASK)
    w_shape, w_dtype = FORMATS[wdt].storage(2 * I, K)

    @T.macro
    def keep(out, i):  # the gate rows stay in ``gate`` until the up rows come
        T.evaluate(0)

    @T.macro
    def store(up, i, gate, act, a0):
        for r in range(B):
            act[r, a0 + i] = silu_mul(gate[i, r], up[i, r])

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((B, K), "float32"), W: T.Buffer(w_shape, w_dtype),
             act: T.Buffer((B, I), "float32")):
        with T.sblock("root"):
            for task in T.parallel(tasks):
                gate = T.decl_buffer((ROWS_PER_TASK, B), "float32")
                up = T.decl_buffer((ROWS_PER_TASK, B), "float32")
                rows(x, W, gate_row(task * ROWS_PER_TASK), task * ROWS_PER_TASK, gate, keep)
                rows(x, W, up_row(task * ROWS_PER_TASK), task * ROWS_PER_TASK, up, store, gate,
                     act, task * ROWS_PER_TASK)

    return finalize(func, f"gemv_rows{B}_swiglu_{I}x{K}_{dtype_tag(wdt)}")
