"""Weight formats with 8 rows interleaved, the CPU layouts: their codec (no TVM).

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
"""

from __future__ import annotations

import numpy as np

from .codec import QBLOCK, WeightFormat, k_pack_scales, k_scales_mins

ROW_GROUP = 8  # rows per group of an interleaved layout: one 256-bit vector of float32 sums


def _q5_spread_order() -> np.ndarray:
    """For each bit of a ``_Q5Rows8`` row's 32 fifth bits (bit 8 i + j of its 4 bytes), the
    weight it belongs to: bit j (j < 4) of byte i is weight 4 j + i's, bit 4 + j weight
    16 + 4 j + i's, the weights of nibble chunk j that byte i of the chunk holds."""
    i, j = np.arange(4).reshape(4, 1), np.arange(4).reshape(1, 4)
    return np.concatenate([4 * j + i, 16 + 4 * j + i], axis=1).reshape(32)


class Grouped(WeightFormat):
    """A base format's blocks with ``ROW_GROUP`` rows interleaved (``base``): stored
    ``(N / 8, K / block * unit_bytes)``, each group's block ``k`` the eight rows' block ``k``
    regrouped (``group`` / ``ungroup``, lossless).  The CPU kernels' pieces work on a whole
    group: ``group_dot`` (a 32-weight unit's integer dot products, lane r = row r) and
    ``group_unit`` (their float contribution); the float tile over decoded weights reads it
    by rows (``scale``, ``offset``, ``dequant16``, each row's bytes gathered from the chunks).
    CPU only: the GPUs' scalar pieces are not defined here."""

    grouped = True

    def __init__(self, base: WeightFormat, block_bytes: int, suffix: str):
        super().__init__(base.name + suffix, block_bytes, base.gguf_type)
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


class Rows8(Grouped):
    """Q8_0 / Q4_0 / Q4_1 with 8 rows interleaved (``q8_0x8``, ...).  A group's unit ``b``:
    first each float16 field of the block (d; Q4_1: d then m) for rows 0..7 (16 bytes per
    field), then the quants in 4-byte chunks: chunk ``j`` holds bytes ``[4j, 4j + 4)`` of each
    row's quant bytes, row after row (32 bytes; Q4 blocks have 4 chunks, whose low nibbles
    are weights 4j + i and high ones 16 + 4j + i, Q8_0 8).  One 256-bit load of a chunk is 8
    rows x 4 quants, so a ``vpmaddubsw`` against 4 bytes of x broadcast gives every row's
    partial sum in its own lanes: the eight rows share the unpacking, the conversion and the
    scale, and no horizontal reduction remains (docs/design.md: Quantized weights)."""

    def __init__(self, base: WeightFormat, suffix: str):
        super().__init__(base, base.block_bytes, suffix)

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


class Q5Rows8(Rows8):
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


class KRows8(Grouped):
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

    def __init__(self, base: WeightFormat, suffix: str):
        super().__init__(base, base.block_bytes + 4, suffix)

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
                  for v in k_scales_mins(b[..., 4:16].reshape(-1, 12)))
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
        scales = k_pack_scales(sc.reshape(-1, 8), mn.reshape(-1, 8))
        rows = [d.reshape(g, ROW_GROUP, nsb, 4), scales.reshape(g, ROW_GROUP, nsb, 12)]
        if self.fifth:
            qh = u[..., self.QH:self.QS].reshape(g, nsb, 8, ROW_GROUP, 4).transpose(
                0, 3, 1, 2, 4)
            rows.append(qh.reshape(g, ROW_GROUP, nsb, 32))
        qs = u[..., self.QS:].reshape(g, nsb, 4, 8, ROW_GROUP, 4).transpose(0, 4, 1, 2, 3, 5)
        rows.append(qs.reshape(g, ROW_GROUP, nsb, 128))
        rows = np.concatenate(rows, axis=3)
        return np.ascontiguousarray(rows.reshape(g * ROW_GROUP, nsb * self.base.block_bytes))


class Q6KRows8(Grouped):
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

    def __init__(self, base: WeightFormat, suffix: str):
        super().__init__(base, base.block_bytes, suffix)

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
