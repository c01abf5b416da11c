"""The CPU kernels' pieces of the layouts with 8 rows interleaved (``codec_x8``): vector TIR
(AVX2, VNNI where the target has it) whose lanes are a group's 8 rows (``group_dot``,
``group_unit``, ``group_dot_wide``), and the row-wise pieces the float tile reads them by."""

from __future__ import annotations

from tvm.script import tirx as T

from .codec_x8 import ROW_GROUP
from .cpu import CpuPieces, cat, madd16, maddubs32, nibbles16, nibbles_u8, pairs_to_i32x8


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


class GroupedCpu(CpuPieces):
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

    def _field8(self, Wv, g, base, field: int):
        """float32x8: float16 field ``field`` of the 8 rows at the block's byte ``base``."""
        return T.Cast("float32x8", Wv[2].vload([g, base // 2 + field * ROW_GROUP], "float16x8"))

    # row-wise pieces for the float tile over decoded weights (prefill of short rows): row c is
    # row c % 8 of group c // 8, its quant bytes gathered 4 at a time from the chunks
    def _row_bytes16(self, Wv, c, at):
        """uint8x16: row c's 4 bytes in each of the 4 chunks of 32 bytes from byte ``at``."""
        four = [Wv[0].vload([c // ROW_GROUP, at + 32 * j + 4 * (c % ROW_GROUP)], "uint8x4")
                for j in range(4)]
        return cat(cat(four[0], four[1], 4), cat(four[2], four[3], 4), 8)


class Rows8Cpu(GroupedCpu):
    @property
    def wide_x(self) -> bool:
        return self.base.name == "q8_0"

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
            return _sum8([pairs_to_i32x8(maddubs32(u, i)) for u, i in pairs])
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
        return pairs_to_i32x8(_sum8([maddubs32(u, i) for u, i in pairs]))

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
                halves[h] = halves[h] + madd16(q, x4)
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
        w = nibbles16(self._row_bytes16(Wv, c, at), half) * T.broadcast(self.scale(Wv, c, b), 16)
        return w + T.broadcast(self.offset(Wv, c, b), 16)


class Q5Rows8Cpu(Rows8Cpu):
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
        t = [maddubs32(u, i) for u, i in pairs]
        # 5-bit quants: 4 * 2 * 31 * 128 < 2^15, so four chunks at a time in int16
        return (pairs_to_i32x8((t[0] + t[1]) + (t[2] + t[3]))
                + pairs_to_i32x8((t[4] + t[5]) + (t[6] + t[7])))

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
        q = T.bitwise_or(nibbles_u8(self._row_bytes16(Wv, c, at + 32), half),
                         cat(cat(fifth[0], fifth[1], 4), cat(fifth[2], fifth[3], 4), 8))
        return (T.Cast("float32x16", q) * T.broadcast(self.scale(Wv, c, b), 16)
                + T.broadcast(self.offset(Wv, c, b), 16))


class KRows8Cpu(GroupedCpu):
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
        t = [maddubs32(u, i) for u, i in pairs]
        if not self.fifth:  # int16 pair sums as _Rows8's Q4: 8 * 2 * 15 * 127 < 2^15
            return pairs_to_i32x8(_sum8(t))
        # 5-bit quants: 4 * 2 * 31 * 127 < 2^15, so four chunks at a time in int16
        return (pairs_to_i32x8((t[0] + t[1]) + (t[2] + t[3]))
                + pairs_to_i32x8((t[4] + t[5]) + (t[6] + t[7])))

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


class Q6KRows8Cpu(GroupedCpu):
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
            t = [maddubs32(q[j], _x4(x32, x0 + j)) for j in range(8)]
            parts = [pairs_to_i32x8(t[h] + t[h + 1]) + pairs_to_i32x8(t[h + 2] + t[h + 3])
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
                    acc[r] = acc[r] + madd16(q16, x4)
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
