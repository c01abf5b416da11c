"""The machine's two roofs, measured in the run that compares against them: read bandwidth (the
streaming-read kernel of ``stream.py``) and the peak rate of float32 multiply-adds (a kernel of
independent FMA chains held in registers, one per core).

A decode step over b sequences needs ``bytes(b)`` read and ``flops(b)`` computed; at best it takes
``max(bytes / bandwidth, flops / peak)``, so its tokens/s cannot beat ``b`` over that: the roof
each batched point is a fraction of (:func:`roof_tps`).
"""

from __future__ import annotations

import functools
import os

import numpy as np
from tvm.script import tirx as T

from paged_decode.compile.kernels.common import finalize
from paged_decode.compile.kernels.cpu.simd import VL, scratch_buffer

from .baselines import median_ms

FMA_STEPS = 1 << 14  # multiply-adds per accumulator lane and chunk: ~0.5 ms a call
FMA_CHUNKS_PER_CORE = 16  # a whole number per core: no core idles while another finishes


@functools.lru_cache(maxsize=None)
def _stream_kernel(n_rows: int):
    """The compiled streaming-read kernel (built once per size; every round measures again)."""
    import tvm

    from paged_decode.compile.targets import resolve_target

    from .stream import stream_read

    return tvm.compile(stream_read(n_rows), target=resolve_target(None).target)[
        f"stream_read_{n_rows}"]


@functools.lru_cache(maxsize=2)
def _stream_source(n_rows: int):
    """The streaming-read kernel's input (kept between calls: filling it costs more than a
    reading), in the same huge-page-backed host memory as the weights, so the floor and our
    decode read through the same kind of pages."""
    from paged_decode.runtime.host_memory import HostArena, to_tvm

    from .stream import CHUNKS, ROW

    shape = (CHUNKS, n_rows, ROW)
    host = HostArena.for_arrays([(shape, "float32")]).take(shape, "float32")
    host[...] = 1.0
    return to_tvm(host)


def measure_bandwidth(mb: int, repeats: int = 7) -> float:
    """GB/s of a parallel streaming read over ``mb`` MiB (median of ``repeats``)."""
    import tvm

    from .stream import CHUNKS, ROW

    n_rows = mb * (1 << 20) // (4 * ROW * CHUNKS)
    fn, src = _stream_kernel(n_rows), _stream_source(n_rows)
    dst = tvm.runtime.tensor(np.zeros((CHUNKS, VL), np.float32))
    ms = median_ms(lambda: fn(src, dst), repeats, 0.0, min_warmup=2)
    return CHUNKS * n_rows * ROW * 4 / (ms / 1e3) / 1e9


def fma_chains(avx512: bool) -> int:
    """Independent accumulators of ``VL`` lanes per chunk: enough chains to cover the FMA
    latency on two pipes (4 cycles x 2 = 8 registers in flight) while every accumulator and the
    two operands stay in registers: 5 x 2 ymm + 4 of 16 with AVX2, 10 zmm + 2 of 32 with
    AVX-512."""
    return 10 if avx512 else 5


def _fma_chunks() -> int:
    return FMA_CHUNKS_PER_CORE * (os.cpu_count() or 1)


def fma_peak(chains: int, chunks: int, steps: int = FMA_STEPS):
    """``out[c, :] = sum_u acc_u`` after ``steps`` rounds of ``acc_u = acc_u * a + b`` on
    ``chains`` accumulators of ``VL`` lanes, chunks in parallel: ``2 * chunks * chains * VL *
    steps`` float32 flops with no memory traffic (``a``, ``b``: ``(VL,)`` float32)."""

    @T.prim_func(s_tir=True)
    def func(a: T.Buffer((VL,), "float32"), b: T.Buffer((VL,), "float32"),
             out: T.Buffer((chunks, VL), "float32")):
        with T.sblock("root"):
            for c in T.parallel(chunks):
                acc = scratch_buffer((chains, VL))
                for u, v in T.grid(chains, VL):
                    acc[u, v] = T.Cast("float32", c + u)
                for _ in range(steps):
                    for u in T.unroll(chains):
                        for v in T.vectorized(VL):
                            acc[u, v] = acc[u, v] * a[v] + b[v]
                for v in T.vectorized(VL):
                    out[c, v] = acc[0, v]
                for u in range(1, chains):
                    for v in T.vectorized(VL):
                        out[c, v] = out[c, v] + acc[u, v]

    return finalize(func, f"fma_peak_{chains}")


