"""Row-wise elementwise kernels the layer features ask for (float32 activations).

Buffers (n symbolic for prefill and batched decode, 1 for decode):
  scale:          x (n, H) -> x * s (the embedding scale)
  softcap:        x (n, N) -> c * tanh(x / c) (final logit soft-capping)
  gelu_tanh_gate: y (n, 2I) gate / up runs (``params.gate_up_row``) -> gelu_tanh(gate) * up (n, I)
  rmsnorm_add:    x (n, H), w (H,), res (n, H) -> res + x * rsqrt(mean(x^2) + eps) * w
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ...params import GATE_UP_ROWS
from ..common import cached, const_tag, finalize, token_dim
from .fastmath import ftanh
from .norm import rms_inv_macro
from .simd import VL, scratch_buffer

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """transformers' ``gelu_pytorch_tanh``: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    inner = f32(_GELU_C) * (x + f32(0.044715) * x * x * x)
    return f32(0.5) * x * (f32(1.0) + ftanh(inner))


def _tag(n_static) -> str:
    return "dec" if n_static == 1 else "pre"


@cached
def scale(H: int, s: float, n_static: int | None = None):
    n = token_dim(n_static)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        y = T.match_buffer(var_y, (n, H), "float32")
        with T.sblock("root"):
            for i in T.parallel(n):
                for h in T.vectorized(H):
                    y[i, h] = x[i, h] * T.float32(s)

    return finalize(func, f"scale_{_tag(n_static)}_{H}_{const_tag(s)}")


@cached
def softcap(N: int, c: float, n_static: int | None = None):
    n = token_dim(n_static)
    inv = 1.0 / c

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, N), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        with T.sblock("root"):
            for i in T.parallel(n):
                for j in T.vectorized(N):
                    y[i, j] = ftanh(x[i, j] * T.float32(inv)) * T.float32(c)

    return finalize(func, f"softcap_{_tag(n_static)}_{N}_{const_tag(c)}")


@cached
def gelu_tanh_gate(I: int, n_static: int | None = None):
    """act[i, c] = gelu_tanh(gate row c) * (up row c), each run of ``GATE_UP_ROWS`` act rows
    read from its gate rows and the up rows right after them."""
    n = token_dim(n_static)
    R, W = I // GATE_UP_ROWS, I % GATE_UP_ROWS
    G = GATE_UP_ROWS

    @T.prim_func(s_tir=True)
    def func(var_y: T.handle, var_act: T.handle):
        y = T.match_buffer(var_y, (n, 2 * I), "float32")
        act = T.match_buffer(var_act, (n, I), "float32")
        with T.sblock("root"):
            for i in T.parallel(n):
                for r in range(R):
                    for v in T.vectorized(G):
                        act[i, r * G + v] = gelu_tanh(y[i, 2 * G * r + v]) * y[i, 2 * G * r + G + v]
                for v in range(W):
                    act[i, R * G + v] = gelu_tanh(y[i, 2 * G * R + v]) * y[i, 2 * G * R + W + v]

    return finalize(func, f"gelu_tanh_gate_{_tag(n_static)}_{I}")


@cached
def rmsnorm_add(H: int, eps: float, n_static: int | None = None):
    """y = res + x * rsqrt(mean(x^2) + eps) * w per row: a post norm and its residual add."""
    n = token_dim(n_static)
    rms_inv = rms_inv_macro(H, eps)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, w: T.Buffer((H,), "float32"), var_res: T.handle, var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        res = T.match_buffer(var_res, (n, H), "float32")
        y = T.match_buffer(var_y, (n, H), "float32")
        with T.sblock("root"):
            for i in T.parallel(n):
                acc = scratch_buffer((VL,))
                rms_inv(x, i, acc)
                for h in T.vectorized(H):
                    y[i, h] = res[i, h] + x[i, h] * acc[1] * w[h]

    return finalize(func, f"rmsnorm_add_{_tag(n_static)}_{H}")
