"""Weight formats: one object per format, the only place a format is described.

A format knows how a ``[N, K]`` matrix is stored in the weight pack (``storage``), its bytes per
weight, how to make it from float32 (``quantize``) and read it back (``dequantize``), and the
pieces the CPU kernels build on (``dequant_block``, ``int_dot``: TIR, see
``kernels/cpu/quant.py``).  The kernels, the parameter layout, the weight loader and the
quantizer look formats up here by name; adding a format is adding an object to ``FORMATS``.

Quantized formats keep GGUF's block layout byte for byte: each matrix row is ``K / 32``
blocks laid end to end, a block being float16 scale(s) then packed quants (``Q8_0``: d, 32
int8; ``Q4_0``: d, 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31, stored
plus 8; ``Q4_1``: d, m, the same nibbles, w = d q + m).  A GGUF tensor in one of these formats
is copied into the pack as it is, and rows of q / k / v (or gate / up) are joined as whole
rows, which a row-block layout allows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tvm.script import tirx as T

QBLOCK = 32  # weights per block of every quantized format here


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    block_bytes: int  # bytes per block of QBLOCK weights (floats: per weight)
    gguf_type: str  # gguf.GGMLQuantizationType member of the same layout

    has_offset = False  # whether ``offset`` gives a term (set by the formats that have one)

    @property
    def quantized(self) -> bool:
        return self.name not in ("float32", "float16")

    @property
    def block(self) -> int:
        return QBLOCK if self.quantized else 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    def storage(self, N: int, K: int) -> tuple[tuple[int, int], str]:
        """(shape, dtype) of a ``[N, K]`` matrix in the pack."""
        if not self.quantized:
            return (N, K), self.name
        return (N, K // QBLOCK * self.block_bytes), "uint8"

    def fits(self, K: int) -> bool:
        """Whether rows of ``K`` weights can be stored (whole blocks)."""
        return K % self.block == 0

    # numpy: float32 [N, K] <-> storage
    def quantize(self, w: np.ndarray) -> np.ndarray:
        if not self.quantized:
            return np.ascontiguousarray(w, dtype=self.name)
        n, k = w.shape
        blocks = np.asarray(w, np.float32).reshape(n * (k // QBLOCK), QBLOCK)
        return self._quantize_blocks(blocks).reshape(n, -1)

    def dequantize(self, packed: np.ndarray, K: int) -> np.ndarray:
        if not self.quantized:
            return np.asarray(packed, np.float32)
        n = packed.shape[0]
        blocks = np.ascontiguousarray(packed).reshape(n * (K // QBLOCK), self.block_bytes)
        return self._dequantize_blocks(blocks).reshape(n, K)

    def _quantize_blocks(self, blocks):
        raise NotImplementedError

    def _dequantize_blocks(self, blocks):
        raise NotImplementedError

    # TIR pieces over ``Wv`` = (W as uint8, as int8, as float16), the ``kernels.cpu.quant.views``
    # of a stored matrix; block ``b`` of row ``c`` starts at byte ``b * block_bytes``
    def scale(self, Wv, c, b):
        """The block's d, float32."""
        return T.Cast("float32", Wv[2][c, b * (self.block_bytes // 2)])

    def dequant16(self, Wv, c, b, half: int):
        """float32x16: weights ``[16 half, 16 half + 16)`` of the block."""
        raise NotImplementedError

    def int_dot(self, Wv, c, b, xq, x0):
        """int32x4 whose lanes add up to sum_j q_j * xq[x0 + j] over the block's 32 stored
        quants q (unsigned nibbles for the 4-bit formats, int8 for Q8_0) and int8 ``xq``."""
        raise NotImplementedError

    def offset(self, Wv, c, b):
        """The coefficient of ``dx * sum(xq)`` in the block's dot product (Q4_1: m; Q4_0: -8 d,
        its quants being stored plus 8), or None."""
        return None


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8 of their float16 values."""
    return values.astype(np.float16).view(np.uint8)


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """(n, 1) float32 from the float16 at byte ``offset`` of each block."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _nibbles(blocks_qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) uint8: low nibbles are weights 0-15, high 16-31."""
    return np.concatenate([blocks_qs & np.uint8(15), blocks_qs >> np.uint8(4)], axis=1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf (ties away from zero), as ggml's reference quantizer rounds."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def _u8x16(Wv, c, byte):
    return Wv[0].vload([c, byte], "uint8x16")


def _maddubs(u8, i8):
    """int16x8: adjacent pairs of u8 * i8 products added (SSSE3 ``pmaddubsw``; the 4-bit
    formats' sums stay far below its saturation)."""
    return T.call_llvm_pure_intrin("int16x8", "llvm.x86.ssse3.pmadd.ub.sw.128", u8, i8)


def _pairs_to_i32(p):
    """int32x4: adjacent pairs of int16 lanes added (``pmaddwd`` by ones)."""
    return T.call_llvm_pure_intrin("int32x4", "llvm.x86.sse2.pmadd.wd", p,
                                   T.broadcast(T.int16(1), 8))


def _nibble_dot(q, xq, x0):
    lo = T.bitwise_and(q, T.broadcast(T.uint8(15), 16))
    hi = T.shift_right(q, T.broadcast(T.uint8(4), 16))
    return _pairs_to_i32(_maddubs(lo, xq.vload([x0], "int8x16"))
                         + _maddubs(hi, xq.vload([x0 + 16], "int8x16")))


def _nibbles16(q, half: int):
    part = (T.bitwise_and(q, T.broadcast(T.uint8(15), 16)) if half == 0
            else T.shift_right(q, T.broadcast(T.uint8(4), 16)))
    return T.Cast("float32x16", part)


class _Float(WeightFormat):
    pass


class _Q8_0(WeightFormat):
    """d = max|w| / 127, q = round(w / d) in int8; w = d q."""

    def _quantize_blocks(self, blocks):
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        q = _round_half_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(d), q], axis=1)

    def _dequantize_blocks(self, blocks):
        return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16_at(blocks, 0)

    def dequant16(self, Wv, c, b, half):
        q = Wv[1].vload([c, b * 34 + 2 + 16 * half], "int8x16")
        return T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        # pmaddubsw takes one unsigned operand: |q| times xq carrying q's sign
        def part(h):
            q = Wv[1].vload([c, b * 34 + 2 + 16 * h], "int8x16")
            a = T.abs(q)  # |-128| wraps to -128, read unsigned as 128: still exact
            s = T.call_llvm_pure_intrin("int8x16", "llvm.x86.ssse3.psign.b.128",
                                        xq.vload([x0 + 16 * h], "int8x16"), q)
            return _maddubs(T.reinterpret("uint8x16", a), s)
        # each half's pair sums reach 2 * 127 * 127: added as int32, not int16
        return _pairs_to_i32(part(0)) + _pairs_to_i32(part(1))


class _Q4_0(WeightFormat):
    """d = (the signed w of largest magnitude) / -8, q = trunc(w / d + 8.5) clipped to 0..15;
    w = d (q - 8)."""

    has_offset = True

    def _quantize_blocks(self, blocks):
        big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = big / np.float32(-8)
        q = np.trunc(blocks * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)

    def _dequantize_blocks(self, blocks):
        q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
        return _f16_at(blocks, 0) * q.astype(np.float32)

    def dequant16(self, Wv, c, b, half):
        q = _nibbles16(_u8x16(Wv, c, b * 18 + 2), half) - T.broadcast(T.float32(8), 16)
        return q * T.broadcast(self.scale(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        return _nibble_dot(_u8x16(Wv, c, b * 18 + 2), xq, x0)

    def offset(self, Wv, c, b):
        return self.scale(Wv, c, b) * T.float32(-8)


class _Q4_1(WeightFormat):
    """d = (max - min) / 15, m = min, q = trunc((w - m) / d + 0.5) clipped to 0..15;
    w = d q + m."""

    has_offset = True

    def _quantize_blocks(self, blocks):
        lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
        d = (hi - lo) / np.float32(15)
        q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
        return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)

    def _dequantize_blocks(self, blocks):
        q = _nibbles(blocks[:, 4:]).astype(np.float32)
        return _f16_at(blocks, 0) * q + _f16_at(blocks, 2)

    def dequant16(self, Wv, c, b, half):
        q = _nibbles16(_u8x16(Wv, c, b * 20 + 4), half)
        return q * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        return _nibble_dot(_u8x16(Wv, c, b * 20 + 4), xq, x0)

    def offset(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, b * 10 + 1])


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _Float("float32", 4, "F32"),
    _Float("float16", 2, "F16"),
    _Q8_0("q8_0", 34, "Q8_0"),
    _Q4_0("q4_0", 18, "Q4_0"),
    _Q4_1("q4_1", 20, "Q4_1"),
)}
FLOAT_FORMATS = ("float32", "float16")
QUANT_FORMATS = tuple(n for n, f in FORMATS.items() if f.quantized)


def by_gguf_type(type_name: str) -> WeightFormat | None:
    """The format stored exactly like a GGUF tensor type (by its GGMLQuantizationType name)."""
    return next((f for f in FORMATS.values() if f.gguf_type == type_name), None)
