"""RoPE on q and k, fused with the in-place KV write into the paged pool.

Buffers (D = head_dim, QKV = (Hq + 2 Hkv) D, n symbolic for prefill or 1 for decode):
  qkv (n, QKV) float32 -- rows: q heads | k heads | v heads, straight from the qkv GEMV
  k_pool, v_pool (num_blocks, Hkv, block_size, D) cache dtype -- written in place
  inv_freq (D/2,) float32 -- RoPE frequencies (llama3 scaling already applied)
  block_table (1, max_blocks_cap) int32
  decode:  write_off, context_len int64 -- writes position context_len - 1 at the flattened
           offset write_off = physical_block * block_size + slot (checked against the table)
  decode_dev: the same two values as (1,) int64 buffers (``rope_kv_write_decode_dev``)
  prefill: start_pos int64 -- writes positions start_pos .. start_pos + n - 1 via the table
  -> q_rot (n, Hq D) float32
Every index is checked before the first write, so a bad call leaves the pool untouched.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..common import cached, dtype_tag, finalize, token_dim
from .simd import k_block_view, scratch_buffer


def _rope_macro(Hq, Hkv, D, cdt):
    half = D // 2

    # Plain functions, not TVMScript assignments: a scalar assigned in a kernel loop is lowered
    # to a heap workspace allocated and freed at every iteration on the CPU.
    def rotated(qkv, cs, i, col, d):
        """(first, second) half of head column ``col``'s pair ``d`` rotated by RoPE."""
        x0, x1 = qkv[i, col + d], qkv[i, col + d + half]
        return x0 * cs[0, d] - x1 * cs[1, d], x1 * cs[0, d] + x0 * cs[1, d]

    @T.macro
    def rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, i, pos, blk, slot):
        cs = scratch_buffer((2, half))  # cos, sin of each frequency
        for d in range(half):  # once per token, shared by every head (libm calls dominate)
            cs[0, d] = T.cos(T.Cast("float32", pos) * inv_freq[d])
            cs[1, d] = T.sin(T.Cast("float32", pos) * inv_freq[d])
        for h, d in T.grid(Hq, half):
            q_rot[i, h * D + d] = rotated(qkv, cs, i, h * D, d)[0]
            q_rot[i, h * D + d + half] = rotated(qkv, cs, i, h * D, d)[1]
        kt = k_block_view(k_pool, Hkv, D, k_pool.shape[2])  # K stored [dim, slot] per block
        for h, d in T.grid(Hkv, half):
            kt[blk, h, d, slot] = T.Cast(cdt, rotated(qkv, cs, i, (Hq + h) * D, d)[0])
            kt[blk, h, d + half, slot] = T.Cast(cdt, rotated(qkv, cs, i, (Hq + h) * D, d)[1])
        for h in range(Hkv):
            for d in T.vectorized(D):
                v_pool[blk, h, slot, d] = T.Cast(cdt, qkv[i, (Hq + Hkv + h) * D + d])

    return rope_write


def _decode_body(Hq, Hkv, D, bs, cap, cdt, nb):
    """The decode checks + write, shared by the scalar and the device-tensor variants:
    ``write_off`` / ``context_len`` are int64 expressions (a scalar param or ``buf[0]``)."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)

    @T.macro
    def body(qkv, k_pool, v_pool, inv_freq, bt, q_rot, write_off, context_len):
        assert 1 <= context_len and context_len <= cap * bs, "context_len outside [1, max_blocks_cap * block_size]"
        assert 0 <= write_off and write_off < nb * bs, "write_off outside the pool"
        for b in range((context_len + bs - 1) // bs):  # every entry attention will read
            assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
        assert T.Cast("int64", bt[0, (context_len - 1) // bs]) * bs + (context_len - 1) % bs == write_off, "write_off does not match the block table at context_len - 1"
        rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, 0, context_len - 1,
                   write_off // bs, write_off % bs)

    return body


@cached
def rope_kv_write_decode(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """Decode variant: one token at the flattened offset ``write_off``."""
    QKV, bs = (Hq + 2 * Hkv) * D, block_size
    nb = tirx.Var("num_blocks", "int64")
    body = _decode_body(Hq, Hkv, D, bs, cap, cdt, nb)

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((1, QKV), "float32"), var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((1, cap), "int32"),
             write_off: T.int64, context_len: T.int64, q_rot: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(qkv, k_pool, v_pool, inv_freq, bt, q_rot, write_off, context_len)

    return finalize(func, f"rope_kv_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")


@cached
def rope_kv_write_decode_dev(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """``rope_kv_write_decode`` with ``write_off`` and ``context_len`` read from (1,) int64
    buffers (device tensors: a CUDA graph replays them without re-recording scalars)."""
    QKV, bs = (Hq + 2 * Hkv) * D, block_size
    nb = tirx.Var("num_blocks", "int64")
    body = _decode_body(Hq, Hkv, D, bs, cap, cdt, nb)

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((1, QKV), "float32"), var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((1, cap), "int32"),
             write_off: T.Buffer((1,), "int64"), context_len: T.Buffer((1,), "int64"),
             q_rot: T.Buffer((1, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(qkv, k_pool, v_pool, inv_freq, bt, q_rot, write_off[0], context_len[0])

    return finalize(func, f"rope_kv_dec_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}_dev")


@cached
def rope_kv_write_prefill(Hq: int, Hkv: int, D: int, block_size: int, cap: int, cdt: str):
    """Prefill variant: n tokens at positions start_pos + i, placed through the block table."""
    rope_write = _rope_macro(Hq, Hkv, D, cdt)
    QKV, bs = (Hq + 2 * Hkv) * D, block_size
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
            for b in range(start_pos // bs, (start_pos + n + bs - 1) // bs):
                assert 0 <= bt[0, b] and T.Cast("int64", bt[0, b]) < nb, "block table entry outside the pool"
            for i in T.parallel(n):
                rope_write(qkv, k_pool, v_pool, inv_freq, q_rot, i, start_pos + i,
                           T.Cast("int64", bt[0, (start_pos + i) // bs]), (start_pos + i) % bs)

    return finalize(func, f"rope_kv_pre_q{Hq}kv{Hkv}d{D}_bs{bs}_cap{cap}_{dtype_tag(cdt)}")
