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

This file: the helpers every GPU kernel shares (symbol prefix, block sizes, block reductions,
a weight element read as float32).
"""

from __future__ import annotations

from tvm.script import tirx as T

from ...formats import FORMATS
from ..common import finalize as _finalize

WARP = 32
MAX_THREADS = 256  # WebGPU's default workgroup limit; also a safe Metal / OpenCL size


def weight_at(wdt: str, W, c, k):
    """W[c, k] as float32: a float32 / float16 matrix's element, or a bfloat16 or quantized
    one's decoded from its stored bytes (``formats.WeightFormat.weight``)."""
    return FORMATS[wdt].weight(W, c, k)


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
