"""The kernel set a target compiles with: CPU (llvm) or GPU (thread-bound) factories.

Every set offers the same factories with the same signatures and buffer shapes, so the Relax
graph in ``model.py`` is written once; how a K block is stored inside its pool tensor is the
set's ``k_block_layout``.
"""

from __future__ import annotations

import dataclasses

from .kernel_set import KernelSet

__all__ = ["BYTE_BUFFER_GPUS", "KernelSet", "NO_INT64_BUFFERS", "kernels_for",
           "no_byte_weights", "no_quantized_kernels"]


# Targets whose device code cannot hold int64 buffers (WGSL has no i64): their artifacts have
# no ``decode_dev`` (int64 context_len / write_off tensors) and no batch buckets (int64
# context_lens / write_offs per row).
NO_INT64_BUFFERS = ("webgpu",)


# GPU targets whose device code reads the quantized formats' bytes (uint8 buffers)
BYTE_BUFFER_GPUS = ("cuda", "metal", "opencl")
_NO_BYTE_BUFFERS = {
    "webgpu": "WGSL has no 8-bit type for the packed blocks",
    "vulkan": "8-bit storage buffers (VK_KHR_8bit_storage) are not built for vulkan here",
}


def no_quantized_kernels(target_kind: str, target=None) -> str | None:
    """Why a target cannot run quantized weights natively (None: it can)."""
    if target_kind == "llvm":
        from .cpu import has_avx2

        if target is None or has_avx2(target):
            return None
        return ("the quantized CPU kernels need x86 AVX2, which this llvm target's CPU "
                f"({target.attrs.get('mcpu', 'default')}) lacks")
    if target_kind in BYTE_BUFFER_GPUS:
        return None
    why = _NO_BYTE_BUFFERS.get(target_kind, f"{target_kind} has no quantized kernels")
    return (f"{target_kind}: {why} (quantized weights run on llvm with AVX2 and on "
            f"{', '.join(BYTE_BUFFER_GPUS)})")


def no_byte_weights(target_kind: str) -> str | None:
    """Why a target's kernels cannot read weights stored as bytes (the quantized formats and
    bfloat16), or None: only GPUs without 8-bit buffers."""
    if target_kind == "llvm" or target_kind in BYTE_BUFFER_GPUS:
        return None
    return f"{target_kind}: {_NO_BYTE_BUFFERS.get(target_kind, 'no kernels over weight bytes')}"


def kernels_for(target_kind: str, target=None) -> KernelSet:
    """CPU kernels for llvm, thread-bound GPU kernels for every GPU target.  ``target`` (a
    ``tvm.target.Target``) lets the CPU set fit its register tiles to the target's vector
    registers and its int8 dot products to its VNNI (its ``mcpu``, which the artifact key
    carries); None means AVX-512 without VNNI."""
    if target_kind == "llvm":
        from .cpu import cpu_kernels, has_avx512, has_vnni

        mcpu = None if target is None else str(target.attrs.get("mcpu", "")) or None
        return cpu_kernels(avx512=target is None or has_avx512(target), mcpu=mcpu,
                           vnni=target is not None and has_vnni(target))
    from .gpu import gpu_kernels

    if target_kind in NO_INT64_BUFFERS:
        return dataclasses.replace(gpu_kernels(), rope_kv_write_decode_dev=None,
                                   paged_attention_decode_dev=None, rope_kv_write_batch=None,
                                   paged_attention_batch=None)
    return gpu_kernels()
