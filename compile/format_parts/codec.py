"""Weight formats as stored: the numpy / GGUF codec of each format by rows (no TVM).

A format knows how a ``[N, K]`` matrix is stored in the weight pack (``storage``), its bytes per
weight, how to make it from float32 (``quantize``) and read it back (``dequantize``), bit for
bit as the ``gguf`` package does; the k-quants' quantizer is ggml's reference one, a host TIR
kernel (``kquant``) imported where a k-quant is quantized.  ``codec_x8`` holds the CPU layouts
with 8 rows interleaved, ``cpu`` / ``cpu_x8`` and ``gpu`` the kernels' pieces over the bytes
(vector TIR for the CPU, portable scalar TIR for the GPUs); ``compile/formats.py`` joins them
into one object per format, in ``FORMATS``, where the kernels, the parameter layout, the
weight loader and the quantizer look formats up by name.

On CPU targets (``interleaved``) the matrices in Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K /
Q6_K take the same blocks with 8 rows interleaved (``q8_0x8``, ``q4_0x8``, ``q4_1x8``,
``q5_0x8``, ``q5_1x8``, ``q4_kx8``, ``q5_kx8``, ``q6_kx8``; ``_Rows8``, ``_Q5Rows8``,
``_KRows8``, ``_Q6KRows8``): a lossless regrouping made when the pack is written, which the CPU
kernels read 8 rows per vector.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QBLOCK = 32  # weights per kernel unit; the block of the 32-weight formats
QK_K = 256  # weights per super-block of the k-quants
FLOAT_NAMES = ("float32", "float16", "bfloat16")  # the unquantized formats, one value a weight


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


def k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes -> (n, 8) 6-bit scales and (n, 8) mins (``get_scale_min_k4``)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc, mn


def k_pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of :func:`k_scales_mins`: (n, 8) values 0..63 each -> (n, 12) bytes."""
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
        return self.name not in FLOAT_NAMES

    @property
    def byte_rows(self) -> bool:
        """Whether the pack stores the matrix as its rows' bytes (uint8): a quantized format's
        blocks, bfloat16's 2-byte values (numpy and the pack's safetensors reader have no
        bfloat16), copied as they are from a GGUF tensor of the same ``gguf_type``."""
        return self.quantized

    @property
    def block(self) -> int:
        return self.block_weights if self.quantized else 1

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    def storage(self, N: int, K: int) -> tuple[tuple[int, int], str]:
        """(shape, dtype) of a ``[N, K]`` matrix in the pack."""
        return (N, K // self.block * self.block_bytes), "uint8"

    def row_bytes(self, K: int) -> int:
        return K // self.block * self.block_bytes

    def fits(self, K: int) -> bool:
        """Whether rows of ``K`` weights can be stored (whole blocks)."""
        return K % self.block == 0

    # numpy: float32 [N, K] <-> storage
    def quantize(self, w: np.ndarray) -> np.ndarray:
        n, k = w.shape
        blocks = np.asarray(w, np.float32).reshape(n * (k // self.block), self.block)
        return self._quantize_blocks(blocks).reshape(n, -1)

    def dequantize(self, packed: np.ndarray, K: int) -> np.ndarray:
        n = packed.shape[0]
        blocks = np.ascontiguousarray(packed).reshape(n * (K // self.block), self.block_bytes)
        return self._dequantize_blocks(blocks).reshape(n, K)

    def _quantize_blocks(self, blocks):
        raise NotImplementedError

    def _dequantize_blocks(self, blocks):
        raise NotImplementedError


class Float(WeightFormat):
    """float32 / float16: the values as they are; bfloat16: each value's 2 bytes (the high half
    of its float32), little-endian, ``(N, 2 K)`` uint8 in the pack, widened exactly by the
    kernels (bits << 16)."""

    @property
    def byte_rows(self) -> bool:
        return self.name == "bfloat16"

    def storage(self, N: int, K: int) -> tuple[tuple[int, int], str]:
        if self.byte_rows:
            return (N, 2 * K), "uint8"
        return (N, K), self.name

    def quantize(self, w: np.ndarray) -> np.ndarray:
        if self.name == "bfloat16":
            return bf16_bits(np.asarray(w, np.float32)).view(np.uint8)
        return np.ascontiguousarray(w, dtype=self.name)

    def dequantize(self, packed: np.ndarray, K: int) -> np.ndarray:
        if self.name == "bfloat16":
            return bf16_values(np.ascontiguousarray(packed).view("<u2"))
        return np.asarray(packed, np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 patterns of float32 ``x``, rounded to nearest even as torch's
    ``.to(torch.bfloat16)`` does (a NaN becomes its quiet NaN 0x7FC0)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 of uint16 bfloat16 patterns: exact (the pattern is the float32's high half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Q8_0(WeightFormat):
    """d = max|w| / 127, q = round(w / d) in int8; w = d q."""

    def _quantize_blocks(self, blocks):
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        q = _round_half_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(d), q], axis=1)

    def _dequantize_blocks(self, blocks):
        return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16_at(blocks, 0)


class Q4_0(WeightFormat):
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


class Q4_1(WeightFormat):
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


class Q5(WeightFormat):
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


class Q5_0(Q5):
    def _quantize_blocks(self, blocks):
        big = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        d = big / np.float32(-16)
        q = np.trunc(blocks * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
        return self._pack(q, [_f16_bytes(d)])

    def _dequantize_blocks(self, blocks):
        q = self._quants(blocks).astype(np.int8) - np.int8(16)
        return _f16_at(blocks, 0) * q.astype(np.float32)


class Q5_1(Q5):
    fields = 2

    def _quantize_blocks(self, blocks):
        lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
        d = (hi - lo) / np.float32(31)
        q = np.trunc((blocks - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 31)
        return self._pack(q, [_f16_bytes(d), _f16_bytes(lo)])

    def _dequantize_blocks(self, blocks):
        return _f16_at(blocks, 0) * self._quants(blocks).astype(np.float32) + _f16_at(blocks, 2)


class KMin(WeightFormat):
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
        from .. import kquant

        scale, mn, searched = kquant.fit_min_scale(blocks.reshape(-1, 32), nmax, *self.search)
        d, sc = _k_superblock_scales(scale.reshape(n, 8), 63)
        dmin, mq = _k_superblock_scales(mn.reshape(n, 8), 63)
        ds = d.astype(np.float32) * sc
        dm = dmin.astype(np.float32) * mq
        q = _requantize(blocks.reshape(n, 8, 32), dm, ds, 0, nmax,
                        searched.reshape(n, 8, 32)).astype(np.uint8)
        low = (q & 15).reshape(-1, 4, 2, 32)
        parts = [d.view(np.uint8), dmin.view(np.uint8), k_pack_scales(sc, mq)]
        if self.bits == 5:
            fifth = (q >> 4).transpose(0, 2, 1)  # (n, 32 weights, 8 sub-blocks)
            parts.append((fifth << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8))
        parts.append((low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128))
        return np.concatenate(parts, axis=1)

    def _dequantize_blocks(self, blocks):
        n = len(blocks)
        sc, mn = k_scales_mins(blocks[:, 4:16])
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


class Q4_K(KMin):
    bits = 4


class Q5_K(KMin):
    bits = 5

    search = (-0.5, 0.1, 15)  # quantize_row_q5_K_ref's


class Q6_K(WeightFormat):
    """Sixteen 16-weight sub-blocks, w = d sc_s (q - 32), int8 sc_s, q in 0..63.  The quantizer is
    ggml's reference one (``quantize_row_q6_K_ref``), byte for byte: each sub-block's scale from
    ``make_qx_quants``' search weighted by x^2 (``kquant``), the sixteen scales to int8 against
    d = (largest-magnitude scale) / -128, q requantized against those; a super-block whose
    scales are all below ggml's 1e-15 is all zeros."""

    block_weights = QK_K

    def _quantize_blocks(self, blocks):
        n = len(blocks)
        from .. import kquant

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
