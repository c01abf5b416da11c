"""The parameter lists of the linear kernels, shared by the CPU and GPU sets.

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
