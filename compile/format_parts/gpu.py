"""The GPU kernels' pieces of each weight format: portable scalar TIR over the stored matrix as
uint8 (no vector intrinsics, no float16 loads, which pocl's OpenCL lacks), from which
``kernels/gpu/`` builds its kernels.  Weight ``j`` (0..31) of unit ``b`` of row ``c`` is
``unit_scale(.., j // 16) * quant(.., j) + unit_offset(..)``; every index may be an
expression.  Each class holds one format's pieces and reads its layout from the codec class
``compile/formats.py`` joins it with."""

from __future__ import annotations

from tvm.script import tirx as T

from .codec import QBLOCK


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


class GpuPieces:
    """The pieces the GPU kernels call, over ``W8``, the stored matrix as uint8."""

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


class FloatGpu(GpuPieces):
    def weight(self, W, c, k):
        """float32: weight ``k`` of row ``c``: a float32 / float16 element cast, a bfloat16 one
        from its 2 stored bytes (bits << 16, exact), as bytes like every format here."""
        if self.name != "bfloat16":
            return T.Cast("float32", W[c, k])
        bits = T.bitwise_or(T.Cast("uint32", W[c, 2 * k]),
                            T.shift_left(T.Cast("uint32", W[c, 2 * k + 1]), T.uint32(8)))
        return T.reinterpret("float32", T.shift_left(bits, T.uint32(16)))


class Q8_0Gpu(GpuPieces):
    def quant(self, W8, c, b, j):
        return _i8_scalar(W8, c, b * 34 + 2 + j)


class Q4_0Gpu(GpuPieces):
    def unit_offset(self, W8, c, b):
        return self.unit_scale(W8, c, b, 0) * T.float32(-8)

    def quant(self, W8, c, b, j):
        return _nibble_scalar(W8, c, b * 18 + 2, j)


class Q4_1Gpu(GpuPieces):
    def unit_offset(self, W8, c, b):
        return _f16_scalar(W8, c, b * 20 + 2)

    def quant(self, W8, c, b, j):
        return _nibble_scalar(W8, c, b * 20 + 4, j)


class Q5Gpu(GpuPieces):
    def quant(self, W8, c, b, j):
        at = b * self.block_bytes
        fifth = T.bitwise_and(T.shift_right(_byte(W8, c, at + self._qh + j // 8), j % 8), 1)
        return T.bitwise_or(_nibble_scalar(W8, c, at + self._qs, j), T.shift_left(fifth, 4))


class Q5_0Gpu(Q5Gpu):
    def unit_offset(self, W8, c, b):
        return self.unit_scale(W8, c, b, 0) * T.float32(-16)


class Q5_1Gpu(Q5Gpu):
    def unit_offset(self, W8, c, b):
        return _f16_scalar(W8, c, b * 24 + 2)


class KMinGpu(GpuPieces):
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


class Q6_KGpu(GpuPieces):
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


class GroupedGpu(GpuPieces):
    # the GPUs never get these layouts (``interleaved``)
    def unit_scale(self, W8, c, b, half):
        raise NotImplementedError(f"{self.name} is a CPU layout")

    def unit_offset(self, W8, c, b):
        raise NotImplementedError(f"{self.name} is a CPU layout")

    def quant(self, W8, c, b, j):
        raise NotImplementedError(f"{self.name} is a CPU layout")
