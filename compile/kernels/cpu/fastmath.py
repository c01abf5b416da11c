"""Vectorisable float32 exp (and tanh through it) for the kernels (LLVM would call scalar libm
``expf`` / ``tanhf`` per lane).

Cody-Waite range reduction ``x = n ln2 + r`` with ``|r| <= ln2 / 2`` and the Cephes degree-5
minimax polynomial; relative error about 1e-7 over the float32 range, inputs clamped to
[-87.3, 88.3] (so exp(-inf) gives ~1e-38, which callers treat as 0).
"""

from __future__ import annotations

from tvm import tirx

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
      5.0000001201e-1)


def fexp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for a float32 expression, as plain arithmetic LLVM can vectorise."""
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731
    x = tirx.max(tirx.min(x, f32(88.3)), f32(-87.3))
    n = tirx.floor(x * f32(_LOG2E) + f32(0.5))
    r = x - n * f32(_LN2_HI) - n * f32(_LN2_LO)
    p = f32(_P[0])
    for c in _P[1:]:
        p = p * r + f32(c)
    y = p * r * r + r + f32(1.0)
    scale = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return y * scale


def ftanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """tanh of a float32 expression: ``1 - 2 / (exp(2x) + 1)`` through ``fexp``, saturating to
    +-1 where fexp clamps."""
    one = tirx.const(1.0, "float32")
    return one - tirx.const(2.0, "float32") / (fexp(x * tirx.const(2.0, "float32")) + one)


def silu_mul(gate: tirx.PrimExpr, up: tirx.PrimExpr) -> tirx.PrimExpr:
    """silu(gate) * up (the SwiGLU product) for float32 expressions, through ``fexp``."""
    return gate / (tirx.const(1.0, "float32") + fexp(-gate)) * up
