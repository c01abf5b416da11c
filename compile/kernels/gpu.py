"""Thread-bound GPU kernels: the same factories, signatures and buffer layouts as the CPU set.

Every GPU target (cuda, metal, webgpu, opencl, vulkan) compiles these; the Relax graph in
``model.py`` does not know which set it got.  Global symbols are the CPU names prefixed ``gpu_``.

Conventions shared by the GPU kernels:
  * all threads of a block run along ``threadIdx.x`` (and ``threadIdx.y`` for row groups);
  * block-wide sums and maxima are written as cross-thread reduction blocks (``block_reduce``)
    that TVM lowers to warp shuffles where the target has them (CUDA, Metal) and to a
    shared-memory tree elsewhere (OpenCL, WebGPU);
  * shared buffers have static sizes; symbolic sizes (``n``, ``num_blocks``, ``context_len``)
    only bound grid dimensions and serial loops;
  * range checks that read only scalar parameters stay ``assert`` s (they run on the host
    before the launch); checks that read a device buffer (token ids, block-table entries) cannot
    raise on a GPU and become guards: the out-of-range element is skipped (embedding rows are
    zero, K/V is not written, a position is not attended).  The session validates all of them
    in Python before a step runs, so the guards only keep a bad call from touching memory
    outside the pool.

This file: the registry entry, the reduction helper, embedding and RMSNorm.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .common import cached, dtype_tag
from .common import finalize as _finalize
from .linear import token_dim
from .registry import KernelSet

WARP = 32
MAX_THREADS = 256  # WebGPU's default workgroup limit; also a safe Metal / OpenCL size


def finalize(func, name: str):
    """``common.finalize`` with the ``gpu_`` symbol prefix."""
    return _finalize(func, "gpu_" + name)


def block_threads(n: int) -> int:
    """Threads for a block that strides over ``n`` elements: a power of two in [32, 256]."""
    t = WARP
    while t < MAX_THREADS and t < n:
        t *= 2
    return t


def block_reduce(NT: int, op: str, name: str):
    """``dst[di] = op(src[si] of the NT threads)`` as a cross-thread reduction block.

    Call it as the only statement of its own ``for tx in T.thread_binding(NT, "threadIdx.x")``
    loop (TVM lowers a cross-thread reduction only when its thread loops are the innermost).
    ``dst`` should be a shared buffer: every thread reads the result after the block.  Give
    every reduction of a kernel its own ``dst`` buffer: TVM silently leaves two reduction blocks
    that write one buffer unlowered (each thread then updates ``dst`` in a race).
    """
    assert op in ("sum", "max"), op

    @T.macro
    def reduce(tx, src, si, dst, di):
        with T.sblock(name):
            vtx = T.axis.reduce(NT, tx)
            T.reads(src[si])
            T.writes(dst[di])
            with T.init():
                if op == "sum":
                    dst[di] = T.float32(0)
                else:
                    dst[di] = T.min_value("float32")  # the identity TVM's max reducer expects
            if op == "sum":
                dst[di] = dst[di] + src[si]
            else:
                dst[di] = T.max(dst[di], src[si])

    return reduce


@cached
def embedding(V: int, H: int, wdt: str, n_static: int | None = None):
    """x[i] = table[ids[i]]: one block per token; an id outside [0, V) gives a zero row."""
    n = token_dim(n_static)
    NT = block_threads(H)
    HO = -(-H // NT)

    @T.prim_func(s_tir=True)
    def func(var_ids: T.handle, table: T.Buffer((V, H), wdt), var_x: T.handle):
        ids = T.match_buffer(var_ids, (n,), "int32")
        x = T.match_buffer(var_x, (n, H), "float32")
        with T.sblock("root"):
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            if 0 <= ids[i] and ids[i] < V:
                                x[i, ho * NT + tx] = T.Cast(
                                    "float32", table[T.Cast("int64", ids[i]), ho * NT + tx])
                            else:
                                x[i, ho * NT + tx] = T.float32(0)

    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"embedding_{tag}_{V}x{H}_{dtype_tag(wdt)}")


@cached
def rmsnorm(H: int, eps: float, n_static: int | None = None, last_only: bool = False):
    """y = x * rsqrt(mean(x^2) + eps) * w: one block per output row, a block sum of squares."""
    n = token_dim(n_static)
    rows_out = 1 if last_only else n
    NT = block_threads(H)
    HO = -(-H // NT)
    sum_sq = block_reduce(NT, "sum", "sum_sq")

    @T.prim_func(s_tir=True)
    def func(var_x: T.handle, w: T.Buffer((H,), "float32"), var_y: T.handle):
        x = T.match_buffer(var_x, (n, H), "float32")
        y = T.match_buffer(var_y, (rows_out, H), "float32")
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            tot = T.sblock_alloc_buffer((1,), "float32", scope="shared")
            for i in T.thread_binding(rows_out, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    part[0] = T.float32(0)
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            part[0] = part[0] + x[n - 1 if last_only else i, ho * NT + tx] * x[
                                n - 1 if last_only else i, ho * NT + tx]
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    sum_sq(tx, part, 0, tot, 0)
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    for ho in range(HO):
                        if ho * NT + tx < H:
                            y[i, ho * NT + tx] = x[n - 1 if last_only else i, ho * NT + tx] * (
                                T.rsqrt(tot[0] / T.float32(H) + T.float32(eps)) * w[ho * NT + tx])

    suffix = "_last" if last_only else ""
    tag = "dec" if n_static == 1 else "pre"
    return finalize(func, f"rmsnorm{suffix}_{tag}_{H}")


def gpu_kernels() -> KernelSet:
    from . import gpu_attention, gpu_gemv, gpu_linear

    return KernelSet(embedding, rmsnorm, gpu_gemv.gemv, gpu_gemv.gemv_swiglu, gpu_linear.linear,
                     gpu_linear.linear_swiglu, gpu_attention.rope_kv_write_decode,
                     gpu_attention.rope_kv_write_prefill, gpu_attention.paged_attention_decode,
                     gpu_attention.paged_attention_prefill,
                     gpu_attention.rope_kv_write_decode_dev,
                     gpu_attention.paged_attention_decode_dev)
