"""The CPU (llvm) kernel set: vectorised, prefetching, work-claiming parallel loops."""

from __future__ import annotations

import functools

from ..registry import KernelSet
from . import attention, batch, gemv, linear, norm, rope_kv
from .simd import K_BLOCK_LAYOUT


def has_avx512(target) -> bool:
    """Whether an llvm target's CPU (its ``mcpu``) has AVX-512 (32 vector registers)."""
    from tvm.target.codegen import llvm_cpu_has_features

    return bool(llvm_cpu_has_features("avx512f", target))


def cpu_kernels(avx512: bool = True) -> KernelSet:
    tiles = linear.TILES[avx512]
    return KernelSet(norm.embedding, norm.rmsnorm, gemv.gemv, gemv.gemv_swiglu,
                     functools.partial(linear.linear, tile=tiles["linear"]),
                     functools.partial(linear.linear_swiglu, tile=tiles["swiglu"]),
                     rope_kv.rope_kv_write_decode,
                     rope_kv.rope_kv_write_prefill, attention.paged_attention_decode,
                     attention.paged_attention_prefill, rope_kv.rope_kv_write_decode_dev,
                     attention.paged_attention_decode_dev, K_BLOCK_LAYOUT,
                     batch.rope_kv_write_batch, batch.paged_attention_batch)
