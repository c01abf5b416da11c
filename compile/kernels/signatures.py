"""The parameter lists of the linear and batched-decode kernels, shared by the CPU and GPU sets.

TVMScript needs one ``prim_func`` per parameter list, so each (norm, epilogue) combination is
spelled out once here; a kernel family passes its ``body`` macro, which receives ``None`` for
the buffers its variant does not have.
"""

from __future__ import annotations

import math
import numbers

from tvm.script import tirx as T

from paged_decode.runtime.errors import ConfigError


def attention_options(D: int, max_context: int, window: int, softcap: float, scale: float):
    """``(window, softcap, scale, tag)`` of an attention kernel's keyword options: ``window``
    (0: unlimited) the positions a query sees, itself and the ``window - 1`` before it (one of
    at least ``max_context`` positions is unlimited: no query sees further back);
    ``softcap`` (0: none) the cap of ``softcap * tanh(s / softcap)`` on each scaled score;
    ``scale`` (0: ``1 / sqrt(D)``) the q.k multiplier, returned resolved.  ``tag`` is what the
    kernel's global_symbol appends: empty at the defaults (an explicit ``1 / sqrt(D)`` is the
    default), so a full-attention kernel keeps its name and one module can hold a sliding and a
    full layer's kernels side by side."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ConfigError(f"attention window {window!r} must be an int >= 0 (0: unlimited)")
    for name, value in (("softcap", softcap), ("scale", scale)):
        if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"attention {name} {value!r} must be a finite number >= 0 "
                              f"(0: the default)")
    window = int(window) if window < max_context else 0
    default_scale = 1.0 / math.sqrt(D)
    scale = float(scale) if scale and float(scale) != default_scale else 0.0
    tag = "".join(f"_{key}{_number_tag(value)}" for key, value in
                  (("win", window), ("softcap", float(softcap)), ("scale", scale))
                  if value)
    return window, float(softcap), scale or default_scale, tag


def _number_tag(x) -> str:
    """A number as identifier characters: 512 -> 512, 0.0625 -> 0p0625, 1e-05 -> 1em05."""
    return repr(x).replace(".", "p").replace("-", "m").replace("+", "")


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
