"""The CPU (llvm) kernel set: vectorised, prefetching, work-claiming parallel loops."""

from __future__ import annotations

from ..registry import KernelSet
from . import attention, batch, gemv, linear, norm, rope_kv
from .simd import K_BLOCK_LAYOUT


def cpu_kernels() -> KernelSet:
    return KernelSet(norm.embedding, norm.rmsnorm, gemv.gemv, gemv.gemv_swiglu, linear.linear,
                     linear.linear_swiglu, rope_kv.rope_kv_write_decode,
                     rope_kv.rope_kv_write_prefill, attention.paged_attention_decode,
                     attention.paged_attention_prefill, rope_kv.rope_kv_write_decode_dev,
                     attention.paged_attention_decode_dev, K_BLOCK_LAYOUT,
                     batch.rope_kv_write_batch, batch.paged_attention_batch)
