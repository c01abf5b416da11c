"""The thread-bound GPU kernel set (cuda, metal, webgpu, opencl, vulkan); see ``common``."""

from __future__ import annotations

import functools

from ..registry import KernelSet
from . import attention, gemv, linear, norm


def _float_x(factory):
    """``factory`` taking (and ignoring) the CPU's ``wide_x`` option: the GPU kernels keep the
    LM head's x in float32, which is what the CPU's int16 x approximates."""
    @functools.wraps(factory)
    def call(*args, wide_x: bool = False, **kwargs):
        return factory(*args, **kwargs)

    return call


def gpu_kernels() -> KernelSet:
    return KernelSet(norm.embedding, norm.rmsnorm, _float_x(gemv.gemv), gemv.gemv_swiglu,
                     _float_x(linear.linear), linear.linear_swiglu,
                     attention.rope_kv_write_decode,
                     attention.rope_kv_write_prefill, attention.paged_attention_decode,
                     attention.paged_attention_prefill, attention.rope_kv_write_decode_dev,
                     attention.paged_attention_decode_dev,
                     rope_kv_write_batch=attention.rope_kv_write_batch,
                     paged_attention_batch=attention.paged_attention_batch)
