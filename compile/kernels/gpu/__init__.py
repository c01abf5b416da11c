"""The thread-bound GPU kernel set (cuda, metal, webgpu, opencl, vulkan); see ``common``."""

from __future__ import annotations

from ..kernel_set import KernelSet
from . import attention, elementwise, gemv, linear, norm


def gpu_kernels() -> KernelSet:
    return KernelSet(
        embedding=norm.embedding, rmsnorm=norm.rmsnorm, gemv=gemv.gemv,
        gemv_swiglu=gemv.gemv_swiglu, linear=linear.linear, linear_swiglu=linear.linear_swiglu,
        rope_kv_write_decode=attention.rope_kv_write_decode,
        rope_kv_write_prefill=attention.rope_kv_write_prefill,
        paged_attention_decode=attention.paged_attention_decode,
        paged_attention_prefill=attention.paged_attention_prefill,
        rope_kv_write_decode_dev=attention.rope_kv_write_decode_dev,
        paged_attention_decode_dev=attention.paged_attention_decode_dev,
        rope_kv_write_batch=attention.rope_kv_write_batch,
        paged_attention_batch=attention.paged_attention_batch,
        scale=elementwise.scale, softcap=elementwise.softcap,
        gelu_tanh_gate=elementwise.gelu_tanh_gate, rmsnorm_add=elementwise.rmsnorm_add)
