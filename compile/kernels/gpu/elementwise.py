"""GPU versions of ``cpu/elementwise.py`` (same signatures and buffers): one block per row,
its threads striding over the columns."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from ...params import GATE_UP_ROWS
from ..common import cached, const_tag, token_dim
from .common import block_threads, finalize
from .norm import row_sum_sq_macro

_GELU_C = math.sqrt(2.0 / math.pi)


def _tag(n_static) -> str:
    return "dec" if n_static == 1 else "pre"


def _gelu_tanh(x):
    inner = T.float32(_GELU_C) * (x + T.float32(0.044715) * x * x * x)
    return T.float32(0.5) * x * (T.float32(1.0) + T.tanh(inner))


@cached
def scale(H: int, s: float, n_static: int | None = None):
    n = token_dim(n_static)
    NT = block_threads(H)
    HO = -(-H // NT)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        y = T.match_buffer(var_y, (n, H), "float32")
        with T.sblock("root"):
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            y[i, ho * NT + tx] = x[i, ho * NT + tx] * T.float32(s)

    return finalize(func, f"scale_{_tag(n_static)}_{H}_{const_tag(s)}")


@cached
def softcap(N: int, c: float, n_static: int | None = None):
    n = token_dim(n_static)
    NT = block_threads(N)
    NO = -(-N // NT)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, N), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        with T.sblock("root"):
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for jo in range(NO):
                        if jo * NT + tx < N:
                            y[i, jo * NT + tx] = T.tanh(
                                x[i, jo * NT + tx] * T.float32(1.0 / c)) * T.float32(c)

    return finalize(func, f"softcap_{_tag(n_static)}_{N}_{const_tag(c)}")


@cached
def gelu_tanh_gate(I: int, n_static: int | None = None):
    """act[i, c] = gelu_tanh(gate) * up from the gate / up runs (``params.gate_up_row``)."""
    n = token_dim(n_static)
    NT = block_threads(I)
    CO = -(-I // NT)
    G = GATE_UP_ROWS

    @T.prim_func(s_tir=True)
    def func(var_y: T.handle, var_act: T.handle):
        y = T.match_buffer(var_y, (n, 2 * I), "float32")
        act = T.match_buffer(var_act, (n, I), "float32")
        with T.sblock("root"):
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for co in range(CO):
                        if co * NT + tx < I:
                            act[i, co * NT + tx] = _gelu_tanh(
                                y[i, 2 * G * ((co * NT + tx) // G) + (co * NT + tx) % G]) * y[
                                i, 2 * G * ((co * NT + tx) // G) + (co * NT + tx) % G
                                + T.min(G, I - G * ((co * NT + tx) // G))]

    return finalize(func, f"gelu_tanh_gate_{_tag(n_static)}_{I}")


@cached
def rmsnorm_add(H: int, eps: float, n_static: int | None = None):
    """y = res + x * rsqrt(mean(x^2) + eps) * w: one block per row."""
    n = token_dim(n_static)
    NT = block_threads(H)
    HO = -(-H // NT)
    row_sum_sq = row_sum_sq_macro(H, NT)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, w: T.Buffer((H,), "float32"), var_res: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        res = T.match_buffer(var_res, (n, H), "float32")
        y = T.match_buffer(var_y, (n, H), "float32")
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            tot = T.sblock_alloc_buffer((1,), "float32", scope="shared")
            for i in T.thread_binding(n, thread="blockIdx.x"):
                row_sum_sq(x, i, part, tot)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            y[i, ho * NT + tx] = res[i, ho * NT + tx] + x[i, ho * NT + tx] * (
                                T.rsqrt(tot[0] / T.float32(H) + T.float32(eps)) * w[ho * NT + tx])

    return finalize(func, f"rmsnorm_add_{_tag(n_static)}_{H}")