@functools.lru_cache(maxsize=None)
def _fma_kernel():
    import tvm

    from paged_decode.compile.kernels.cpu import has_avx512
    from paged_decode.compile.targets import resolve_target

    target = resolve_target(None).target
    chains = fma_chains(has_avx512(target))
    chunks = _fma_chunks()
    fn = tvm.compile(fma_peak(chains, chunks), target=target)[f"fma_peak_{chains}"]
    return fn, chains, chunks


def measure_fma_peak(repeats: int = 7) -> float:
    """GFLOP/s of float32 multiply-adds on every core (median of ``repeats``; an FMA counts as
    two flops)."""
    import tvm

    fn, chains, chunks = _fma_kernel()
    # a, b keep the accumulators bounded (|acc| stays near b / (1 - a)): no overflow, no denormals
    a = tvm.runtime.tensor(np.full(VL, 0.5, np.float32))
    b = tvm.runtime.tensor(np.full(VL, 1.0, np.float32))
    out = tvm.runtime.tensor(np.zeros((chunks, VL), np.float32))
    ms = median_ms(lambda: fn(a, b, out), repeats, 0.0, min_warmup=2)
    return 2 * chunks * chains * VL * FMA_STEPS / (ms / 1e3) / 1e9


def streamed_params(m, weights) -> list:
    """The weight tensors a decode step reads whole, in the artifact's parameter order: all but
    an untied embedding (gathered a row per token; tied, it is the LM head and streamed)."""
    names = [p[0] for p in m.params]
    return [t for name, t in zip(names, weights.params)
            if not (name == "embed" and "lm_head" in names)]


def streamed_bytes(m, weights) -> int:
    """Bytes of ``streamed_params``, as stored: what a decode step reads of the weights."""
    return sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
               for t in streamed_params(m, weights))


def kv_bytes(m, ctx: int) -> int:
    """Bytes of one sequence's K and V over ``ctx`` positions in every layer (manifest ``m``)."""
    return 2 * m.n_layers * ctx * m.n_kv_heads * m.head_dim * np.dtype(m.cache_dtype).itemsize


def step_cost(cfg, b: int, context: int, weight_bytes: int, seq_kv_bytes: int) -> dict:
    """Bytes read and flops of one decode step over ``b`` sequences at ``context`` tokens each:
    the weights once (``weight_bytes``, as stored) plus each sequence's K / V
    (``seq_kv_bytes``); two flops per weight per row in the matmuls (LM head included) and per
    cached element in QK^T and PV."""
    c = cfg
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    weights = c.n_layers * per_layer + c.vocab_size * c.hidden_size
    attention = 2 * 2 * context * c.n_q_heads * c.head_dim * c.n_layers
    return {"bytes": weight_bytes + b * seq_kv_bytes, "flops": b * (2 * weights + attention)}


def roof_tps(cost: dict, b: int, bandwidth_gbps: float, peak_gflops: float) -> dict:
    """The best tokens/s ``b`` sequences could decode at with ``cost`` (:func:`step_cost`) per
    step, and which roof bounds it."""
    memory_s = cost["bytes"] / (bandwidth_gbps * 1e9)
    compute_s = cost["flops"] / (peak_gflops * 1e9)
    return {"tps": b / max(memory_s, compute_s),
            "bound": "bandwidth" if memory_s >= compute_s else "arithmetic"}
