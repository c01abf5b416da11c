"""GPU embedding lookup and RMSNorm (thread-bound; one block per token / row)."""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from ..common import cached, dtype_tag, token_dim
from .common import block_reduce, block_threads, finalize, weight_at


@cached
def embedding(V: int, H: int, wdt: str, n_static: int | None = None):
    """x[i] = table[ids[i]]: one block per token; an id outside [0, V) gives a zero row."""
    n = token_dim(n_static)
    NT = block_threads(H)
    HO = -(-H // NT)
    t_shape, t_dtype = FORMATS[wdt].storage(V, H)

    @T.prim_func(s_tir=True)
    def func(var_ids: T.handle, table: T.Buffer(t_shape, t_dtype), var_x: T.handle):
        ids = T.match_buffer(var_ids, (n,), "int32")
        x = T.match_buffer(var_x, (n, H), "float32")
        with T.sblock("root"):
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            if 0 <= ids[i] and ids[i] < V:
                                x[i, ho * NT + tx] = weight_at(
                                    wdt, table, T.Cast("int64", ids[i]), ho * NT + tx)
                            else:
                                x[i, ho * NT + tx] = T.float32(0)

    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"embedding_{tag}_{V}x{H}_{dtype_tag(wdt)}")


def row_sum_sq_macro(H: int, NT: int):
    """A macro ``(x, row, part, tot)`` leaving the sum of ``x[row]^2`` in ``tot[0]`` (shared):
    each of the block's ``NT`` threads sums its strided columns into ``part`` (local), then
    the block reduces them; the norm kernels' common part."""
    HO = -(-H // NT)
    sum_sq = block_reduce(NT, "sum", "sum_sq")

    @T.macro
    def row_sum_sq(x, row, part, tot):
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            part[0] = T.float32(0)
            for ho in range(HO):
                if ho * NT + tx < H:
                    part[0] = part[0] + x[row, ho * NT + tx] * x[row, ho * NT + tx]
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            sum_sq(tx, part, 0, tot, 0)

    return row_sum_sq


@cached
def rmsnorm(H: int, eps: float, n_static: int | None = None, last_only: bool = False):
    """y = x * rsqrt(mean(x^2) + eps) * w: one block per output row, a block sum of squares."""
    n = token_dim(n_static)
    rows_out = 1 if last_only else n
    NT = block_threads(H)
    HO = -(-H // NT)
    row_sum_sq = row_sum_sq_macro(H, NT)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, w: T.Buffer((H,), "float32"), var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        y = T.match_buffer(var_y, (rows_out, H), "float32")
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            tot = T.sblock_alloc_buffer((1,), "float32", scope="shared")
            for i in T.thread_binding(rows_out, thread="blockIdx.x"):
                row_sum_sq(x, n - 1 if last_only else i, part, tot)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            y[i, ho * NT + tx] = x[n - 1 if last_only else i, ho * NT + tx] * (
                                T.rsqrt(tot[0] / T.float32(H) + T.float32(eps)) * w[ho * NT + tx])

    suffix = "_last" if last_only else ""
    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"rmsnorm{suffix}_{tag}_{H}")
