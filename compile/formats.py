"""Weight formats: one object per format, the only place a format is described.

Each format joins three parts (``format_parts/``): its codec (``codec``: how a ``[N, K]``
matrix is stored, GGUF's blocks byte for byte, and the numpy quantizer / dequantizer, without
TVM), the CPU kernels' vector TIR pieces (``cpu``, read by ``kernels/cpu/quant.py``) and the
GPU kernels' portable scalar TIR pieces (``gpu``, read by ``kernels/gpu/``).  The kernels, the
parameter layout, the weight loader and the quantizer look formats up here by name; adding a
format is its class in each part and its entry in ``FORMATS``.  On CPU targets
(``interleaved``) a quantized matrix whose rows come in groups of 8 takes its format's layout
with 8 rows interleaved (``q4_0x8``, ...: ``codec_x8`` and ``cpu_x8``)."""

from __future__ import annotations

from paged_decode.runtime.manifest import INTERLEAVED_SUFFIX

from .format_parts import codec, codec_x8, cpu, cpu_x8, gpu
from .format_parts.codec import QBLOCK, QK_K, WeightFormat
from .format_parts.codec_x8 import ROW_GROUP

__all__ = ["FLOAT_FORMATS", "FORMATS", "INTERLEAVED", "QBLOCK", "QK_K", "QUANT_FORMATS",
           "ROW_GROUP", "USER_FORMATS", "WeightFormat", "by_gguf_type", "interleaved"]


class _Float(codec.Float, cpu.FloatCpu, gpu.FloatGpu):
    pass


class _Q8_0(codec.Q8_0, cpu.Q8_0Cpu, gpu.Q8_0Gpu):
    pass


class _Q4_0(codec.Q4_0, cpu.Q4_0Cpu, gpu.Q4_0Gpu):
    pass


class _Q4_1(codec.Q4_1, cpu.Q4_1Cpu, gpu.Q4_1Gpu):
    pass


class _Q5_0(codec.Q5_0, cpu.Q5_0Cpu, gpu.Q5_0Gpu):
    pass


class _Q5_1(codec.Q5_1, cpu.Q5_1Cpu, gpu.Q5_1Gpu):
    pass


class _Q4_K(codec.Q4_K, cpu.KMinCpu, gpu.KMinGpu):
    pass


class _Q5_K(codec.Q5_K, cpu.KMinCpu, gpu.KMinGpu):
    pass


class _Q6_K(codec.Q6_K, cpu.Q6_KCpu, gpu.Q6_KGpu):
    pass


# the rows-by-8 layouts: CPU only (the GPUs' pieces refuse them)
class _Rows8(codec_x8.Rows8, cpu_x8.Rows8Cpu, gpu.GroupedGpu):
    pass


class _Q5Rows8(codec_x8.Q5Rows8, cpu_x8.Q5Rows8Cpu, gpu.GroupedGpu):
    pass


class _KRows8(codec_x8.KRows8, cpu_x8.KRows8Cpu, gpu.GroupedGpu):
    pass


class _Q6KRows8(codec_x8.Q6KRows8, cpu_x8.Q6KRows8Cpu, gpu.GroupedGpu):
    pass


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _Float("float32", 4, "F32"),
    _Float("float16", 2, "F16"),
    _Float("bfloat16", 2, "BF16"),
    _Q8_0("q8_0", 34, "Q8_0"),
    _Q4_0("q4_0", 18, "Q4_0"),
    _Q4_1("q4_1", 20, "Q4_1"),
    _Q5_0("q5_0", 22, "Q5_0"),
    _Q5_1("q5_1", 24, "Q5_1"),
    _Q4_K("q4_k", 144, "Q4_K"),
    _Q5_K("q5_k", 176, "Q5_K"),
    _Q6_K("q6_k", 210, "Q6_K"),
)}
# the interleaved layouts: chosen per matrix for CPU targets (``interleaved``), never asked for
INTERLEAVED = {f.base.name: f for f in (
    *(_Rows8(FORMATS[n], INTERLEAVED_SUFFIX) for n in ("q8_0", "q4_0", "q4_1")),
    *(_Q5Rows8(FORMATS[n], INTERLEAVED_SUFFIX) for n in ("q5_0", "q5_1")),
    *(_KRows8(FORMATS[n], INTERLEAVED_SUFFIX) for n in ("q4_k", "q5_k")),
    _Q6KRows8(FORMATS["q6_k"], INTERLEAVED_SUFFIX))}
USER_FORMATS = tuple(FORMATS)  # what --weight-dtype takes
FORMATS.update({f.name: f for f in INTERLEAVED.values()})
FLOAT_FORMATS = codec.FLOAT_NAMES
QUANT_FORMATS = tuple(n for n in USER_FORMATS if FORMATS[n].quantized)


def interleaved(name: str, fmt: str, rows: int, gate_up_inter: int | None = None,
                tied: bool = False) -> str:
    """The format matrix ``name`` of ``rows`` rows in ``fmt`` takes on a CPU target: its
    interleaved layout where one exists and whole groups of rows fit (``w_gate_up``: its gate
    and up runs too, ``gate_up_inter`` act rows), else ``fmt``.  The LM head (``lm_head``, or
    the embedding where ``tied``) reads int16 x, so it is interleaved only in a layout whose
    kernels take it (``wide_x``: Q8_0, Q6_K); an embedding that is not the head keeps rows (it
    is read by rows)."""
    x8 = INTERLEAVED.get(fmt)
    if x8 is None or rows % ROW_GROUP:
        return fmt
    if name == "lm_head" or (name == "embed" and tied):
        return x8.name if x8.wide_x else fmt
    if name == "embed":
        return fmt
    if gate_up_inter is not None and gate_up_inter % ROW_GROUP:
        return fmt
    return x8.name


def by_gguf_type(type_name: str) -> WeightFormat | None:
    """The format stored exactly like a GGUF tensor type (by its GGMLQuantizationType name)."""
    return next((FORMATS[n] for n in USER_FORMATS if FORMATS[n].gguf_type == type_name), None)
