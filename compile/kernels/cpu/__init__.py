"""The CPU (llvm) kernel set: vectorised, prefetching, work-claiming parallel loops."""

from __future__ import annotations

import functools

from ...formats import FORMATS
from ..registry import KernelSet
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


def _pick(float_factory, quant_factory, rows, K, wfmt, *args, **kwargs):
    chosen = quant_factory if FORMATS[wfmt].quantized else float_factory
    return chosen(rows, K, wfmt, *args, **kwargs)


def _by_format(float_factory, quant_factory, **keywords):
    """A factory ``(rows, K, weight format, ...)`` taking the float kernel for float32 /
    float16 weights and the block-decoding one for a quantized format; ``keywords`` (the
    register tile) go to both and stay readable as the partial's ``keywords``."""
    return functools.partial(_pick, float_factory, quant_factory, **keywords)


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


def _pick_gemv(float_factory, quant_factory, l2_formats, rows, K, wfmt, *args, **kwargs):
    if not FORMATS[wfmt].quantized:
        kwargs["locality"] = prefetch_locality(wfmt, l2_formats)
    return _pick(float_factory, quant_factory, rows, K, wfmt, *args, **kwargs)


def _gemv_by_format(float_factory, quant_factory, l2_formats):
    """``_by_format`` for the weight-streaming kernels, whose float factory also takes the
    target's prefetch hint (the quantized one takes it from ``_for_target``)."""
    return functools.partial(_pick_gemv, float_factory, quant_factory, l2_formats)


def _for_target(factory, l2_formats, vnni, rows, K, wfmt, *args, **kwargs):
    return factory(rows, K, wfmt, *args, vnni=vnni, locality=prefetch_locality(wfmt, l2_formats),
                   **kwargs)


def cpu_kernels(avx512: bool = True, mcpu: str | None = None, vnni: bool = False) -> KernelSet:
    tiles = linear.TILES[avx512]
    l2_formats = L2_PREFETCH.get(mcpu, frozenset())

    def q(factory):  # a quantized kernel: the target's int8 dot product and prefetch hint
        return functools.partial(_for_target, factory, l2_formats, vnni)

    return KernelSet(_by_format(norm.embedding, quant.embedding), norm.rmsnorm,
                     _gemv_by_format(gemv.gemv, q(quant.gemv), l2_formats),
                     _gemv_by_format(gemv.gemv_swiglu, q(quant.gemv_swiglu), l2_formats),
                     _by_format(linear.linear, q(quant.linear), tile=tiles["linear"]),
                     _by_format(linear.linear_swiglu, q(quant.linear_swiglu),
                                tile=tiles["swiglu"]),
                     rope_kv.rope_kv_write_decode,
                     rope_kv.rope_kv_write_prefill, attention.paged_attention_decode,
                     attention.paged_attention_prefill, rope_kv.rope_kv_write_decode_dev,
                     attention.paged_attention_decode_dev, K_BLOCK_LAYOUT,
                     batch.rope_kv_write_batch, batch.paged_attention_batch,
                     _gemv_by_format(batch.gemv_rows, q(quant.linear_rows), l2_formats),
                     _gemv_by_format(batch.gemv_rows_swiglu, q(quant.linear_swiglu_rows),
                                     l2_formats),
                     batch.SMALL_ROWS, quant.SMALL_ROWS, quant.SMALL_ROWS_INTERLEAVED,
                     small_rows_x_bytes=batch.SMALL_ROWS_X_BYTES, quant_head_wide_x=True,
                     scale=elementwise.scale, softcap=elementwise.softcap,
                     gelu_tanh_gate=elementwise.gelu_tanh_gate,
                     rmsnorm_add=elementwise.rmsnorm_add)
