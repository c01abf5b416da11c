"""Weight formats: one object per format, the only place a format is described.

A format knows how a ``[N, K]`` matrix is stored in the weight pack (``storage``), its bytes per
weight, how to make it from float32 (``quantize``) and read it back (``dequantize``), and the
pieces the kernels build on: vector TIR for the CPU (``dequant16``, ``int_dot``, see
``kernels/cpu/quant.py``) and portable scalar TIR for the GPUs (``unit_scale``, ``quant``,
``weight``, see ``kernels/gpu/gemv.py``).  The kernels, the parameter layout, the weight
loader and the quantizer look formats up here by name; adding a format is adding an object to
``FORMATS``.

Quantized formats keep GGUF's block layout byte for byte: each matrix row is its blocks laid
end to end.  The 32-weight formats: float16 scale(s) then packed quants (``Q8_0``: d, 32 int8;
``Q4_0``: d, 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31, stored plus 8;
``Q4_1``: d, m, the same nibbles, w = d q + m; ``Q5_0``: d, 4 bytes of fifth bits (bit j:
weight j's bit 4), Q4_0's nibbles, w = d (q - 16); ``Q5_1``: d, m, the fifth bits, the nibbles,
w = d q + m).  The k-quants' 256-weight super-blocks:
``Q4_K`` (144 B): d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles
(each 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high); w = d sc q - dmin m.
``Q5_K`` (176 B): the same with 32 bytes of fifth bits (bit s of byte l: weight l of sub-block
s).  ``Q6_K`` (210 B): 128 bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales
(one per 16 weights), d; w = d sc (q - 32).  A GGUF tensor in one of these formats is copied
into the pack as it is, and rows of q / k / v (or gate / up) are joined as whole rows, which a
row-block layout allows.

On CPU targets (``interleaved``) the matrices in Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K /
Q6_K take the same blocks with 8 rows interleaved (``q8_0x8``, ``q4_0x8``, ``q4_1x8``,
``q5_0x8``, ``q5_1x8``, ``q4_kx8``, ``q5_kx8``, ``q6_kx8``; ``_Rows8``, ``_Q5Rows8``,
``_KRows8``, ``_Q6KRows8``): a lossless regrouping made when the pack is written, which the CPU
kernels read 8 rows per vector.

The kernels work in 32-weight units (``QBLOCK``) for every format: unit ``b`` of a k-quant row
is sub-block ``b % 8`` of super-block ``b // 8``, its scale (and min) decoded from the 6-bit
pairs where it is read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tvm.script import tirx as T

from paged_decode.runtime.manifest import INTERLEAVED_SUFFIX

from . import kquant

QBLOCK = 32  # weights per kernel unit; the block of the 32-weight formats
QK_K = 256  # weights per super-block of the k-quants


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    block_bytes: int  # bytes per block of ``block`` weights (floats: per weight)
    gguf_type: str  # gguf.GGMLQuantizationType member of the same layout

    has_offset = False  # whether ``offset`` gives a term (set by the formats that have one)
    block_weights = QBLOCK  # weights per stored block (quantized formats)
    grouped = False  # rows interleaved in groups (``_Grouped``); ``rows``: the row layout

    @property
    def rows(self) -> WeightFormat:
        """The format whose row layout this one stores (itself unless ``grouped``)."""
        return self

    @property
    def quantized(self) -> bool:
        return self.name not in ("float32", "float16")

    @property
    def block(self) -> int:
        return self.block_weights if self.quantized else 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    def storage(self, N: int, K: int) -> tuple[tuple[int, int], str]:
        """(shape, dtype) of a ``[N, K]`` matrix in the pack."""
        if not self.quantized:
            return (N, K), self.name
        return (N, K // self.block * self.block_bytes), "uint8"

    def row_bytes(self, K: int) -> int:
        return self.storage(1, K)[0][1] * (1 if self.quantized else self.block_bytes)

    def fits(self, K: int) -> bool:
        """Whether rows of ``K`` weights can be stored (whole blocks)."""
        return K % self.block == 0

    # numpy: float32 [N, K] <-> storage
    def quantize(self, w: np.ndarray) -> np.ndarray:
        if not self.quantized:
            return np.ascontiguousarray(w, dtype=self.name)
        n, k = w.shape
        blocks = np.asarray(w, np.float32).reshape(n * (k // self.block), self.block)
        return self._quantize_blocks(blocks).reshape(n, -1)

    def dequantize(self, packed: np.ndarray, K: int) -> np.ndarray:
        if not self.quantized:
            return np.asarray(packed, np.float32)
        n = packed.shape[0]
        blocks = np.ascontiguousarray(packed).reshape(n * (K // self.block), self.block_bytes)
        return self._dequantize_blocks(blocks).reshape(n, K)

    def _quantize_blocks(self, blocks):
        raise NotImplementedError

    def _dequantize_blocks(self, blocks):
        raise NotImplementedError

    # TIR pieces over ``Wv`` = (W as uint8, as int8, as float16), the ``kernels.cpu.quant.views``
    # of a stored matrix, for 32-weight unit ``b`` of row ``c`` (a 32-weight format's block ``b``
    # starts at byte ``b * block_bytes``)
    def scale(self, Wv, c, b):
        """The unit's scale (d), float32."""
        return T.Cast("float32", Wv[2][c, b * (self.block_bytes // 2)])

    def dequant16(self, Wv, c, b, half: int):
        """float32x16: weights ``[16 half, 16 half + 16)`` of the block."""
        raise NotImplementedError

    def int_dot(self, Wv, c, b, xq, x0):
        """int32x8 (AVX2, 256 bits) whose lanes add up to sum_j q_j * xq[x0 + j] over the
        unit's 32 stored quants q (unsigned for the 4- and 5-bit formats, int8 for Q8_0; Q6_K:
        (q - 32) times the 16-weight sub-scale) and int8 ``xq``; the weight is
        ``scale * q + offset``."""
        raise NotImplementedError

    def offset(self, Wv, c, b):
        """The coefficient of ``dx * sum(xq)`` in the unit's dot product (Q4_1: m; Q4_0: -8 d,
        its quants being stored plus 8; Q4_K / Q5_K: -dmin m), or None."""
        return None

    def wide16(self, Wv, c, b, half: int):
        """int16x16: the unit's stored quants ``[16 half, 16 half + 16)`` (as ``int_dot`` reads
        them), widened."""
        raise NotImplementedError

    def wide_dot(self, Wv, c, b, x16, x0):
        """int32x8 whose lanes add up to what ``int_dot``'s do, for int16 ``x16`` (``vpmaddwd``:
        16-bit products, exact in int32 for every format here)."""
        return _madd16(self.wide16(Wv, c, b, 0), x16.vload([x0], "int16x16")) + _madd16(
            self.wide16(Wv, c, b, 1), x16.vload([x0 + 16], "int16x16"))

    # Portable scalar TIR over ``W8``, the stored matrix as uint8 (its only view: no vector
    # intrinsics, no float16 loads, which pocl's OpenCL lacks).  Weight ``j`` (0..31) of unit
    # ``b`` of row ``c`` is ``unit_scale(.., j // 16) * quant(.., j) + unit_offset(..)``; every
    # index may be an expression.
    def unit_scale(self, W8, c, b, half):
        """float32: the scale of the unit's weights ``[16 half, 16 half + 16)``."""
        return _f16_scalar(W8, c, b * self.block_bytes)

    def unit_offset(self, W8, c, b):
        """float32 offset added to every weight of the unit (``has_offset`` formats)."""
        raise NotImplementedError

    def quant(self, W8, c, b, j):
        """int32: the unit's quant ``j``."""
        raise NotImplementedError

    def weight(self, W8, c, k):
        """float32: weight ``k`` of row ``c``, decoded."""
        b, j = k // QBLOCK, k % QBLOCK
        w = self.unit_scale(W8, c, b, j // 16) * T.Cast("float32", self.quant(W8, c, b, j))
        return w + self.unit_offset(W8, c, b) if self.has_offset else w


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8 of their float16 values."""
    return values.astype(np.float16).view(np.uint8)


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """(n, 1) float32 from the float16 at byte ``offset`` of each block."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _byte(W8, c, byte):
    return T.Cast("int32", W8[c, byte])


def _f16_scalar(W8, c, byte):
    """float32 of the little-endian float16 at ``byte`` of row ``c``, decoded from its bits:
    normal numbers rebias the exponent (15 -> 127), subnormals are m * 2^-24 (float(m) with 24
    taken off its exponent: OpenCL source prints float constants to 7 digits, so 2^-24 cannot be
    one), zeros keep their sign, inf / nan keep exponent 255."""
    h = T.bitwise_or(_byte(W8, c, byte), T.shift_left(_byte(W8, c, byte + 1), 8))
    e, m = T.bitwise_and(T.shift_right(h, 10), 31), T.bitwise_and(h, 1023)
    sign = T.shift_left(T.Cast("uint32", T.shift_right(h, 15)), T.uint32(31))
    bits = T.bitwise_or(sign, T.Cast("uint32", T.bitwise_or(
        T.shift_left(T.if_then_else(e == 31, 255, e + 112), 23), T.shift_left(m, 13))))
    tiny = T.reinterpret("float32", T.reinterpret("uint32", T.Cast("float32", m))
                         - T.uint32(24 << 23))
    return T.if_then_else(e == 0, T.if_then_else(m == 0, T.reinterpret("float32", sign),
                                                  T.if_then_else(h >= 32768, -tiny, tiny)),
                          T.reinterpret("float32", bits))


def _i8_scalar(W8, c, byte):
    """int32 of the int8 stored at ``byte``."""
    return T.bitwise_xor(_byte(W8, c, byte), 128) - 128


def _nibble_scalar(W8, c, byte0, j):
    """Quant ``j`` of 16 packed bytes at ``byte0``: low nibbles are 0-15, high 16-31."""
    return T.bitwise_and(T.shift_right(_byte(W8, c, byte0 + j % 16), (j // 16) * 4), 15)


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


def _cat(lo, hi, lanes: int = 16):
    """The 2 * ``lanes``-lane vector of two ``lanes``-lane ones."""
    return T.Shuffle([lo, hi], list(range(2 * lanes)))


def _maddubs32(u8, i8):
    """int16x16: ``pmaddubsw`` on 256 bits (AVX2)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u8, i8)


def _pairs_to_i32x8(p):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p,
                                   T.broadcast(T.int16(1), 16))


def _nibble_dot(q, xq, x0):
    """int32x8 over one 32-weight block of 16 packed bytes: low nibbles (weights 0-15) and high
    nibbles (16-31) side by side in one 256-bit register, against the block's 32 int8 x."""
    both = _cat(T.bitwise_and(q, T.broadcast(T.uint8(15), 16)),
                T.shift_right(q, T.broadcast(T.uint8(4), 16)))
    return _pairs_to_i32x8(_maddubs32(both, xq.vload([x0], "int8x32")))


def _madd16(a, b):
    """int32x8: adjacent pairs of int16 products added (AVX2 ``vpmaddwd``)."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def _nibbles_u8(q, half: int):
    return (T.bitwise_and(q, T.broadcast(T.uint8(15), 16)) if half == 0
            else T.shift_right(q, T.broadcast(T.uint8(4), 16)))


def _nibbles16(q, half: int):
    return T.Cast("float32x16", _nibbles_u8(q, half))


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
        q = Wv[1].vload([c, b * 34 + 2], "int8x32")
        s = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b",
                                    xq.vload([x0], "int8x32"), q)
        # pair sums reach 2 * 128 * 127 < 2^15: no pmaddubsw saturation
        return _pairs_to_i32x8(_maddubs32(T.reinterpret("uint8x32", T.abs(q)), s))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", Wv[1].vload([c, b * 34 + 2 + 16 * half], "int8x16"))

    def quant(self, W8, c, b, j):
        return _i8_scalar(W8, c, b * 34 + 2 + j)


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

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", _nibbles_u8(_u8x16(Wv, c, b * 18 + 2), half))

    def offset(self, Wv, c, b):
        return self.scale(Wv, c, b) * T.float32(-8)

    def unit_offset(self, W8, c, b):
        return self.unit_scale(W8, c, b, 0) * T.float32(-8)

    def quant(self, W8, c, b, j):
        return _nibble_scalar(W8, c, b * 18 + 2, j)


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

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", _nibbles_u8(_u8x16(Wv, c, b * 20 + 4), half))

    def offset(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, b * 10 + 1])

    def unit_offset(self, W8, c, b):
        return _f16_scalar(W8, c, b * 20 + 2)

    def quant(self, W8, c, b, j):
        return _nibble_scalar(W8, c, b * 20 + 4, j)


def _fifth_bits(h, lanes: int):
    """uint8 x ``4 lanes``: byte i is 16 where bit i of the uint32 ``h`` is set, else 0 (the
    fifth bits of Q5_0 / Q5_1 quants 0..4 lanes - 1).  Lane L of ``h`` broadcast and shifted
    by 4 L keeps its weights' four bits low; times 0x02040810 puts bit i at bit 8 i + 4 of the
    lane (the four shifted copies do not overlap, so the product carries nothing)."""
    t = T.shift_right(T.broadcast(h, lanes), T.ramp(T.uint32(0), T.uint32(4), lanes))
    spread = T.bitwise_and(t, T.broadcast(T.uint32(15), lanes)) * T.broadcast(
        T.uint32(0x02040810), lanes)
    return T.reinterpret(f"uint8x{4 * lanes}",
                         T.bitwise_and(spread, T.broadcast(T.uint32(0x10101010), lanes)))


def _u32_at(W8, c, byte):
    """uint32 of the 4 little-endian bytes at ``byte`` of row ``c`` (a 2-byte aligned field)."""
    def part(i):
        return T.shift_left(T.Cast("uint32", W8[c, byte + i]), T.uint32(8 * i))
    return T.bitwise_or(T.bitwise_or(part(0), part(1)), T.bitwise_or(part(2), part(3)))


class _Q5(WeightFormat):
    """Q5_0 / Q5_1: 32-weight blocks of float16 field(s) (Q5_0: d; Q5_1: d, m), 4 bytes of
    fifth bits (bit j: weight j's bit 4) and 16 bytes of nibbles (low: weights 0-15, high:
    16-31).  Q5_0: d = (the signed w of largest magnitude) / -16, q = trunc(w / d + 16.5)
    clipped to 0..31, w = d (q - 16); Q5_1: d = (max - min) / 31, m = min, q = trunc((w - m) /
    d + 0.5) clipped to 0..31, w = d q + m (ggml's reference quantizers, as ``gguf`` runs
    them)."""

    has_offset = True
    fields = 1  # float16 fields before the fifth bits

    @property
    def _qh(self) -> int:
        return 2 * self.fields

    @property
    def _qs(self) -> int:
        return 2 * self.fields + 4

    def _pack(self, q, fields):
        qh = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
        return np.concatenate([*fields, qh, _pack_nibbles(q & np.uint8(15))], axis=1)

    def _quants(self, blocks):
        """(n, 32) uint8 quants 0..31 of (n, block_bytes) blocks."""
        fifth = np.unpackbits(blocks[:, self._qh:self._qs], axis=1, bitorder="little")
        return _nibbles(blocks[:, self._qs:]) | (fifth << np.uint8(4))

    def _fifth(self, Wv, c, b, lanes: int, first: int = 0):
        return _fifth_bits(T.shift_right(_u32_at(Wv[0], c, b * self.block_bytes + self._qh),
                                         T.uint32(first)), lanes)

    def _quants32(self, Wv, c, b):
        q = _u8x16(Wv, c, b * self.block_bytes + self._qs)
        both = _cat(T.bitwise_and(q, T.broadcast(T.uint8(15), 16)),
                    T.shift_right(q, T.broadcast(T.uint8(4), 16)))
        return T.bitwise_or(both, self._fifth(Wv, c, b, 8))

    def _quants16(self, Wv, c, b, half: int):
        return T.bitwise_or(_nibbles_u8(_u8x16(Wv, c, b * self.block_bytes + self._qs), half),
                            self._fifth(Wv, c, b, 4, 16 * half))

    def int_dot(self, Wv, c, b, xq, x0):
        # pair sums reach 2 * 31 * 128 < 2^15: no pmaddubsw saturation
        return _pairs_to_i32x8(_maddubs32(self._quants32(Wv, c, b), xq.vload([x0], "int8x32")))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", self._quants16(Wv, c, b, half))

    def dequant16(self, Wv, c, b, half):
        q = T.Cast("float32x16", self._quants16(Wv, c, b, half))
        return q * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16)

    def quant(self, W8, c, b, j):
        at = b * self.block_bytes
        fifth = T.bitwise_and(T.shift_right(_byte(W8, c, at + self._qh + j // 8), j % 8), 1)
        return T.bitwise_or(_nibble_scalar(W8, c, at + self._qs, j), T.shift_left(fifth, 4))


class _Q5_0(_Q5):
    def _quantize_blocks(self, blocks):
        big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = big / np.float32(-16)
        q = np.trunc(blocks * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
        return self._pack(q, [_f16_bytes(d)])

    def _dequantize_blocks(self, blocks):
        q = self._quants(blocks).astype(np.int8) - np.int8(16)
        return _f16_at(blocks, 0) * q.astype(np.float32)

    def offset(self, Wv, c, b):
        return self.scale(Wv, c, b) * T.float32(-16)

    def unit_offset(self, W8, c, b):
        return self.unit_scale(W8, c, b, 0) * T.float32(-16)


class _Q5_1(_Q5):
    fields = 2

    def _quantize_blocks(self, blocks):
        lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
        d = (hi - lo) / np.float32(31)
        q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
        return self._pack(q, [_f16_bytes(d), _f16_bytes(lo)])

    def _dequantize_blocks(self, blocks):
        return _f16_at(blocks, 0) * self._quants(blocks).astype(np.float32) + _f16_at(blocks, 2)

    def offset(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, b * 12 + 1])

    def unit_offset(self, W8, c, b):
        return _f16_scalar(W8, c, b * 24 + 2)


# ------------------------------------------------------------------------------ k-quants
def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes -> (n, 8) 6-bit scales and (n, 8) mins (``get_scale_min_k4``)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc, mn


def _k_pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_k_scales_mins`: (n, 8) values 0..63 each -> (n, 12) bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _requantize(x: np.ndarray, offset: np.ndarray | None, step: np.ndarray, lo: int, hi: int,
                searched: np.ndarray) -> np.ndarray:
    """ggml's last k-quant pass: q = nearest_int((x + offset) / step) clipped to lo..hi against the
    stored (quantized) scales, in float32 with ggml's division; a sub-block whose step is 0 keeps
    the quants its search gave (``searched``), as ggml's ``if (!d) continue`` does."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint((x if offset is None else x + offset[..., None]) / step[..., None]),
                    lo, hi)
    return np.where(step[..., None] != 0, q, searched)


def _k_superblock_scales(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, 8) sub-block scales or mins -> (float16 super scale (n, 1), 6-bit codes (n, 8)) as
    ggml's reference quantizer makes them: max = the largest value (at least 0), codes =
    min(levels, nearest_int(levels / max * value)) taken modulo 256 as its uint8 is,
    super = max / levels."""
    top = np.maximum(values.max(axis=1, keepdims=True), np.float32(0))
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, np.float32(levels) / top, np.float32(0)).astype(np.float32)
    codes = np.minimum(np.rint(inv * values).astype(np.int64) & 255, levels)
    return (top / np.float32(levels)).astype(np.float16), codes.astype(np.float32)


class _KMin(WeightFormat):
    """Q4_K / Q5_K: eight 32-weight sub-blocks, each w = d sc_s q - dmin m_s with 6-bit sc_s, m_s
    and q in 0..2^bits - 1.  The quantizer is ggml's reference one (``quantize_row_q4_K_ref``,
    what llama-quantize runs without an importance matrix), byte for byte: each sub-block's
    (scale, min) from a grid search weighted by ``sqrt(mean(x^2)) + |x|`` (``kquant``), the eight
    scales and mins quantized to 6 bits against the super-block's d and dmin, q requantized
    against those."""

    block_weights = QK_K
    has_offset = True
    bits = 4
    search = (-1.0, 0.1, 20)  # (rmin, rdelta, nstep) of quantize_row_q4_K_ref's scale grid

    @property
    def _qs(self) -> int:  # byte offset of the nibbles in a super-block
        return 16 if self.bits == 4 else 48

    def _quantize_blocks(self, blocks):
        nmax, n = (1 << self.bits) - 1, len(blocks)
        scale, mn, searched = kquant.fit_min_scale(blocks.reshape(-1, 32), nmax, *self.search)
        d, sc = _k_superblock_scales(scale.reshape(n, 8), 63)
        dmin, mq = _k_superblock_scales(mn.reshape(n, 8), 63)
        ds = d.astype(np.float32) * sc
        dm = dmin.astype(np.float32) * mq
        q = _requantize(blocks.reshape(n, 8, 32), dm, ds, 0, nmax,
                        searched.reshape(n, 8, 32)).astype(np.uint8)
        low = (q & 15).reshape(-1, 4, 2, 32)
        parts = [d.view(np.uint8), dmin.view(np.uint8), _k_pack_scales(sc, mq)]
        if self.bits == 5:
            fifth = (q >> 4).transpose(0, 2, 1)  # (n, 32 weights, 8 sub-blocks)
            parts.append((fifth << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8))
        parts.append((low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128))
        return np.concatenate(parts, axis=1)

    def _dequantize_blocks(self, blocks):
        n = len(blocks)
        sc, mn = _k_scales_mins(blocks[:, 4:16])
        d = (_f16_at(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
        dm = (_f16_at(blocks, 2) * mn.astype(np.float32)).reshape(n, 8, 1)
        qs = blocks[:, self._qs:self._qs + 128].reshape(n, 4, 1, 32)
        q = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)).reshape(n, 8,
                                                                                            32)
        if self.bits == 5:
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8,
                                                                                           1)
            q = q | ((qh & np.uint8(1)) << np.uint8(4))
        return (d * q.astype(np.float32) - dm).reshape(n, QK_K)

    # TIR: unit b is sub-block s = b % 8 of super-block b // 8, at byte ``base``
    def _where(self, b):
        return (b // 8) * self.block_bytes, b % 8

    def _scale_min_byte(self, W8, c, base, s, want_min: bool):
        def byte(j):
            return _byte(W8, c, base + 4 + j)
        if want_min:
            low = T.bitwise_and(byte(s + 4), 63)
            high = T.bitwise_or(T.shift_right(byte(s + 4), 4),
                                T.shift_left(T.shift_right(byte(s), 6), 4))
        else:
            low = T.bitwise_and(byte(s), 63)
            high = T.bitwise_or(T.bitwise_and(byte(s + 4), 15),
                                T.shift_left(T.shift_right(byte(s - 4), 6), 4))
        # both arms' bytes lie inside the super-block's first 16 bytes for every s in 0..7
        return T.Cast("float32", T.if_then_else(s < 4, low, high))

    def sub_scales8(self, Wv, c, base, mins: bool):
        """float32x8: the eight sub-blocks' scales d sc_s (``mins``: offsets -dmin m_s) of the
        super-block at byte ``base``, decoded as one vector (a scalar decode per unit, once
        unrolled, is what LLVM's SLP vectorizer turns into AMD's slow ``insertq``)."""
        def four(j):
            return T.Cast("int32x4", Wv[0].vload([c, base + 4 + j], "uint8x4"))

        def lanes(v):
            return T.broadcast(T.int32(v), 4)

        d, m, md = four(0), four(4), four(8)
        if mins:
            q = _cat(T.bitwise_and(m, lanes(63)), T.bitwise_or(
                T.shift_right(md, lanes(4)), T.shift_left(T.shift_right(m, lanes(6)), lanes(4))), 4)
            return T.Cast("float32x8", q) * T.broadcast(
                -T.Cast("float32", Wv[2][c, base // 2 + 1]), 8)
        q = _cat(T.bitwise_and(d, lanes(63)), T.bitwise_or(
            T.bitwise_and(md, lanes(15)), T.shift_left(T.shift_right(d, lanes(6)), lanes(4))), 4)
        return T.Cast("float32x8", q) * T.broadcast(T.Cast("float32", Wv[2][c, base // 2]), 8)

    def scale(self, Wv, c, b):
        base, s = self._where(b)
        return (T.Cast("float32", Wv[2][c, base // 2])
                * self._scale_min_byte(Wv[0], c, base, s, False))

    def offset(self, Wv, c, b):
        base, s = self._where(b)
        return -(T.Cast("float32", Wv[2][c, base // 2 + 1])
                 * self._scale_min_byte(Wv[0], c, base, s, True))

    def _quants16(self, Wv, c, b, half: int, lanes: int = 16):
        """uint8 x ``lanes``: the unit's quants from ``16 half`` on."""
        base, s = self._where(b)
        t = f"uint8x{lanes}"
        nib = T.shift_right(Wv[0].vload([c, base + self._qs + (s // 2) * 32 + 16 * half], t),
                            T.broadcast(T.Cast("uint8", (s % 2) * 4), lanes))
        q = T.bitwise_and(nib, T.broadcast(T.uint8(15), lanes))
        if self.bits == 5:
            hb = T.shift_right(Wv[0].vload([c, base + 16 + 16 * half], t),
                               T.broadcast(T.Cast("uint8", s), lanes))
            q = T.bitwise_or(q, T.shift_left(T.bitwise_and(hb, T.broadcast(T.uint8(1), lanes)),
                                             T.broadcast(T.uint8(4), lanes)))
        return q

    def int_dot(self, Wv, c, b, xq, x0):
        return _pairs_to_i32x8(_maddubs32(self._quants16(Wv, c, b, 0, 32),
                                          xq.vload([x0], "int8x32")))

    def dequant16(self, Wv, c, b, half):
        return (T.Cast("float32x16", self._quants16(Wv, c, b, half))
                * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", self._quants16(Wv, c, b, half))

    def unit_scale(self, W8, c, b, half):
        base, s = self._where(b)
        return _f16_scalar(W8, c, base) * self._scale_min_byte(W8, c, base, s, False)

    def unit_offset(self, W8, c, b):
        base, s = self._where(b)
        return -(_f16_scalar(W8, c, base + 2) * self._scale_min_byte(W8, c, base, s, True))

    def quant(self, W8, c, b, j):
        base, s = self._where(b)
        q = T.bitwise_and(T.shift_right(_byte(W8, c, base + self._qs + (s // 2) * 32 + j),
                                        (s % 2) * 4), 15)
        if self.bits == 5:
            q = T.bitwise_or(q, T.shift_left(
                T.bitwise_and(T.shift_right(_byte(W8, c, base + 16 + j), s), 1), 4))
        return q


class _Q4_K(_KMin):
    bits = 4


class _Q5_K(_KMin):
    bits = 5
    search = (-0.5, 0.1, 15)  # quantize_row_q5_K_ref's


class _Q6_K(WeightFormat):
    """Sixteen 16-weight sub-blocks, w = d sc_s (q - 32), int8 sc_s, q in 0..63.  The quantizer is
    ggml's reference one (``quantize_row_q6_K_ref``), byte for byte: each sub-block's scale from
    ``make_qx_quants``' search weighted by x^2 (``kquant``), the sixteen scales to int8 against
    d = (largest-magnitude scale) / -128, q requantized against those; a super-block whose
    scales are all below ggml's 1e-15 is all zeros."""

    block_weights = QK_K

    def _quantize_blocks(self, blocks):
        n = len(blocks)
        scale, searched = kquant.fit_symmetric(blocks.reshape(-1, 16), 32)
        scale = scale.reshape(n, 16)
        top = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)
        empty = np.abs(top) < np.float32(1e-15)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.float32(-128) / top
            d = np.where(empty, 0, np.float32(1) / inv).astype(np.float16)
            sc = np.where(empty, 0, np.clip(np.rint(inv * scale), -128, 127)).astype(np.float32)
        ds = d.astype(np.float32) * sc
        q = _requantize(blocks.reshape(n, 16, 16), None, ds, -32, 31,
                        searched.reshape(n, 16, 16).astype(np.float32) - 32) + 32
        q = np.where(empty[..., None], 0, q).astype(np.uint8)
        q = q.reshape(-1, 2, 4, 32)  # (n, half, p, l): weight 128 half + 32 p + l
        ql = (q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)  # (n, half, 2, 32)
        qh = (q >> 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
        qh = qh.sum(axis=2, dtype=np.uint8)  # (n, half, 32)
        return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                               sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], axis=1)

    def _dequantize_blocks(self, blocks):
        n = len(blocks)
        d = (_f16_at(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32))
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2,
                                                                                        1)
        ql = (ql & np.uint8(15)).reshape(n, 2, 4, 32)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1)
        q = (ql | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (d.reshape(n, 16, 1) * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)

    # TIR: unit b is weights 32 p + [0, 32) of half h of super-block b // 8 (s = b % 8 = 4 h + p)
    def _quants16(self, Wv, c, b, half: int, lanes: int = 16):
        base, s = (b // 8) * 210, b % 8
        h, p = s // 4, s % 4
        t = f"uint8x{lanes}"
        lo = T.bitwise_and(
            T.shift_right(Wv[0].vload([c, base + h * 64 + (p % 2) * 32 + 16 * half], t),
                          T.broadcast(T.Cast("uint8", (p // 2) * 4), lanes)),
            T.broadcast(T.uint8(15), lanes))
        hi = T.bitwise_and(
            T.shift_right(Wv[0].vload([c, base + 128 + h * 32 + 16 * half], t),
                          T.broadcast(T.Cast("uint8", p * 2), lanes)),
            T.broadcast(T.uint8(3), lanes))
        return T.bitwise_or(lo, T.shift_left(hi, T.broadcast(T.uint8(4), lanes)))

    def _sub_scale(self, Wv, c, b, half: int):
        """The int8 scale of the unit's 16 weights ``[16 half, 16 half + 16)``."""
        return Wv[1][c, (b // 8) * 210 + 192 + (b % 8) * 2 + half]

    def scale(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, (b // 8) * 105 + 104])

    def dequant16(self, Wv, c, b, half):
        q = T.Cast("float32x16", T.Cast("int8x16", self._quants16(Wv, c, b, half))
                   - T.broadcast(T.int8(32), 16))
        return q * T.broadcast(self.scale(Wv, c, b)
                               * T.Cast("float32", self._sub_scale(Wv, c, b, half)), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        x = xq.vload([x0], "int8x32")
        p = (_maddubs32(self._quants16(Wv, c, b, 0, 32), x)
             - _maddubs32(T.broadcast(T.uint8(32), 32), x))
        sc = [T.broadcast(T.Cast("int16", self._sub_scale(Wv, c, b, h)), 8) for h in (0, 1)]
        return _madd16(p, _cat(sc[0], sc[1], 8))

    def wide_dot(self, Wv, c, b, x16, x0):
        # per half: sum (q - 32) x in int32 (|lane| <= 2 * 32 * 32767), times its int8 sub-scale
        def part(h):
            q = T.Cast("int16x16", self._quants16(Wv, c, b, h)) - T.broadcast(T.int16(32), 16)
            return _madd16(q, x16.vload([x0 + 16 * h], "int16x16")) * T.broadcast(
                T.Cast("int32", self._sub_scale(Wv, c, b, h)), 8)
        return part(0) + part(1)

    def unit_scale(self, W8, c, b, half):
        base = (b // 8) * 210
        return _f16_scalar(W8, c, base + 208) * T.Cast(
            "float32", _i8_scalar(W8, c, base + 192 + (b % 8) * 2 + half))

    def quant(self, W8, c, b, j):
        base, s = (b // 8) * 210, b % 8
        h, p = s // 4, s % 4
        lo = T.bitwise_and(T.shift_right(_byte(W8, c, base + h * 64 + (p % 2) * 32 + j),
                                         (p // 2) * 4), 15)
        hi = T.bitwise_and(T.shift_right(_byte(W8, c, base + 128 + h * 32 + j), p * 2), 3)
        return T.bitwise_or(lo, T.shift_left(hi, 4)) - 32


# ------------------------------------------------------------------ rows interleaved by 8
ROW_GROUP = 8  # rows per group of an interleaved layout: one 256-bit vector of float32 sums


def _x4(x32, i):
    """int8x32: the 4 int8 x of int32 element ``i`` broadcast to 8 lanes (one per row)."""
    return T.reinterpret("int8x32", T.broadcast(x32[i], ROW_GROUP))


def _sum8(t):
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]))


def _dpbusd(acc, u8, i8):
    """int32x8: ``acc`` plus, per 32-bit lane, the 4 products of u8 ``u8`` and int8 ``i8``
    (``vpdpbusd``, AVX-512 VNNI / AVX-VNNI, 256 bits)."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", acc,
                                   T.reinterpret("int8x32", u8), i8)


def _dpbusd_chunks(pairs):
    """int32x8: sum over ``pairs`` of (u8 quants . 4 int8 x) per 32-bit lane, each pair one
    ``vpdpbusd`` (x a 4-byte broadcast, which LLVM folds into the instruction's memory
    operand), in two independent chains.  Exact: the same integer sums as ``vpmaddubsw`` +
    ``vpmaddwd``, without their int16 step."""
    chains = [T.broadcast(T.int32(0), 8), T.broadcast(T.int32(0), 8)]
    for j, (u8, i8) in enumerate(pairs):
        chains[j % 2] = _dpbusd(chains[j % 2], u8, i8)
    return chains[0] + chains[1]


class _Grouped(WeightFormat):
    """A base format's blocks with ``ROW_GROUP`` rows interleaved (``base``): stored
    ``(N / 8, K / block * unit_bytes)``, each group's block ``k`` the eight rows' block ``k``
    regrouped (``group`` / ``ungroup``, lossless).  The CPU kernels' pieces work on a whole
    group: ``group_dot`` (a 32-weight unit's integer dot products, lane r = row r) and
    ``group_unit`` (their float contribution); the float tile over decoded weights reads it
    by rows (``scale``, ``offset``, ``dequant16``, each row's bytes gathered from the chunks).
    CPU only: the GPUs' scalar pieces are not defined here."""

    grouped = True

    @property
    def wide_x(self) -> bool:
        """Whether its GEMV and int8 tiles also take int16 x (``group_dot_wide``: the LM
        head's kernels), so that an LM head in this format can be interleaved."""
        return False

    @property
    def half_sums(self) -> bool:
        """Whether its int8 ``group_dot`` takes ``neg``: each 16-weight half's -32 sum x,
        which its kernels' quantizer stores with x in place of the block's sum."""
        return False

    def __init__(self, base: WeightFormat, block_bytes: int):
        super().__init__(base.name + INTERLEAVED_SUFFIX, block_bytes, base.gguf_type)
        object.__setattr__(self, "base", base)

    @property
    def rows(self) -> WeightFormat:
        return self.base

    @property
    def block_weights(self) -> int:
        return self.base.block

    @property
    def has_offset(self) -> bool:
        return self.base.has_offset

    @property
    def unit_bytes(self) -> int:  # bytes of one group's block: 8 rows
        return ROW_GROUP * self.block_bytes

    @property
    def step_bytes(self) -> int:  # bytes of one group's 32-weight unit (on average)
        return self.unit_bytes * QBLOCK // self.block

    def storage(self, N, K):
        if N % ROW_GROUP:
            raise ValueError(f"{self.name} stores rows in groups of {ROW_GROUP}; N={N} is not a "
                             "multiple")
        return (N // ROW_GROUP, K // self.block * self.unit_bytes), "uint8"

    def row_bytes(self, K):
        return K // self.block * self.block_bytes

    def quantize(self, w):
        return self.group(self.base.quantize(w))

    def dequantize(self, packed, K):
        return self.base.dequantize(self.ungroup(packed), K)

    def group(self, packed: np.ndarray) -> np.ndarray:
        """Rows in the base format's layout ``(N, K / block * base bytes)`` -> this layout."""
        raise NotImplementedError

    def ungroup(self, grouped: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`group`."""
        raise NotImplementedError

    def _field8(self, Wv, g, base, field: int):
        """float32x8: float16 field ``field`` of the 8 rows at the block's byte ``base``."""
        return T.Cast("float32x8", Wv[2].vload([g, base // 2 + field * ROW_GROUP], "float16x8"))

    # row-wise pieces for the float tile over decoded weights (prefill of short rows): row c is
    # row c % 8 of group c // 8, its quant bytes gathered 4 at a time from the chunks
    def _row_bytes16(self, Wv, c, at):
        """uint8x16: row c's 4 bytes in each of the 4 chunks of 32 bytes from byte ``at``."""
        four = [Wv[0].vload([c // ROW_GROUP, at + 32 * j + 4 * (c % ROW_GROUP)], "uint8x4")
                for j in range(4)]
        return _cat(_cat(four[0], four[1], 4), _cat(four[2], four[3], 4), 8)

    # the GPUs never get these layouts (``interleaved``)
    def unit_scale(self, W8, c, b, half):
        raise NotImplementedError(f"{self.name} is a CPU layout")

    def unit_offset(self, W8, c, b):
        raise NotImplementedError(f"{self.name} is a CPU layout")

    def quant(self, W8, c, b, j):
        raise NotImplementedError(f"{self.name} is a CPU layout")


class _Rows8(_Grouped):
    """Q8_0 / Q4_0 / Q4_1 with 8 rows interleaved (``q8_0x8``, ...).  A group's unit ``b``:
    first each float16 field of the block (d; Q4_1: d then m) for rows 0..7 (16 bytes per
    field), then the quants in 4-byte chunks: chunk ``j`` holds bytes ``[4j, 4j + 4)`` of each
    row's quant bytes, row after row (32 bytes; Q4 blocks have 4 chunks, whose low nibbles
    are weights 4j + i and high ones 16 + 4j + i, Q8_0 8).  One 256-bit load of a chunk is 8
    rows x 4 quants, so a ``vpmaddubsw`` against 4 bytes of x broadcast gives every row's
    partial sum in its own lanes: the eight rows share the unpacking, the conversion and the
    scale, and no horizontal reduction remains (docs/design.md: Quantized weights)."""

    def __init__(self, base: WeightFormat):
        super().__init__(base, base.block_bytes)

    @property
    def wide_x(self) -> bool:
        return self.base.name == "q8_0"

    @property
    def fields(self) -> int:  # float16 fields per block (d; Q4_1: d, m)
        return 2 if self.base.name == "q4_1" else 1

    @property
    def quant_bytes(self) -> int:
        return self.block_bytes - 2 * self.fields

    def group(self, packed):
        n, nb = packed.shape[0], packed.shape[1] // self.block_bytes
        b = np.ascontiguousarray(packed).reshape(n // ROW_GROUP, ROW_GROUP, nb, self.block_bytes)
        h = 2 * self.fields
        head = b[..., :h].reshape(-1, ROW_GROUP, nb, self.fields, 2).transpose(0, 2, 3, 1, 4)
        qs = b[..., h:].reshape(-1, ROW_GROUP, nb, self.quant_bytes // 4, 4).transpose(
            0, 2, 3, 1, 4)
        g = n // ROW_GROUP
        return np.ascontiguousarray(np.concatenate(
            [head.reshape(g, nb, -1), qs.reshape(g, nb, -1)], axis=2).reshape(g, -1))

    def ungroup(self, grouped):
        g, nb = grouped.shape[0], grouped.shape[1] // self.unit_bytes
        u = np.ascontiguousarray(grouped).reshape(g, nb, self.unit_bytes)
        h = 2 * self.fields * ROW_GROUP
        head = u[..., :h].reshape(g, nb, self.fields, ROW_GROUP, 2).transpose(0, 3, 1, 2, 4)
        qs = u[..., h:].reshape(g, nb, self.quant_bytes // 4, ROW_GROUP, 4).transpose(
            0, 3, 1, 2, 4)
        rows = np.concatenate([head.reshape(g, ROW_GROUP, nb, -1),
                               qs.reshape(g, ROW_GROUP, nb, -1)], axis=3)
        return np.ascontiguousarray(rows.reshape(g * ROW_GROUP, nb * self.block_bytes))

    def _chunk(self, Wv, g, b, j, dtype="uint8x32"):
        byte = b * self.unit_bytes + 2 * self.fields * ROW_GROUP + 32 * j
        return (Wv[0] if dtype.startswith("u") else Wv[1]).vload([g, byte], dtype)

    def group_dot(self, Wv, g, b, x32, x0, vnni: bool = False):
        """int32x8: lane r = sum_j q_j(row r) * x_j over unit ``b``'s 32 weights (the stored
        quants: Q4 unsigned 0..15), ``x32`` the int8 x as int32 from element ``x0``;
        ``vnni``: by ``vpdpbusd`` (the same sums)."""
        if self.base.name == "q8_0":
            # pair sums of int8 x int8 reach 2 * 128 * 127: each chunk to int32 on its own
            pairs = []
            for j in range(8):
                q = self._chunk(Wv, g, b, j, "int8x32")
                s = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", _x4(x32, x0 + j),
                                            q)
                pairs.append((T.reinterpret("uint8x32", T.abs(q)), s))
            if vnni:
                return _dpbusd_chunks(pairs)
            return _sum8([_pairs_to_i32x8(_maddubs32(u, i)) for u, i in pairs])
        pairs = []
        low = T.broadcast(T.uint8(15), 32)
        for j in range(4):
            p = self._chunk(Wv, g, b, j)
            pairs.append((T.bitwise_and(p, low), _x4(x32, x0 + j)))
            pairs.append((T.bitwise_and(T.shift_right(p, T.broadcast(T.uint8(4), 32)), low),
                          _x4(x32, x0 + 4 + j)))
        if vnni:
            return _dpbusd_chunks(pairs)
        # eight int16 pair sums of at most 2 * 15 * 127 each: 30480 < 2^15
        return _pairs_to_i32x8(_sum8([_maddubs32(u, i) for u, i in pairs]))

    def group_dot_wide(self, Wv, g, b, x64, x0):
        """``group_dot`` for int16 x (the LM head's; Q8_0's, ``wide_x``): ``x64`` the x
        as int64, four weights per element, from element ``x0``.  Each chunk's halves (rows
        0-3, rows 4-7: 4 quants each) are widened to int16 and multiplied pairwise with the
        chunk's 4 x, summing into one int32 per row and pair; one ``vphaddd`` joins each row's
        pairs at the unit's end (lanes then rows 0 1 4 5 2 3 6 7, put back in order).  Exact:
        32 products of at most 128 * 32767 stay below 2^31."""
        halves = [T.broadcast(T.int32(0), 8), T.broadcast(T.int32(0), 8)]
        for j in range(self.quant_bytes // 4):
            x4 = T.reinterpret("int16x16", T.broadcast(x64[x0 + j], 4))
            for h in range(2):
                byte = b * self.unit_bytes + 2 * self.fields * ROW_GROUP + 32 * j + 16 * h
                q = T.Cast("int16x16", Wv[1].vload([g, byte], "int8x16"))
                halves[h] = halves[h] + _madd16(q, x4)
        pairs = T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", *halves)
        return T.Shuffle([pairs], [0, 1, 4, 5, 2, 3, 6, 7])

    def group_unit(self, Wv, g, b, dot, xd, xsum):
        """float32x8: unit ``b``'s contribution to each row's dot product, from ``dot``
        (``group_dot``), the x block's scale ``xd`` and ``xsum`` = xd * sum(xq)."""
        d = self._field8(Wv, g, b * self.unit_bytes, 0)
        prod = T.Cast("float32x8", dot) * T.broadcast(xd, 8)
        if self.base.name == "q4_0":  # quants stored plus 8
            return d * (prod - T.broadcast(T.float32(8) * xsum, 8))
        if self.base.name == "q4_1":
            return d * prod + self._field8(Wv, g, b * self.unit_bytes, 1) * T.broadcast(xsum, 8)
        return d * prod

    def scale(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c // ROW_GROUP,
                                       b * (self.unit_bytes // 2) + c % ROW_GROUP])

    def offset(self, Wv, c, b):
        if self.base.name == "q4_1":
            return T.Cast("float32", Wv[2][c // ROW_GROUP, b * (self.unit_bytes // 2)
                                           + ROW_GROUP + c % ROW_GROUP])
        return self.scale(Wv, c, b) * T.float32(-8) if self.has_offset else None

    def dequant16(self, Wv, c, b, half):
        at = b * self.unit_bytes + 2 * self.fields * ROW_GROUP
        if self.base.name == "q8_0":
            q = T.Cast("float32x16", T.reinterpret("int8x16", self._row_bytes16(
                Wv, c, at + 128 * half)))
            return q * T.broadcast(self.scale(Wv, c, b), 16)
        w = _nibbles16(self._row_bytes16(Wv, c, at), half) * T.broadcast(self.scale(Wv, c, b), 16)
        return w + T.broadcast(self.offset(Wv, c, b), 16)


def _q5_spread_order() -> np.ndarray:
    """For each bit of a ``_Q5Rows8`` row's 32 fifth bits (bit 8 i + j of its 4 bytes), the
    weight it belongs to: bit j (j < 4) of byte i is weight 4 j + i's, bit 4 + j weight
    16 + 4 j + i's, the weights of nibble chunk j that byte i of the chunk holds."""
    i, j = np.arange(4).reshape(4, 1), np.arange(4).reshape(1, 4)
    return np.concatenate([4 * j + i, 16 + 4 * j + i], axis=1).reshape(32)


class _Q5Rows8(_Rows8):
    """Q5_0 / Q5_1 with 8 rows interleaved (``q5_0x8``, ``q5_1x8``): ``_Rows8``'s layout of the
    block's fields, then its 20 quant bytes in 4-byte chunks (chunk 0 the fifth bits, chunks
    1-4 the nibbles), each row's fifth bits reordered (``_q5_spread_order``) so that nibble
    chunk j's fifth bits are bits j (low nibbles) and 4 + j (high) of the fifth-bit chunk's
    byte under each nibble byte: two shifts and masks per chunk put them at bit 4."""

    @property
    def fields(self) -> int:
        return self.base.fields

    def _reorder(self, packed, inverse: bool):
        """Row-layout blocks with each block's fifth bits in the grouped (or, ``inverse``,
        GGUF's) order."""
        n, qh = packed.shape[0], self.base._qh
        b = np.array(packed, dtype=np.uint8).reshape(n, -1, self.block_bytes)
        bits = np.unpackbits(b[..., qh:qh + 4], axis=2, bitorder="little")
        order = _q5_spread_order()
        out = np.empty_like(bits)
        if inverse:
            out[..., order] = bits
        else:
            out = bits[..., order]
        b[..., qh:qh + 4] = np.packbits(out, axis=2, bitorder="little")
        return b.reshape(n, -1)

    def group(self, packed):
        return super().group(self._reorder(packed, False))

    def ungroup(self, grouped):
        return self._reorder(super().ungroup(grouped), True)

    def group_dot(self, Wv, g, b, x32, x0, vnni: bool = False):
        at = b * self.unit_bytes + 2 * self.fields * ROW_GROUP
        e = Wv[0].vload([g, at], "uint8x32")
        low, five = T.broadcast(T.uint8(15), 32), T.broadcast(T.uint8(16), 32)

        def shifted(v, n):
            return (T.shift_left(v, T.broadcast(T.uint8(n), 32)) if n > 0 else
                    T.shift_right(v, T.broadcast(T.uint8(-n), 32)) if n < 0 else v)
        pairs = []
        for j in range(4):
            p = Wv[0].vload([g, at + 32 * (j + 1)], "uint8x32")
            pairs.append((T.bitwise_or(T.bitwise_and(p, low),
                                       T.bitwise_and(shifted(e, 4 - j), five)),
                          _x4(x32, x0 + j)))
            pairs.append((T.bitwise_or(T.shift_right(p, T.broadcast(T.uint8(4), 32)),
                                       T.bitwise_and(shifted(e, -j), five)),
                          _x4(x32, x0 + 4 + j)))
        if vnni:
            return _dpbusd_chunks(pairs)
        t = [_maddubs32(u, i) for u, i in pairs]
        # 5-bit quants: 4 * 2 * 31 * 128 < 2^15, so four chunks at a time in int16
        return (_pairs_to_i32x8((t[0] + t[1]) + (t[2] + t[3]))
                + _pairs_to_i32x8((t[4] + t[5]) + (t[6] + t[7])))

    def group_unit(self, Wv, g, b, dot, xd, xsum):
        d = self._field8(Wv, g, b * self.unit_bytes, 0)
        prod = T.Cast("float32x8", dot) * T.broadcast(xd, 8)
        if self.fields == 1:  # Q5_0: quants stored plus 16
            return d * (prod - T.broadcast(T.float32(16) * xsum, 8))
        return d * prod + self._field8(Wv, g, b * self.unit_bytes, 1) * T.broadcast(xsum, 8)

    def offset(self, Wv, c, b):
        if self.fields == 2:
            return T.Cast("float32", Wv[2][c // ROW_GROUP, b * (self.unit_bytes // 2)
                                           + ROW_GROUP + c % ROW_GROUP])
        return self.scale(Wv, c, b) * T.float32(-16)

    def dequant16(self, Wv, c, b, half):
        at = b * self.unit_bytes + 2 * self.fields * ROW_GROUP
        e = Wv[0].vload([c // ROW_GROUP, at + 4 * (c % ROW_GROUP)], "uint8x4")
        fifth = [T.shift_left(T.bitwise_and(T.shift_right(e, T.broadcast(
            T.uint8(j + 4 * half), 4)), T.broadcast(T.uint8(1), 4)), T.broadcast(T.uint8(4), 4))
            for j in range(4)]
        q = T.bitwise_or(_nibbles_u8(self._row_bytes16(Wv, c, at + 32), half),
                         _cat(_cat(fifth[0], fifth[1], 4), _cat(fifth[2], fifth[3], 4), 8))
        return (T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b), 16)
                + T.broadcast(self.offset(Wv, c, b), 16))


class _KRows8(_Grouped):
    """Q4_K / Q5_K with 8 rows interleaved (``q4_kx8``, ``q5_kx8``).  A group's super-block: d
    for rows 0..7 (16 bytes), dmin (16), the 6-bit sub-block scales unpacked to a byte each,
    sub-block after sub-block (8 x 8 bytes), the mins likewise (64); Q5_K's 32 bytes of fifth
    bits per row next, in 4-byte chunks (chunk ``j`` holds bytes ``[4j, 4j + 4)`` of each row's
    ``qh``: 8 chunks, 256 bytes); then the nibbles in 4-byte chunks: chunk ``(p, j)`` (p = 0..3,
    j = 0..7, 32 bytes) holds bytes ``[4j, 4j + 4)`` of each row's 32 bytes of sub-blocks 2p
    (low nibbles) and 2p + 1 (high), as ``_Rows8``'s chunks.  Unit s's fifth bits for the
    weights of nibble chunk ``(s // 2, j)`` are bit s of ``qh`` chunk j.  Unpacked scales make
    a sub-block's eight scales one 8-byte load, for 4 bytes more per row's super-block (Q4_K
    4.625 bits per weight instead of 4.5, Q5_K 5.625 instead of 5.5)."""

    QH = 160  # byte of the fifth bits' chunks in a group's super-block (Q5_K)

    def __init__(self, base: WeightFormat):
        super().__init__(base, base.block_bytes + 4)

    @property
    def fifth(self) -> bool:
        return self.base.bits == 5

    @property
    def QS(self) -> int:  # byte of the nibbles in a group's super-block
        return 160 + (32 * ROW_GROUP if self.fifth else 0)

    def group(self, packed):
        n, nsb = packed.shape[0], packed.shape[1] // self.base.block_bytes
        g = n // ROW_GROUP
        b = np.ascontiguousarray(packed).reshape(g, ROW_GROUP, nsb, self.base.block_bytes)
        d = b[..., 0:4].reshape(g, ROW_GROUP, nsb, 2, 2).transpose(0, 2, 3, 1, 4)
        sc, mn = (v.reshape(g, ROW_GROUP, nsb, 8).transpose(0, 2, 3, 1).astype(np.uint8)
                  for v in _k_scales_mins(b[..., 4:16].reshape(-1, 12)))
        at = self.base._qs
        parts = [d, sc, mn]
        if self.fifth:
            parts.append(b[..., 16:48].reshape(g, ROW_GROUP, nsb, 8, 4).transpose(0, 2, 3, 1, 4))
        parts.append(b[..., at:].reshape(g, ROW_GROUP, nsb, 4, 8, 4).transpose(0, 2, 3, 4, 1, 5))
        parts = [a.reshape(g, nsb, -1) for a in parts]
        return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(g, -1))

    def ungroup(self, grouped):
        g, nsb = grouped.shape[0], grouped.shape[1] // self.unit_bytes
        u = np.ascontiguousarray(grouped).reshape(g, nsb, self.unit_bytes)
        d = u[..., 0:32].reshape(g, nsb, 2, ROW_GROUP, 2).transpose(0, 3, 1, 2, 4)
        sc, mn = (u[..., at:at + 64].reshape(g, nsb, 8, ROW_GROUP).transpose(0, 3, 1, 2)
                  for at in (32, 96))
        scales = _k_pack_scales(sc.reshape(-1, 8), mn.reshape(-1, 8))
        rows = [d.reshape(g, ROW_GROUP, nsb, 4), scales.reshape(g, ROW_GROUP, nsb, 12)]
        if self.fifth:
            qh = u[..., self.QH:self.QS].reshape(g, nsb, 8, ROW_GROUP, 4).transpose(
                0, 3, 1, 2, 4)
            rows.append(qh.reshape(g, ROW_GROUP, nsb, 32))
        qs = u[..., self.QS:].reshape(g, nsb, 4, 8, ROW_GROUP, 4).transpose(0, 4, 1, 2, 3, 5)
        rows.append(qs.reshape(g, ROW_GROUP, nsb, 128))
        rows = np.concatenate(rows, axis=3)
        return np.ascontiguousarray(rows.reshape(g * ROW_GROUP, nsb * self.base.block_bytes))

    def _quants(self, load, s: int, j: int, lanes: int):
        """uint8 x ``lanes``: sub-block s's quants in nibble chunk j (``load(at, j)`` reads
        chunk j of the nibbles at ``at`` or of the fifth bits at ``QH``)."""
        q = T.bitwise_and(T.shift_right(load(self.QS + (s // 2) * 256, j), T.broadcast(
            T.Cast("uint8", (s % 2) * 4), lanes)), T.broadcast(T.uint8(15), lanes))
        if not self.fifth:
            return q
        # bit s of the qh byte to bit 4 (s a constant in the GEMVs: LLVM folds the shifts)
        h = T.bitwise_and(T.shift_right(load(self.QH, j), T.broadcast(T.Cast("uint8", s), lanes)),
                          T.broadcast(T.uint8(1), lanes))
        return T.bitwise_or(q, T.shift_left(h, T.broadcast(T.uint8(4), lanes)))

    # TIR: unit b is sub-block s = b % 8 of super-block b // 8 (the kernels step whole
    # super-blocks, so s is a constant)
    def group_dot(self, Wv, g, b, x32, x0, vnni: bool = False):
        base, s = (b // 8) * self.unit_bytes, b % 8
        pairs = [(self._quants(lambda at, j: Wv[0].vload([g, base + at + 32 * j], "uint8x32"),
                               s, j, 32), _x4(x32, x0 + j)) for j in range(8)]
        if vnni:
            return _dpbusd_chunks(pairs)
        t = [_maddubs32(u, i) for u, i in pairs]
        if not self.fifth:  # int16 pair sums as _Rows8's Q4: 8 * 2 * 15 * 127 < 2^15
            return _pairs_to_i32x8(_sum8(t))
        # 5-bit quants: 4 * 2 * 31 * 127 < 2^15, so four chunks at a time in int16
        return (_pairs_to_i32x8((t[0] + t[1]) + (t[2] + t[3]))
                + _pairs_to_i32x8((t[4] + t[5]) + (t[6] + t[7])))

    def group_unit(self, Wv, g, b, dot, xd, xsum):
        base, s = (b // 8) * self.unit_bytes, b % 8

        def sub(at):
            return T.Cast("float32x8", Wv[0].vload([g, base + at + 8 * s], "uint8x8"))

        return (self._field8(Wv, g, base, 0) * sub(32)) * (
            T.Cast("float32x8", dot) * T.broadcast(xd, 8)) - (
            self._field8(Wv, g, base, 1) * sub(96)) * T.broadcast(xsum, 8)

    def _sub(self, Wv, c, b, at):
        return T.Cast("float32", Wv[0][c // ROW_GROUP, (b // 8) * self.unit_bytes + at
                                       + 8 * (b % 8) + c % ROW_GROUP])

    def scale(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c // ROW_GROUP, (b // 8) * (self.unit_bytes // 2)
                                       + c % ROW_GROUP]) * self._sub(Wv, c, b, 32)

    def offset(self, Wv, c, b):
        return -(T.Cast("float32", Wv[2][c // ROW_GROUP, (b // 8) * (self.unit_bytes // 2)
                                         + ROW_GROUP + c % ROW_GROUP]) * self._sub(Wv, c, b, 96))

    def dequant16(self, Wv, c, b, half):
        base = (b // 8) * self.unit_bytes + 128 * half
        q = self._quants(lambda at, j: self._row_bytes16(Wv, c, base + at), b % 8, 0, 16)
        return (T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b), 16)
                + T.broadcast(self.offset(Wv, c, b), 16))


class _Q6KRows8(_Grouped):
    """Q6_K with 8 rows interleaved (``q6_kx8``).  A group's super-block (8 x 210 bytes, no
    padding): d for rows 0..7 (16 bytes), the sixteen int8 sub-block scales, sub-block after
    sub-block, 8 rows side by side (128), then the 128 bytes of low nibbles in 4-byte chunks
    (chunk ``k`` holds bytes ``[4k, 4k + 4)`` of each row's ``ql``: 32 chunks), then the 64
    bytes of high bit pairs likewise (``qh``: 16 chunks).  Unit ``s`` of a super-block (weights
    ``32 s`` on; ``h, p = divmod(s, 4)``) takes nibbles ``(p // 2) * 4`` of ``ql`` chunks
    ``(2 h + p % 2) * 8 + j`` and bits ``2 p`` of ``qh`` chunks ``8 h + j``, j = 0..7, as
    ggml's own layout does by rows.  A 16-weight half's sum of (q - 32) x is taken as sum q x -
    32 sum x (q, 0..63, the unsigned operand of ``vpdpbusd`` / ``vpmaddubsw``) and scaled by
    its int8 sub-scale in int32."""

    QL, QH = 144, 1168  # bytes of the nibbles and the bit pairs in a group's super-block

    def __init__(self, base: WeightFormat):
        super().__init__(base, base.block_bytes)

    def group(self, packed):
        n, nsb = packed.shape[0], packed.shape[1] // self.base.block_bytes
        g = n // ROW_GROUP
        b = np.ascontiguousarray(packed).reshape(g, ROW_GROUP, nsb, self.base.block_bytes)
        d = b[..., 208:210].transpose(0, 2, 1, 3)
        sc = b[..., 192:208].transpose(0, 2, 3, 1)
        ql = b[..., 0:128].reshape(g, ROW_GROUP, nsb, 32, 4).transpose(0, 2, 3, 1, 4)
        qh = b[..., 128:192].reshape(g, ROW_GROUP, nsb, 16, 4).transpose(0, 2, 3, 1, 4)
        parts = [a.reshape(g, nsb, -1) for a in (d, sc, ql, qh)]
        return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(g, -1))

    def ungroup(self, grouped):
        g, nsb = grouped.shape[0], grouped.shape[1] // self.unit_bytes
        u = np.ascontiguousarray(grouped).reshape(g, nsb, self.unit_bytes)
        d = u[..., 0:16].reshape(g, nsb, ROW_GROUP, 2).transpose(0, 2, 1, 3)
        sc = u[..., 16:self.QL].reshape(g, nsb, 16, ROW_GROUP).transpose(0, 3, 1, 2)
        ql = u[..., self.QL:self.QH].reshape(g, nsb, 32, ROW_GROUP, 4).transpose(0, 3, 1, 2, 4)
        qh = u[..., self.QH:].reshape(g, nsb, 16, ROW_GROUP, 4).transpose(0, 3, 1, 2, 4)
        rows = np.concatenate([ql.reshape(g, ROW_GROUP, nsb, 128),
                               qh.reshape(g, ROW_GROUP, nsb, 64),
                               sc.reshape(g, ROW_GROUP, nsb, 16),
                               d.reshape(g, ROW_GROUP, nsb, 2)], axis=3)
        return np.ascontiguousarray(rows.reshape(g * ROW_GROUP, nsb * self.base.block_bytes))

    # TIR: unit b is unit s = b % 8 of super-block b // 8 (the kernels step whole super-blocks,
    # so s, and with it every shift and chunk index below, is a constant)
    def _where(self, b):
        s = b % 8
        return (b // 8) * self.unit_bytes, s // 4, s % 4

    def _quants(self, load, b, j: int, lanes: int):
        """uint8 x ``lanes``: quants 0..63 of unit b's chunk j (``load(byte)`` reads from a
        chunk's start)."""
        base, h, p = self._where(b)
        nib = T.bitwise_and(T.shift_right(load(base + self.QL + 32 * ((2 * h + p % 2) * 8 + j)),
                                          T.broadcast(T.Cast("uint8", (p // 2) * 4), lanes)),
                            T.broadcast(T.uint8(15), lanes))
        two = T.bitwise_and(T.shift_right(load(base + self.QH + 32 * (8 * h + j)),
                                          T.broadcast(T.Cast("uint8", 2 * p), lanes)),
                            T.broadcast(T.uint8(3), lanes))
        return T.bitwise_or(nib, T.shift_left(two, T.broadcast(T.uint8(4), lanes)))

    def _sub_at(self, b, half: int):
        """The byte of the 8 rows' int8 scales of unit b's weights ``[16 half, 16 half + 16)``
        in their group's row."""
        return (b // 8) * self.unit_bytes + 16 + 8 * (2 * (b % 8) + half)

    def _sub_scales8(self, Wv, g, b, half: int):
        """int32x8: the 8 rows' scales of unit b's half ``half``."""
        return T.Cast("int32x8", Wv[1].vload([g, self._sub_at(b, half)], "int8x8"))

    @property
    def half_sums(self) -> bool:
        return True

    def group_dot(self, Wv, g, b, x32, x0, vnni: bool = False, *, neg):
        # sum (q - 32) x per half as sum q x - 32 sum x: q (0..63) is the unsigned operand as
        # it is; each half's chain starts from its -32 sum x, which the kernels' quantizer
        # stored with x (``neg``: computed per unit and token, it cost a Q6_K x8 tile about a
        # third of its instructions)
        q = [self._quants(lambda at: Wv[0].vload([g, at], "uint8x32"), b, j, 32)
             for j in range(8)]
        if vnni:  # each half's chain starts from its -32 sum x
            parts = []
            for h in (0, 1):
                acc = neg[h]
                for j in range(4 * h, 4 * h + 4):
                    acc = _dpbusd(acc, q[j], _x4(x32, x0 + j))
                parts.append(acc)
        else:  # int16 pair sums of q x: at most 2 * 2 * 63 * 127 = 32004 < 2^15 per two chunks
            t = [_maddubs32(q[j], _x4(x32, x0 + j)) for j in range(8)]
            parts = [_pairs_to_i32x8(t[h] + t[h + 1]) + _pairs_to_i32x8(t[h + 2] + t[h + 3])
                     + neg[h // 4] for h in (0, 4)]
        return (parts[0] * self._sub_scales8(Wv, g, b, 0)
                + parts[1] * self._sub_scales8(Wv, g, b, 1))

    @property
    def wide_x(self) -> bool:
        return True

    def group_dot_wide(self, Wv, g, b, x64, x0):
        """``group_dot`` for int16 x (a Q6_K LM head's; ``x64`` as ``_Rows8.group_dot_wide``
        takes it), float32x8.  The quants less 32 (-32..31) are signed, so each chunk's halves
        (rows 0-3, rows 4-7) widen to int16 and multiply pairwise with the chunk's 4 x
        (``vpmaddwd``); one ``vphaddd`` per 16-weight half joins each row's pairs.  A half's
        sum times its int8 scale stays in int32 (16 x 32 x 32767 x 128 < 2^31); the two
        halves add in float32, where their int32 sum could overflow."""
        halves = []
        for half in (0, 1):
            acc = [T.broadcast(T.int32(0), 8), T.broadcast(T.int32(0), 8)]
            for j in range(4 * half, 4 * half + 4):
                q = T.reinterpret("int8x32", self._quants(
                    lambda at: Wv[0].vload([g, at], "uint8x32"), b, j, 32)) - T.broadcast(
                    T.int8(32), 32)
                x4 = T.reinterpret("int16x16", T.broadcast(x64[x0 + j], 4))
                for r in (0, 1):
                    q16 = T.Cast("int16x16", T.Shuffle([q], list(range(16 * r, 16 * r + 16))))
                    acc[r] = acc[r] + _madd16(q16, x4)
            pairs = T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", *acc)
            rows = T.Shuffle([pairs], [0, 1, 4, 5, 2, 3, 6, 7])
            halves.append(T.Cast("float32x8", rows * self._sub_scales8(Wv, g, b, half)))
        return halves[0] + halves[1]

    def group_unit(self, Wv, g, b, dot, xd, xsum):
        return self._field8(Wv, g, (b // 8) * self.unit_bytes, 0) * (
            T.Cast("float32x8", dot) * T.broadcast(xd, 8))

    def scale(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c // ROW_GROUP, (b // 8) * (self.unit_bytes // 2)
                                       + c % ROW_GROUP])

    def dequant16(self, Wv, c, b, half):
        q = T.reinterpret("int8x16", self._quants(
            lambda at: self._row_bytes16(Wv, c, at + 128 * half), b, 0, 16)) - T.broadcast(
            T.int8(32), 16)
        sub = T.Cast("float32", Wv[1][c // ROW_GROUP, self._sub_at(b, half) + c % ROW_GROUP])
        return T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b) * sub, 16)


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _Float("float32", 4, "F32"),
    _Float("float16", 2, "F16"),
    _Q8_0("q8_0", 34, "Q8_0"),
    _Q4_0("q4_0", 18, "Q4_0"),
    _Q4_1("q4_1", 20, "Q4_1"),
    _Q5_0("q5_0", 22, "Q5_0"),
    _Q5_1("q5_1", 24, "Q5_1"),
    _Q4_K("q4_k", 144, "Q4_K"),
    _Q5_K("q5_k", 176, "Q5_K"),
    _Q6_K("q6_k", 210, "Q6_K"),
)}
# the interleaved layouts: chosen per matrix for CPU targets (``interleaved``), never asked for
INTERLEAVED = {f.base.name: f for f in (
    *(_Rows8(FORMATS[n]) for n in ("q8_0", "q4_0", "q4_1")),
    *(_Q5Rows8(FORMATS[n]) for n in ("q5_0", "q5_1")),
    *(_KRows8(FORMATS[n]) for n in ("q4_k", "q5_k")), _Q6KRows8(FORMATS["q6_k"]))}
USER_FORMATS = tuple(FORMATS)  # what --weight-dtype takes
FORMATS.update({f.name: f for f in INTERLEAVED.values()})
FLOAT_FORMATS = ("float32", "float16")
QUANT_FORMATS = tuple(n for n in USER_FORMATS if FORMATS[n].quantized)


def interleaved(name: str, fmt: str, rows: int, gate_up_inter: int | None = None,
                tied: bool = False) -> str:
    """The format matrix ``name`` of ``rows`` rows in ``fmt`` takes on a CPU target: its
    interleaved layout where one exists and whole groups of rows fit (``w_gate_up``: its gate
    and up runs too, ``gate_up_inter`` act rows), else ``fmt``.  The LM head (``lm_head``, or
    the embedding where ``tied``) reads int16 x, so it is interleaved only in a layout whose
    kernels take it (``wide_x``: Q8_0, Q6_K); an embedding that is not the head keeps rows (it
    is read by rows)."""
    x8 = INTERLEAVED.get(fmt)
    if x8 is None or rows % ROW_GROUP:
        return fmt
    if name == "lm_head" or (name == "embed" and tied):
        return x8.name if x8.wide_x else fmt
    if name == "embed":
        return fmt
    if gate_up_inter is not None and gate_up_inter % ROW_GROUP:
        return fmt
    return x8.name


def by_gguf_type(type_name: str) -> WeightFormat | None:
    """The format stored exactly like a GGUF tensor type (by its GGMLQuantizationType name)."""
    return next((FORMATS[n] for n in USER_FORMATS if FORMATS[n].gguf_type == type_name), None)
