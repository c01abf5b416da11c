"""The parameter lists of the linear and batched-decode kernels, shared by the CPU and GPU sets.

TVMScript needs one ``prim_func`` per parameter list, so each (norm, epilogue) combination is
spelled out once here; a kernel family passes its ``body`` macro, which receives ``None`` for
the buffers its variant does not have.
"""

from __future__ import annotations

from tvm.script import tirx as T


def gemv_func(body, N: int, K: int, wdt: str, epilogue: str, norm: bool, w_shape=None):
    """Decode GEMV: ``x (1, K) [g (K,)] W (N, K) [bias (N,) | res (1, N)] -> y (1, N)``;
    ``body(x, g, W, y, bias, res)``.  ``w_shape``: W's stored shape where it is not (N, K)
    (a quantized format's bytes, ``formats.WeightFormat.storage``)."""
    x_ty, y_ty = T.Buffer((1, K), "float32"), T.Buffer((1, N), "float32")
    w_ty = T.Buffer(w_shape or (N, K), wdt)
    if norm and epilogue == "bias":
        @T.prim_func(s_tir=True)
        def func(x: x_ty, g: T.Buffer((K,), "float32"), W: w_ty,
                 bias: T.Buffer((N,), "float32"), y: y_ty):
            with T.sblock("root"):
                body(x, g, W, y, bias, None)
    elif norm:
        assert epilogue == "none", epilogue
        @T.prim_func(s_tir=True)
        def func(x: x_ty, g: T.Buffer((K,), "float32"), W: w_ty, y: y_ty):
            with T.sblock("root"):
                body(x, g, W, y, None, None)
    elif epilogue == "residual":
        @T.prim_func(s_tir=True)
        def func(x: x_ty, W: w_ty, res: T.Buffer((1, N), "float32"), y: y_ty):
            with T.sblock("root"):
                body(x, None, W, y, None, res)
    else:
        assert epilogue == "none", epilogue
        @T.prim_func(s_tir=True)
        def func(x: x_ty, W: w_ty, y: y_ty):
            with T.sblock("root"):
                body(x, None, W, y, None, None)
    return func


def swiglu_matmul_func(body, I: int, K: int, wdt: str, n, w_shape=None):
    """Prefill SwiGLU over ``n`` (symbolic) tokens: ``x (n, K) W (2I, K) -> act (n, I)``;
    ``body(x, W, act, n)``; ``w_shape`` as in ``gemv_func``."""
    w_ty = T.Buffer(w_shape or (2 * I, K), wdt)

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, W: w_ty, var_act: T.handle):
        x = T.match_buffer(var_x, (n, K), "float32")
        act = T.match_buffer(var_act, (n, I), "float32")
        with T.sblock("root"):
            body(x, W, act, n)

    return func


def matmul_func(body, N: int, K: int, wdt: str, epilogue: str, n, w_shape=None):
    """Prefill matmul over ``n`` (symbolic) tokens: ``x (n, K) W (N, K) [bias (N,) |
    res (n, N)] -> y (n, N)``; ``body(x, W, y, bias, res, n)``; ``w_shape`` as in
    ``gemv_func``."""
    w_ty = T.Buffer(w_shape or (N, K), wdt)
    if epilogue == "none":
        @T.prim_func(s_tir=True)
        def func(var_x: T.handle, W: w_ty, var_y: T.handle):
            x = T.match_buffer(var_x, (n, K), "float32")
            y = T.match_buffer(var_y, (n, N), "float32")
            with T.sblock("root"):
                body(x, W, y, None, None, n)
    elif epilogue == "bias":
        @T.prim_func(s_tir=True)
        def func(var_x: T.handle, W: w_ty, bias: T.Buffer((N,), "float32"),
                 var_y: T.handle):
            x = T.match_buffer(var_x, (n, K), "float32")
            y = T.match_buffer(var_y, (n, N), "float32")
            with T.sblock("root"):
                body(x, W, y, bias, None, n)
    else:
        assert epilogue == "residual", epilogue
        @T.prim_func(s_tir=True)
        def func(var_x: T.handle, W: w_ty, var_res: T.handle, var_y: T.handle):
            x = T.match_buffer(var_x, (n, K), "float32")
            res = T.match_buffer(var_res, (n, N), "float32")
            y = T.match_buffer(var_y, (n, N), "float32")
            with T.sblock("root"):
                body(x, W, y, None, res, n)
    return func


def rope_kv_batch_func(body, Hq: int, Hkv: int, D: int, bs: int, cap: int, cdt: str, B: int,
                       nb):
    """Ragged batched RoPE + KV write: ``qkv (B, (Hq + 2 Hkv) D), k_pool, v_pool (nb, Hkv, bs,
    D) cdt, inv_freq (D/2,), block_tables (B, cap) int32, write_offs (B,) int64, context_lens
    (B,) int64 -> q_rot (B, Hq D)``; ``body(qkv, k_pool, v_pool, inv_freq, bt, write_offs,
    context_lens, q_rot)``."""
    QKV = (Hq + 2 * Hkv) * D

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((B, QKV), "float32"), var_k: T.handle, var_v: T.handle,
             inv_freq: T.Buffer((D // 2,), "float32"), bt: T.Buffer((B, cap), "int32"),
             write_offs: T.Buffer((B,), "int64"), context_lens: T.Buffer((B,), "int64"),
             q_rot: T.Buffer((B, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(qkv, k_pool, v_pool, inv_freq, bt, write_offs, context_lens, q_rot)

    return func


def attention_batch_func(body, Hq: int, Hkv: int, D: int, bs: int, cap: int, cdt: str, B: int,
                         nb):
    """Ragged batched attention: ``q (B, Hq D), k_pool, v_pool, block_tables (B, cap) int32,
    context_lens (B,) int64 -> out (B, Hq D)``; ``body(q, k_pool, v_pool, bt, context_lens,
    out)``."""
    @T.prim_func(s_tir=True)
    def func(q: T.Buffer((B, Hq * D), "float32"), var_k: T.handle, var_v: T.handle,
             bt: T.Buffer((B, cap), "int32"), context_lens: T.Buffer((B,), "int64"),
             out: T.Buffer((B, Hq * D), "float32")):
        k_pool = T.match_buffer(var_k, (nb, Hkv, bs, D), cdt)
        v_pool = T.match_buffer(var_v, (nb, Hkv, bs, D), cdt)
        with T.sblock("root"):
            body(q, k_pool, v_pool, bt, context_lens, out)

    return func
