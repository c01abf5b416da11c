"""The CPU (llvm) kernel set: vectorised, prefetching, work-claiming parallel loops."""

from __future__ import annotations

import dataclasses

from ...formats import FORMATS
from ..kernel_set import KernelSet
from . import attention, batch, elementwise, gemv, linear, norm, quant, rope_kv
from .simd import K_BLOCK_LAYOUT, L2, NTA

# Weight formats whose decode GEMVs prefetch their rows into L2 (``prefetcht1``) instead of as
# data used once (``prefetchnta``), by the target's CPU (its ``mcpu``): on Zen 4 these stream
# faster so, the other formats (Q6_K by rows among them) the same or slower; other CPUs keep the
# non-temporal prefetch they were measured with (docs/design.md#decode-gemv).
L2_PREFETCH = {"znver4": frozenset({"float16", "q4_k", "q5_kx8", "q6_kx8"})}


def prefetch_locality(wfmt: str, l2_formats=frozenset()) -> int:
    """The software prefetch hint of a decode GEMV over weights in ``wfmt`` (a layout
    interleaved by 8 named, or its base format)."""
    fmt = FORMATS[wfmt]
    named = wfmt in l2_formats or (fmt.grouped and fmt.base.name in l2_formats)
    return L2 if named else NTA


def has_avx512(target) -> bool:
    """Whether an llvm target's CPU (its ``mcpu``) has AVX-512 (32 vector registers)."""
    from tvm.target.codegen import llvm_cpu_has_features

    return bool(llvm_cpu_has_features("avx512f", target))


def _cpu_has(target, feature: str) -> bool:
    from tvm.target.codegen import llvm_cpu_has_features

    try:
        return bool(llvm_cpu_has_features(feature, target))
    except Exception:  # a target whose LLVM backend knows no such feature (not x86)
        return False


def has_vnni(target) -> bool:
    """Whether an llvm target's CPU has 256-bit ``vpdpbusd`` (AVX-512 VNNI with VL, or AVX-VNNI),
    which the int8 dot products over rows interleaved by 8 then take (docs/design.md)."""
    return (_cpu_has(target, "avx512vnni") and _cpu_has(target, "avx512vl")) or _cpu_has(
        target, "avxvnni")


def has_avx2(target) -> bool:
    """Whether an llvm target's CPU has AVX2, which the quantized-weight kernels use."""
    return _cpu_has(target, "avx2")


@dataclasses.dataclass(frozen=True)
class WeightKernels:
    """The CPU's weight-reading factories for one target, by name: the float kernel for
    float32 / float16 weights, the block-decoding one for a quantized format, each given what
    the target decides: the matmul register tiles, the int8 dot product (VNNI) and the
    software prefetch hint of the weight stream (``prefetch_locality``)."""

    linear_tile: tuple[int, int]
    swiglu_tile: tuple[int, int]
    l2_formats: frozenset = frozenset()
    vnni: bool = False

    def _quant(self, factory, rows, K, wfmt, *args, **kwargs):
        return factory(rows, K, wfmt, *args, vnni=self.vnni,
                       locality=prefetch_locality(wfmt, self.l2_formats), **kwargs)

    def _streamed(self, float_factory, quant_factory, rows, K, wfmt, *args, **kwargs):
        """A kernel streaming each weight row once: the float one takes the prefetch hint."""
        if FORMATS[wfmt].quantized:
            return self._quant(quant_factory, rows, K, wfmt, *args, **kwargs)
        return float_factory(rows, K, wfmt, *args,
                             locality=prefetch_locality(wfmt, self.l2_formats), **kwargs)

    def _tiled(self, float_factory, quant_factory, tile, rows, K, wfmt, *args, **kwargs):
        """A matmul over register tiles of ``tile``."""
        if FORMATS[wfmt].quantized:
            return self._quant(quant_factory, rows, K, wfmt, *args, tile=tile, **kwargs)
        return float_factory(rows, K, wfmt, *args, tile=tile, **kwargs)

    def embedding(self, V, H, wfmt, *args, **kwargs):
        factory = quant.embedding if FORMATS[wfmt].quantized else norm.embedding
        return factory(V, H, wfmt, *args, **kwargs)

    def gemv(self, N, K, wfmt, *args, **kwargs):
        return self._streamed(gemv.gemv, quant.gemv, N, K, wfmt, *args, **kwargs)

    def gemv_swiglu(self, inter, K, wfmt, *args, **kwargs):
        return self._streamed(gemv.gemv_swiglu, quant.gemv_swiglu, inter, K, wfmt, *args,
                              **kwargs)

    def linear(self, N, K, wfmt, *args, **kwargs):
        return self._tiled(linear.linear, quant.linear, self.linear_tile, N, K, wfmt, *args,
                           **kwargs)

    def linear_swiglu(self, inter, K, wfmt, *args, **kwargs):
        return self._tiled(linear.linear_swiglu, quant.linear_swiglu, self.swiglu_tile, inter,
                           K, wfmt, *args, **kwargs)

    def linear_rows(self, N, K, wfmt, *args, **kwargs):
        return self._streamed(batch.gemv_rows, quant.linear_rows, N, K, wfmt, *args, **kwargs)

    def linear_swiglu_rows(self, inter, K, wfmt, *args, **kwargs):
        return self._streamed(batch.gemv_rows_swiglu, quant.linear_swiglu_rows, inter, K, wfmt,
                              *args, **kwargs)


def cpu_kernels(avx512: bool = True, mcpu: str | None = None, vnni: bool = False) -> KernelSet:
    tiles = linear.TILES[avx512]
    w = WeightKernels(linear_tile=tiles["linear"], swiglu_tile=tiles["swiglu"],
                      l2_formats=L2_PREFETCH.get(mcpu, frozenset()), vnni=vnni)
    return KernelSet(
        embedding=w.embedding, rmsnorm=norm.rmsnorm, gemv=w.gemv, gemv_swiglu=w.gemv_swiglu,
        linear=w.linear, linear_swiglu=w.linear_swiglu,
        rope_kv_write_decode=rope_kv.rope_kv_write_decode,
        rope_kv_write_prefill=rope_kv.rope_kv_write_prefill,
        paged_attention_decode=attention.paged_attention_decode,
        paged_attention_prefill=attention.paged_attention_prefill,
        rope_kv_write_decode_dev=rope_kv.rope_kv_write_decode_dev,
        paged_attention_decode_dev=attention.paged_attention_decode_dev,
        k_block_layout=K_BLOCK_LAYOUT, rope_kv_write_batch=batch.rope_kv_write_batch,
        paged_attention_batch=batch.paged_attention_batch, linear_rows=w.linear_rows,
        linear_swiglu_rows=w.linear_swiglu_rows, small_rows=batch.SMALL_ROWS,
        small_rows_quant=quant.SMALL_ROWS, small_rows_interleaved=quant.SMALL_ROWS_INTERLEAVED,
        small_rows_x_bytes=batch.SMALL_ROWS_X_BYTES, quant_head_wide_x=True,
        scale=elementwise.scale, softcap=elementwise.softcap,
        gelu_tanh_gate=elementwise.gelu_tanh_gate, rmsnorm_add=elementwise.rmsnorm_add)
