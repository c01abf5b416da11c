"""The CPU kernels' pieces of each weight format by rows: vector TIR (AVX2) over the bytes
``codec`` stores, from which ``kernels/cpu/quant.py`` builds its kernels (``dequant16``,
``int_dot``, ``wide16`` / ``wide_dot``, ``scale``, ``offset``).  Each class holds one format's
pieces and reads its layout (``block_bytes``, ``fields``, ...) from the codec class
``compile/formats.py`` joins it with; ``KMinCpu`` decodes single 6-bit scales with
``gpu.KMinGpu``'s scalar pieces, joined into the same object."""

from __future__ import annotations

from tvm.script import tirx as T


def _u8x16(Wv, c, byte):
    return Wv[0].vload([c, byte], "uint8x16")


def cat(lo, hi, lanes: int = 16):
    """The 2 * ``lanes``-lane vector of two ``lanes``-lane ones."""
    return T.Shuffle([lo, hi], list(range(2 * lanes)))


def maddubs32(u8, i8):
    """int16x16: ``pmaddubsw`` on 256 bits (AVX2)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u8, i8)


def pairs_to_i32x8(p):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p,
                                   T.broadcast(T.int16(1), 16))


def _nibble_dot(q, xq, x0):
    """int32x8 over one 32-weight block of 16 packed bytes: low nibbles (weights 0-15) and high
    nibbles (16-31) side by side in one 256-bit register, against the block's 32 int8 x."""
    both = cat(T.bitwise_and(q, T.broadcast(T.uint8(15), 16)),
                T.shift_right(q, T.broadcast(T.uint8(4), 16)))
    return pairs_to_i32x8(maddubs32(both, xq.vload([x0], "int8x32")))


def madd16(a, b):
    """int32x8: adjacent pairs of int16 products added (AVX2 ``vpmaddwd``)."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def nibbles_u8(q, half: int):
    return (T.bitwise_and(q, T.broadcast(T.uint8(15), 16)) if half == 0
            else T.shift_right(q, T.broadcast(T.uint8(4), 16)))


def nibbles16(q, half: int):
    return T.Cast("float32x16", nibbles_u8(q, half))


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


class CpuPieces:
    """The pieces the CPU kernels call: defaults that formats share, else NotImplementedError
    (the floats have none: the float kernels read them)."""

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
        return madd16(self.wide16(Wv, c, b, 0), x16.vload([x0], "int16x16")) + madd16(
            self.wide16(Wv, c, b, 1), x16.vload([x0 + 16], "int16x16"))


class FloatCpu(CpuPieces):
    """The float formats' pieces: the float kernels (``kernels/cpu/gemv.py``, ``linear.py``,
    ``batch.py``, ``norm.py``) read a stored matrix through ``elements`` (one element a weight)
    and take each element to float32 with ``widen``."""

    @property
    def element_dtype(self) -> str:
        """The dtype of one weight as the kernels load it (bfloat16: its uint16 pattern)."""
        return "uint16" if self.name == "bfloat16" else self.name

    def elements(self, W):
        """W as ``(rows, K)`` weights of ``element_dtype``: itself, or bfloat16's ``(rows,
        2 K)`` bytes viewed as uint16."""
        if self.name != "bfloat16":
            return W
        return T.decl_buffer((W.shape[0], W.shape[1] // 2), "uint16", data=W.data)

    def widen(self, v):
        """float32 of a scalar element of ``elements`` (the kernels' vectorized loops make it a
        vector op): bfloat16's pattern shifted into the high half of a float32, exact."""
        if self.name != "bfloat16":
            return T.Cast("float32", v)
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", v), T.uint32(16)))


class Q8_0Cpu(CpuPieces):
    def dequant16(self, Wv, c, b, half):
        q = Wv[1].vload([c, b * 34 + 2 + 16 * half], "int8x16")
        return T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        q = Wv[1].vload([c, b * 34 + 2], "int8x32")
        s = T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b",
                                    xq.vload([x0], "int8x32"), q)
        # pair sums reach 2 * 128 * 127 < 2^15: no pmaddubsw saturation
        return pairs_to_i32x8(maddubs32(T.reinterpret("uint8x32", T.abs(q)), s))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", Wv[1].vload([c, b * 34 + 2 + 16 * half], "int8x16"))


