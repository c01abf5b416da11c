"""The kernel set a target compiles with: CPU (llvm) or GPU (thread-bound) factories.

Every set offers the same factories with the same signatures and buffer shapes, so the Relax
graph in ``model.py`` is written once; how a K block is stored inside its pool tensor is the
set's ``k_block_layout``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..formats import FORMATS


@dataclasses.dataclass(frozen=True)
class KernelSet:
    embedding: Callable
    rmsnorm: Callable
    gemv: Callable
    gemv_swiglu: Callable
    linear: Callable
    linear_swiglu: Callable
    rope_kv_write_decode: Callable
    rope_kv_write_prefill: Callable
    paged_attention_decode: Callable
    paged_attention_prefill: Callable
    # decode_dev: context_len / write_off read from (1,) int64 device tensors (CUDA-graph
    # friendly).  Defaulted so a KernelSet built with the ten factories above still works.
    rope_kv_write_decode_dev: Callable | None = None
    paged_attention_decode_dev: Callable | None = None
    # How a block of one kv head sits in the K pool (the pool's shape is the same either way):
    # "slot-major" ``[slot, dim]`` or "dim-major" ``[dim, slot]`` (``cpu.simd.K_BLOCK_LAYOUT``).
    k_block_layout: str = "slot-major"
    # batch_decode: B rows of ragged decode (``kernels/cpu/batch.py``); None where a set has
    # no batched kernels (its artifacts then have no batch buckets)
    rope_kv_write_batch: Callable | None = None
    paged_attention_batch: Callable | None = None
    # small-batch kernels: (N, K, wdt, epilogue, B) / (I, K, wdt, B), used by batch buckets of
    # at most ``small_rows`` rows (float weights) / ``small_rows_quant`` rows (quantized)
    # instead of the matmuls; None: matmuls only
    linear_rows: Callable | None = None
    linear_swiglu_rows: Callable | None = None
    small_rows: int = 0
    small_rows_quant: int = 0
    small_rows_interleaved: int = 0  # matrices with rows interleaved (``formats.interleaved``)
    # float weights: the small-batch kernels only while all rows of x take less than this many
    # bytes (float32), since they sweep x once per weight row; 0: no limit
    small_rows_x_bytes: int = 0
    # whether a quantized LM head's kernels take int16 activations (``wide_x``: the CPU's
    # integer dot products; the GPU kernels keep x float32)
    quant_head_wide_x: bool = False
    # the layer features' elementwise kernels (``cpu/elementwise.py``): the embedding scale,
    # logit soft-capping, the GELU-tanh gate and a post norm with its residual add
    scale: Callable | None = None
    softcap: Callable | None = None
    gelu_tanh_gate: Callable | None = None
    rmsnorm_add: Callable | None = None

    def small_rows_limit(self, wdt: str) -> int:
        """The largest batch bucket the small-batch kernels serve for weights in ``wdt``."""
        fmt = FORMATS[wdt]
        if fmt.grouped:
            return self.small_rows_interleaved
        return self.small_rows_quant if fmt.quantized else self.small_rows

    def takes_small_rows(self, wdt: str, rows: int, K: int) -> bool:
        """Whether a batch bucket of ``rows`` rows multiplies a ``(N, K)`` matrix in ``wdt``
        with the small-batch kernels rather than the matmul."""
        if rows > self.small_rows_limit(wdt):
            return False
        x_bytes = self.small_rows_x_bytes
        return FORMATS[wdt].quantized or not x_bytes or rows * K * 4 < x_bytes


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
