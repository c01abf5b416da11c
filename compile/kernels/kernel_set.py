"""``KernelSet``: what a target's kernel set offers the graph builder (``model.py``).

Apart from the registry that picks a set (``registry.py``) and the sets themselves
(``cpu/``, ``gpu/``), so that each imports this module and neither imports the other.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..formats import FORMATS


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSet:
    """The factories one target's kernels come from, by name, and the facts the graph builder
    asks of them.  Built by keyword (``cpu.cpu_kernels``, ``gpu.gpu_kernels``); every set's
    factories take the same arguments and return kernels of the same buffer shapes."""

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
    # friendly); None where a target's device code has no int64 buffers
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