class Q4_0Cpu(CpuPieces):
    def dequant16(self, Wv, c, b, half):
        q = nibbles16(_u8x16(Wv, c, b * 18 + 2), half) - T.broadcast(T.float32(8), 16)
        return q * T.broadcast(self.scale(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        return _nibble_dot(_u8x16(Wv, c, b * 18 + 2), xq, x0)

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", nibbles_u8(_u8x16(Wv, c, b * 18 + 2), half))

    def offset(self, Wv, c, b):
        return self.scale(Wv, c, b) * T.float32(-8)


class Q4_1Cpu(CpuPieces):
    def dequant16(self, Wv, c, b, half):
        q = nibbles16(_u8x16(Wv, c, b * 20 + 4), half)
        return q * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16)

    def int_dot(self, Wv, c, b, xq, x0):
        return _nibble_dot(_u8x16(Wv, c, b * 20 + 4), xq, x0)

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", nibbles_u8(_u8x16(Wv, c, b * 20 + 4), half))

    def offset(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, b * 10 + 1])


class Q5Cpu(CpuPieces):
    def _fifth(self, Wv, c, b, lanes: int, first: int = 0):
        return _fifth_bits(T.shift_right(_u32_at(Wv[0], c, b * self.block_bytes + self._qh),
                                         T.uint32(first)), lanes)

    def _quants32(self, Wv, c, b):
        q = _u8x16(Wv, c, b * self.block_bytes + self._qs)
        both = cat(T.bitwise_and(q, T.broadcast(T.uint8(15), 16)),
                    T.shift_right(q, T.broadcast(T.uint8(4), 16)))
        return T.bitwise_or(both, self._fifth(Wv, c, b, 8))

    def _quants16(self, Wv, c, b, half: int):
        return T.bitwise_or(nibbles_u8(_u8x16(Wv, c, b * self.block_bytes + self._qs), half),
                            self._fifth(Wv, c, b, 4, 16 * half))

    def int_dot(self, Wv, c, b, xq, x0):
        # pair sums reach 2 * 31 * 128 < 2^15: no pmaddubsw saturation
        return pairs_to_i32x8(maddubs32(self._quants32(Wv, c, b), xq.vload([x0], "int8x32")))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", self._quants16(Wv, c, b, half))

    def dequant16(self, Wv, c, b, half):
        q = T.Cast("float32x16", self._quants16(Wv, c, b, half))
        return q * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16)


class Q5_0Cpu(Q5Cpu):
    def offset(self, Wv, c, b):
        return self.scale(Wv, c, b) * T.float32(-16)


class Q5_1Cpu(Q5Cpu):
    def offset(self, Wv, c, b):
        return T.Cast("float32", Wv[2][c, b * 12 + 1])


class KMinCpu(CpuPieces):
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
            q = cat(T.bitwise_and(m, lanes(63)), T.bitwise_or(
                T.shift_right(md, lanes(4)), T.shift_left(T.shift_right(m, lanes(6)), lanes(4))), 4)
            return T.Cast("float32x8", q) * T.broadcast(
                -T.Cast("float32", Wv[2][c, base // 2 + 1]), 8)
        q = cat(T.bitwise_and(d, lanes(63)), T.bitwise_or(
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
        return pairs_to_i32x8(maddubs32(self._quants16(Wv, c, b, 0, 32),
                                          xq.vload([x0], "int8x32")))

    def dequant16(self, Wv, c, b, half):
        return (T.Cast("float32x16", self._quants16(Wv, c, b, half))
                * T.broadcast(self.scale(Wv, c, b), 16) + T.broadcast(self.offset(Wv, c, b), 16))

    def wide16(self, Wv, c, b, half):
        return T.Cast("int16x16", self._quants16(Wv, c, b, half))


class Q6_KCpu(CpuPieces):
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
        p = (maddubs32(self._quants16(Wv, c, b, 0, 32), x)
             - maddubs32(T.broadcast(T.uint8(32), 32), x))
        sc = [T.broadcast(T.Cast("int16", self._sub_scale(Wv, c, b, h)), 8) for h in (0, 1)]
        return madd16(p, cat(sc[0], sc[1], 8))

    def wide_dot(self, Wv, c, b, x16, x0):
        # per half: sum (q - 32) x in int32 (|lane| <= 2 * 32 * 32767), times its int8 sub-scale
        def part(h):
            q = T.Cast("int16x16", self._quants16(Wv, c, b, h)) - T.broadcast(T.int16(32), 16)
            return madd16(q, x16.vload([x0 + 16 * h], "int16x16")) * T.broadcast(
                T.Cast("int32", self._sub_scale(Wv, c, b, h)), 8)
        return part(0) + part(1)
