"""Weight formats: our quantizer / dequantizer against the gguf package's, and the kernels that
read the packed blocks against numpy."""

from __future__ import annotations

import ctypes
import dataclasses
import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from paged_decode.compile.formats import FORMATS, INTERLEAVED, QUANT_FORMATS, ROW_GROUP
from paged_decode.compile.kernels.cpu import quant
from paged_decode.compile.kernels.cpu.linear import TILES
from paged_decode.compile.params import GATE_UP_ROWS, interleave_gate_up

from . import ggml_kquants
from .conftest import QUANT_KERNEL_RTOL, quantized_weights
from .test_kernels import _compiled, _t

GGML = gguf.GGMLQuantizationType


def _gguf_type(fmt):
    return GGML[FORMATS[fmt].gguf_type]


# byte offsets of each format's float16 scales inside a block (the rest are random quant bytes)
SCALE_BYTES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
               "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,)}


def _random_blocks(fmt: str, n_rows: int, K: int, seed: int = 0) -> np.ndarray:
    """Random valid block bytes: random quants (and k-quant sub-scales), finite float16 scales
    of both signs."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_rows * K // f.block, f.block_bytes), dtype=np.uint8)
    for at in SCALE_BYTES[fmt]:
        scales = rng.uniform(-0.2, 0.2, (len(blocks), 1)).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8)
    return blocks.reshape(n_rows, -1)


def _k(fmt: str, *per_32: int) -> int:
    """A row length for ``fmt``: the first of ``per_32`` that is whole blocks (32-weight
    formats), or its counterpart in 256-weight super-blocks (k-quants)."""
    return per_32[0] if FORMATS[fmt].block == 32 else per_32[1]


def test_every_gguf_layout_is_a_registered_format():
    assert {FORMATS[f].gguf_type for f in QUANT_FORMATS} == {"Q8_0", "Q4_0", "Q4_1", "Q5_0",
                                                             "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    for fmt in QUANT_FORMATS:
        block, nbytes = gguf.GGML_QUANT_SIZES[_gguf_type(fmt)]
        assert (FORMATS[fmt].block, FORMATS[fmt].block_bytes) == (block, nbytes), fmt


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dequantize_is_bit_exact_with_gguf_on_random_blocks(fmt):
    K = _k(fmt, 96, 768)
    packed = _random_blocks(fmt, 7, K)
    ours = FORMATS[fmt].dequantize(packed, K)
    theirs = gguf_dequantize(packed, _gguf_type(fmt)).reshape(7, K)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


X8_FORMATS = tuple(f.name for f in INTERLEAVED.values())


def _scale_min_k4(q, j: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from a Q4_K block's 12
    scale bytes ``q``."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _layout_checks(f, packed, grouped, g, r, k):
    """Row ``g * 8 + r``'s block ``k`` against its place in ``grouped`` (the layouts of
    ``formats._Rows8`` / ``_KRows8`` / ``_Q6KRows8``): (what the group holds, what the row's
    block holds)."""
    block = packed[g * 8 + r, k * f.base.block_bytes:(k + 1) * f.base.block_bytes]
    unit = grouped[g, k * f.unit_bytes:(k + 1) * f.unit_bytes]
    if f.base.name == "q6_k":  # d, 16 int8 scales, ql in 32 chunks, qh in 16
        return ([(unit[2 * r:2 * r + 2], block[208:210])]
                + [(unit[16 + 8 * t + r], block[192 + t]) for t in range(16)]
                + [(unit[144 + 32 * c + 4 * r:][:4], block[4 * c:][:4]) for c in range(32)]
                + [(unit[1168 + 32 * c + 4 * r:][:4], block[128 + 4 * c:][:4])
                   for c in range(16)])
    fields = getattr(f, "fields", 2)
    pairs = [(unit[16 * i + 2 * r:16 * i + 2 * r + 2], block[2 * i:2 * i + 2])
             for i in range(fields)]  # float16 d (m / dmin)
    if f.base.name in ("q4_k", "q5_k"):  # Q5_K: its 32 bytes of fifth bits in 8 chunks first
        pairs += [((unit[32 + 8 * s + r], unit[96 + 8 * s + r]), _scale_min_k4(block[4:16], s))
                  for s in range(8)]
        qs = 16 if f.base.name == "q4_k" else 48
        pairs += [(unit[160 + 32 * j + 4 * r:][:4], block[16 + 4 * j:][:4])
                  for j in range(8) if qs == 48]
        pairs += [(unit[qs * 8 + 32 + 256 * p + 32 * j + 4 * r:][:4],
                   block[qs + 32 * p + 4 * j:][:4]) for p in range(4) for j in range(8)]
    elif f.base.name in ("q5_0", "q5_1"):  # fifth bits in one chunk: bit j / 4 + j of byte i
        # the fifth bits of weights 4 j + i / 16 + 4 j + i (nibble chunk j's), then 4 chunks
        h = int.from_bytes(bytes(block[2 * fields:2 * fields + 4]), "little")
        spread = [sum(((h >> (4 * j + i)) & 1) << j | ((h >> (16 + 4 * j + i)) & 1) << (4 + j)
                      for j in range(4)) for i in range(4)]
        pairs += [(unit[16 * fields + 4 * r:][:4], np.array(spread, np.uint8))]
        pairs += [(unit[16 * fields + 32 * (j + 1) + 4 * r:][:4],
                   block[2 * fields + 4 + 4 * j:][:4]) for j in range(4)]
    else:
        pairs += [(unit[16 * fields + 32 * j + 4 * r:][:4], block[2 * fields + 4 * j:][:4])
                  for j in range(f.quant_bytes // 4)]
    return pairs


@pytest.mark.parametrize("fmt", X8_FORMATS)
def test_interleaved_rows_are_the_base_blocks_regrouped(fmt):
    """group / ungroup are inverse and lossless; the layout is the documented one (row r's
    scale at byte 2 r of its group's block, its quant bytes 4 j .. 4 j + 3 in chunk j; Q4_K:
    the 6-bit scales and mins a byte each); the dequantized values are gguf's for the base
    blocks."""
    f, rows = FORMATS[fmt], 2 * ROW_GROUP
    K, base = _k(fmt, 96, 768), f.base.name
    packed = _random_blocks(base, rows, K, seed=3)
    grouped = f.group(packed)
    assert grouped.shape == f.storage(rows, K)[0] == (2, K // f.block * 8 * f.block_bytes)
    np.testing.assert_array_equal(f.ungroup(grouped), packed)
    for g, r, k in ((0, 0, 0), (1, 5, 2), (1, 7, 1)):
        for ours, theirs in _layout_checks(f, packed, grouped, g, r, k):
            np.testing.assert_array_equal(ours, theirs, err_msg=f"group {g} row {r} block {k}")
    theirs = gguf_dequantize(packed, _gguf_type(base)).reshape(rows, K)
    np.testing.assert_array_equal(f.dequantize(grouped, K), theirs.astype(np.float32))


GGUF_QUANTIZES = [f for f in QUANT_FORMATS if FORMATS[f].block == 32]  # gguf lacks the k-quants'


@pytest.mark.parametrize("fmt", GGUF_QUANTIZES)
def test_quantize_matches_gguf_quantize(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((9, 128)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, 5] = 40.0  # an outlier
    ours = FORMATS[fmt].quantize(w)
    theirs = gguf_quantize(w, _gguf_type(fmt))
    np.testing.assert_array_equal(FORMATS[fmt].dequantize(ours, 128),
                                  gguf_dequantize(theirs, _gguf_type(fmt)).reshape(9, 128))


# relative RMS error of quantizing standard-normal weights with ggml's k-quant quantizers (which
# ours is): about 0.071 / 0.036 / 0.018 (Q4_K / Q5_K / Q6_K)
K_QUANT_RMS = {"q4_k": 0.075, "q5_k": 0.038, "q6_k": 0.019}
K_QUANTS = sorted(K_QUANT_RMS)


def _k_quant_rows(rows: int, seed: int) -> np.ndarray:
    """(rows, 512) weights that take every branch of ggml's k-quant searches: normal and
    heavy-tailed rows, an outlier, an all-zero super-block, an all-positive one (the minimum
    clamps to 0), a constant negative sub-block (max == min), a sparse one, tiny values (below
    Q6_K's 1e-15 scale floor)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, 512)).astype(np.float32)
    w[1] = rng.standard_t(3, 512) * 0.02
    w[2, :256] = 0
    w[2, 256:] = np.abs(w[2, 256:]) + 3
    w[3, :32] = -0.5
    w[3, 100] = 40.0
    w[3, 256:] *= rng.random(256) < 0.08
    w[4, :256] *= 1e-20
    return w


# LLVM fuses multiply-adds where the CPU has them; the quantizer's kernel is built without them
# on x86 only (kquant._target), so elsewhere a few sub-blocks may round differently
X86_ONLY = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="byte-exact only where the kernel builds without FMA (x86)")


@X86_ONLY
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quantizer_is_ggmls_reference_byte_for_byte(fmt):
    """Our k-quant quantizer (compiled searches) gives the bytes of ggml's reference quantizer,
    written out as scalar float32 loops in tests/ggml_kquants.py."""
    w = _k_quant_rows(5, seed=3)
    np.testing.assert_array_equal(FORMATS[fmt].quantize(w), ggml_kquants.quantize(w, fmt))


@X86_ONLY
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quantizer_is_libggmls_byte_for_byte(fmt):
    """The same against ggml's own ``quantize_row_*_ref`` in the library llama-cpp-python ships
    (the bench extra), on a larger matrix."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) "
                                    "carries libggml-base; without it the scalar reference checks")
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*"))
    if not libs:
        pytest.skip(f"no libggml-base.so next to {llama_cpp.__file__}")
    lib = ctypes.CDLL(str(libs[0]))
    w = np.concatenate([_k_quant_rows(8, seed=4),
                        np.random.default_rng(5).standard_normal((56, 512)).astype(np.float32)
                        * 0.02])
    theirs = np.zeros((len(w), 2 * FORMATS[fmt].block_bytes), np.uint8)
    getattr(lib, f"quantize_row_{fmt[:2]}_K_ref")(
        w.ctypes.data_as(ctypes.c_void_p), theirs.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int64(w.size))
    np.testing.assert_array_equal(FORMATS[fmt].quantize(w), theirs)


@pytest.mark.parametrize("fmt", sorted(K_QUANT_RMS))
def test_k_quantizer_round_trips_through_gguf_within_its_error(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((9, 512)).astype(np.float32)
    w[0, :256] = 0  # an all-zero super-block
    w[1, 5] = 40.0  # an outlier
    w[2, 256:] = np.abs(w[2, 256:]) + 3  # all positive: the minimum clamps to 0
    packed = FORMATS[fmt].quantize(w)
    assert packed.shape == (9, 2 * FORMATS[fmt].block_bytes)
    back = gguf_dequantize(packed, _gguf_type(fmt)).reshape(9, 512)
    np.testing.assert_array_equal(back[0, :256], 0)
    err = back[3:] - w[3:]
    assert np.sqrt((err ** 2).mean() / (w[3:] ** 2).mean()) < K_QUANT_RMS[fmt]
    assert np.abs(back[2, 256:] - w[2, 256:]).max() < 0.25
    assert np.isfinite(back).all()


# the layers whose V and down projection llama.cpp's quantizer stored in Q6_K when it made the
# Q4_K_M file of the TinyLlama-1.1B shape (22 layers) from a float16 GGUF (llama-cpp-python 0.3.36)
LLAMA_Q4_K_M_Q6_K_LAYERS_OF_22 = {0, 1, 4, 7, 10, 13, 16, 19, 20, 21}


@pytest.mark.parametrize("mix,base", [("q4_k_m", "q4_k"), ("q5_k_m", "q5_k")])
def test_k_quant_mixes_choose_llamacpps_formats(mix, base):
    """--weight-format q4_k_m / q5_k_m: the k-quant everywhere but Q6_K for the LM head and for
    V (its rows apart from Q / K) and the down projection of the layers llama.cpp picks; rebuild
    hints name the mix for an HF / preset model, "auto" for a GGUF (its own mix)."""
    from paged_decode.compile.params import param_specs
    from paged_decode.compile.weights import interleave_formats, resolve_formats, resolve_model
    from paged_decode.runtime.manifest import weight_policy

    source = resolve_model("tinyllama-1.1b")
    assert source.config.n_layers == 22 and not source.config.tie_word_embeddings
    weight_dtype, others = resolve_formats(source, mix)
    want = {"lm_head": "q6_k"}
    for layer in sorted(LLAMA_Q4_K_M_Q6_K_LAYERS_OF_22):
        want.update({f"layers.{layer}.wv": "q6_k", f"layers.{layer}.w_down": "q6_k"})
    assert (weight_dtype, dict(others)) == (base, want)
    names = {s.name for s in param_specs(source.config, weight_dtype, others)}
    assert {"layers.0.wqk", "layers.0.wv", "layers.2.wqkv"} <= names
    assert not {"layers.0.wqkv", "layers.2.wv"} & names
    stored = interleave_formats(source.config, weight_dtype, others)
    assert weight_policy(*stored, "tinyllama-1.1b") == mix
    assert weight_policy(*stored, "/models/tinyllama-q4_k_m.gguf") == "auto"
    # what llama.cpp types a 70B (80 layers, grouped-query attention): the other layers' V in
    # Q5_K where the mix gives Q4_K
    big = dataclasses.replace(source, config=dataclasses.replace(source.config, n_layers=80))
    v = [f for n, f in resolve_formats(big, mix)[1] if n.endswith(".wv")]
    assert sorted(v) == ["q5_k"] * (40 if base == "q4_k" else 0) + ["q6_k"] * 40


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quantizer_takes_read_only_aligned_input(fmt):
    """A GGUF's float32 tensors arrive as read-only memmaps, some on a 64-byte boundary (which
    the kernel would otherwise take without a copy): quantized as a writable copy is."""
    w = _k_quant_rows(5, seed=6)
    raw = np.empty(w.nbytes + 64, np.uint8)
    shift = (-raw.ctypes.data) % 64
    held = raw[shift:shift + w.nbytes].view(np.float32).reshape(w.shape)
    held[...] = w
    held.flags.writeable = False
    np.testing.assert_array_equal(FORMATS[fmt].quantize(held), FORMATS[fmt].quantize(w))


def test_a_preset_in_a_mix_keeps_v_apart_with_the_same_values():
    """A preset in q4_k_m: a layer whose V (rows apart) takes another format than Q / K reads
    its rows from the preset's one draw of Q / K / V; a layer where the fallback gives both
    one format joins them again."""
    from paged_decode.compile.weights import resolve_formats, resolve_model

    source = resolve_model("tiny")  # rows of 64: Q / K fall back to q4_1, V (Q6_K) to q8_0
    weight_dtype, others = resolve_formats(source, "q4_k_m")
    assert dict(others)["layers.1.wv"] == "q8_0" and "layers.0.wv" not in dict(others)
    fused = source.load_params("float32")["layers.1.wqkv"]
    params = source.load_params(weight_dtype, others)
    qk = source.config.q_size + source.config.kv_size
    for name, rows in (("wqk", fused[:qk]), ("wv", fused[qk:])):
        fmt = FORMATS[dict(others).get(f"layers.1.{name}", weight_dtype)]
        np.testing.assert_array_equal(params[f"layers.1.{name}"], fmt.quantize(rows))
    assert "layers.0.wqkv" in params and "layers.1.wqkv" not in params


def test_non_finite_weights_are_refused_before_quantizing():
    from paged_decode.compile.params import param_specs
    from paged_decode.compile.weights import _stored, resolve_model
    from paged_decode.runtime.errors import WeightsError

    spec = next(s for s in param_specs(resolve_model("llama-160m").config, "q4_k")
                if s.name == "layers.0.wo")
    w = np.zeros(spec.logical, np.float32)
    w[3, 7], w[5, 1] = np.nan, np.inf
    with pytest.raises(WeightsError, match=r"layers\.0\.wo: 2 weights are NaN or infinite"):
        _stored(spec, w)


# llama-160m's shape, and a narrow one of 80 layers with grouped-query attention (llama.cpp's
# 70B rule)
MIX_SHAPES = {"llama-160m": {}, "80-layer-gqa": dict(
    n_layers=80, hidden_size=256, n_q_heads=4, n_kv_heads=1, head_dim=64, intermediate_size=512,
    vocab_size=512)}


@X86_ONLY
@pytest.mark.parametrize("shape", sorted(MIX_SHAPES))
@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_k_quant_mixes_are_llama_quantizes_byte_for_byte(mix, shape, tmp_path):
    """Every parameter of our mix of a float16 GGUF is the bytes llama.cpp's quantizer
    (``llama_model_quantize``, no importance matrix) writes for that file."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) "
                                    "runs llama.cpp's quantizer")
    from paged_decode.bench import baselines
    from paged_decode.compile.weights import resolve_formats, resolve_model

    preset = resolve_model("llama-160m")
    preset = dataclasses.replace(preset, config=dataclasses.replace(preset.config,
                                                                    **MIX_SHAPES[shape]))
    f16 = baselines.write_gguf(preset.config, preset.load_params("float32"),
                               tmp_path / "f16.gguf", "float16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix.upper()}")
    params.nthread = 2
    out = tmp_path / f"{mix}.gguf"
    assert llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) == 0
    source, theirs = resolve_model(str(f16)), resolve_model(str(out))
    assert resolve_formats(source, mix) == resolve_formats(theirs, "auto")
    ours, stored = (s.load_params(*resolve_formats(s, p)) for s, p in ((source, mix),
                                                                        (theirs, "auto")))
    assert ours.keys() == stored.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], stored[name], err_msg=name)


def test_smollm2_tensors_pack_as_the_file_holds_them(smollm_gguf):
    """Every matrix of the native pack, so every quantized tensor of the file (210 Q4_1, the
    Q8_0 embedding), dequantizes bit for bit to what gguf's dequantizer gives for the file (Q /
    K rows unpermuted as transformers does)."""
    from collections import Counter

    from paged_decode.compile.params import matrix_shapes
    from paged_decode.compile.weights import gguf_matrix_types, resolve_formats, resolve_model

    source = resolve_model(str(smollm_gguf))
    base, others = resolve_formats(source, "auto")
    assert (base, others) == ("q4_1", (("embed", "q8_0"),))
    params = source.load_params(base, others)
    floats = source.load_params("float32")  # gguf's dequantizer, joined as the pack joins
    in_file = Counter(t.tensor_type.name for t in gguf.GGUFReader(smollm_gguf).tensors
                      if t.tensor_type not in (GGML.F32, GGML.F16))
    assert in_file == {"Q4_1": 210, "Q8_0": 1}
    types = gguf_matrix_types(source)
    assert Counter(t for parts in types.values() for t in parts) == in_file
    for name, (_rows, K) in matrix_shapes(source.config).items():
        fmt = dict(others).get(name, base)
        assert set(types[name]) == {FORMATS[fmt].gguf_type}, name
        ours = FORMATS[fmt].dequantize(params[name], K)
        assert ours.dtype == floats[name].dtype == np.float32, name
        np.testing.assert_array_equal(ours.view(np.uint32), floats[name].view(np.uint32),
                                      err_msg=name)
    cfg = source.config
    assert params["embed"].nbytes == cfg.vocab_size * cfg.hidden_size // 32 * 34


def test_cpu_layout_interleaves_the_32_weight_formats_and_loads_the_file_regrouped(
        smollm_gguf):
    """On a CPU target SmolLM2's Q4_1 matrices and its Q8_0 embedding (the tied LM head, whose
    int16 x Q8_0's interleaved kernels take) take the interleaved layout; the pack holds the
    file's blocks regrouped (ungrouped: the bytes the plain layout holds); Q6_K matrices too,
    and a Q6_K LM head (Q4_K_M's).  Rows are kept by a w_gate_up whose act rows do not fill
    groups of 8, an untied embedding and an LM head in a format whose interleaved kernels take
    int8 x only (Q4_0)."""
    import dataclasses

    from paged_decode.compile.config import preset
    from paged_decode.compile.weights import interleave_formats, resolve_formats, resolve_model

    source = resolve_model(str(smollm_gguf))
    base, others = interleave_formats(source.config, *resolve_formats(source, "auto"))
    assert (base, others) == ("q4_1x8", (("embed", "q8_0x8"),))
    grouped = source.load_params(base, others)
    plain = source.load_params("q4_1", (("embed", "q8_0"),))
    for name in ("layers.0.wqkv", "layers.7.w_gate_up", "layers.29.w_down", "layers.3.wo"):
        np.testing.assert_array_equal(FORMATS[base].ungroup(grouped[name]), plain[name],
                                      err_msg=name)
    np.testing.assert_array_equal(FORMATS["q8_0x8"].ungroup(grouped["embed"]), plain["embed"])

    cfg = preset("llama-160m")
    assert not cfg.tie_word_embeddings
    assert interleave_formats(cfg, "q6_k", (("lm_head", "q8_0"),)) == (
        "q6_kx8", (("embed", "q6_k"), ("lm_head", "q8_0x8")))
    assert interleave_formats(cfg, "q4_k", (("lm_head", "q6_k"),)) == (
        "q4_kx8", (("embed", "q4_k"), ("lm_head", "q6_kx8")))
    odd = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 4)
    got = dict(interleave_formats(odd, "q4_0", (("lm_head", "q8_0"),))[1])
    assert got["layers.0.w_gate_up"] == "q4_0" and got["lm_head"] == "q8_0x8"
    assert "layers.0.wo" not in got  # the base: q4_0x8
    got = dict(interleave_formats(cfg, "q4_0", (("embed", "q8_0"),))[1])
    assert got["embed"] == "q8_0" and got["lm_head"] == "q4_0"  # int8-x-only layout: rows
    odd_vocab = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 4)
    assert dict(interleave_formats(odd_vocab, "q8_0")[1])["lm_head"] == "q8_0"


def test_rebuild_hints_name_the_format_not_its_cpu_layout(smollm_gguf):
    """The ``--weight-dtype`` a rebuild hint gives chooses the artifact's formats again: its
    one format, CPU layout or not, with the Q8_0 LM head (or tied embedding) that choice
    brings; a GGUF's own mix of formats is "auto"; damaged values give "auto", not an error."""
    from paged_decode.compile.weights import interleave_formats, resolve_formats, resolve_model
    from paged_decode.runtime.manifest import weight_policy

    source = resolve_model("llama-160m")
    for fmt in ("q8_0", "q4_0", "q4_k", "float16"):
        stored = interleave_formats(source.config, *resolve_formats(source, fmt))
        assert weight_policy(*stored) == fmt
    smol = resolve_model(str(smollm_gguf))
    stored = interleave_formats(smol.config, *resolve_formats(smol, "auto"))
    assert stored == interleave_formats(smol.config, *resolve_formats(smol, weight_policy(
        *stored)))  # "q4_1" gives the file's own Q4_1 + Q8_0 embedding
    assert weight_policy("q4_kx8", {"lm_head": "q6_k", "layers.0.wv": "q6_k"}) == "auto"
    # an HF / preset model: a k-quant whose rows fall back, or a mix, is named again; tiny's
    # rows are never whole super-blocks, the SmolLM2 shape's only in part
    for model in ("tiny", "smollm2-135m-shape"):
        preset = resolve_model(model)
        for policy in ("q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"):
            stored = interleave_formats(preset.config, *resolve_formats(preset, policy))
            again = weight_policy(*stored, model)
            assert interleave_formats(preset.config, *resolve_formats(preset, again)) == stored, (
                model, policy, again)
    for damaged in (5, {"embed": 1}, [("a",)]):
        assert weight_policy("q4_0x8", damaged) in ("q4_0", "auto")
    assert weight_policy(None, None) == "auto"


def test_auto_formats_on_a_target_without_quantized_kernels(smollm_gguf, caplog):
    """WebGPU keeps no quantized format: "auto" dequantizes SmolLM2 to float16 and says why once;
    CUDA keeps the file's formats."""
    from paged_decode.compile.kernels.registry import no_quantized_kernels
    from paged_decode.compile.weights import resolve_formats, resolve_model

    source = resolve_model(str(smollm_gguf))
    with caplog.at_level("WARNING"):
        assert resolve_formats(source, "auto", no_quantized_kernels("webgpu")) == ("float16", ())
    (warning,) = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert "q4_1/q8_0 tensors dequantized to float16 (webgpu: WGSL has no 8-bit type" in warning
    assert resolve_formats(source, "auto", no_quantized_kernels("cuda")) == (
        "q4_1", (("embed", "q8_0"),))


# ------------------------------------------------------------------------------- kernels

def _x_as_quantized(x: np.ndarray, qmax: int = 127) -> np.ndarray:
    """x as the decode GEMV reads it: int8 per 32-block, dx = max|x| / 127, round half even
    (``qmax`` 32767: the LM head's int16)."""
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    top = np.float32(qmax)
    inv = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * (amax / top)).reshape(x.shape)


def _rmsnorm(x, g, eps):
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * g).astype(np.float32)


def _close(got, want):
    scale = max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(got, want, atol=QUANT_KERNEL_RTOL * scale, rtol=0)


def _weights(fmt, N, K, seed=0):
    """(stored rows, float64 dequantized); an interleaved format's rows in its base layout,
    so that ``_gate_up`` can join them (``_stored`` gives the kernels' layout)."""
    return quantized_weights(FORMATS[fmt].rows.name, N, K, seed, scale=0.1)


def _stored(fmt, rows):
    """Rows of ``_weights`` as ``fmt`` stores them (interleaved formats: grouped)."""
    return FORMATS[fmt].group(rows) if FORMATS[fmt].grouped else rows


def _gate_up(fmt, gate, up):
    return _stored(fmt, interleave_gate_up(gate, up))


# N not a multiple of the 16-row unit or the tile; K: one block, an odd count of blocks (k-quants:
# of 32-weight units too), SmolLM2's 576 (k-quants: 5 super-blocks, not a multiple of 4 units)
SHAPES = [(40, (32, 256)), (130, (160, 768)), (1000, (576, 1280))]


# every format through the plain, fused-norm and LM-head (int16 x) GEMVs; the epilogues, shared
# by all formats, with one 32-weight format and one k-quant
GEMV_CASES = [(f, *SHAPES[i], v) for f in QUANT_FORMATS
              for i, v in ((0, "none"), (2, "norm"), (1, "wide_x"))] + [
    (f, *SHAPES[i], v) for f in ("q4_1", "q4_k")
    for i, v in ((1, "residual"), (1, "norm_bias"), (2, "norm_wide_x"))]
# interleaved rows (whole groups of 8: N = 40 is 2.5 units of 16 rows; K = 32 one unit, 416 not
# a multiple of the 4 units in flight)
GEMV_CASES += [(f, *s, v) for f in X8_FORMATS for s, v in (
    ((40, (32, 256)), "none"), ((1000, (576, 1280)), "norm"))] + [
    ("q4_1x8", 136, (416, 0), v) for v in ("residual", "norm_bias")] + [
    (f, *s, v) for f in ("q8_0x8", "q6_kx8")
    for s, v in (((40, (32, 256)), "wide_x"), ((136, (416, 768)), "norm_wide_x"))]


@pytest.mark.parametrize("fmt,N,Ks,variant", GEMV_CASES)
def test_quantized_gemv(fmt, N, Ks, variant):
    K = _k(fmt, *Ks)
    rng = np.random.default_rng(2)
    packed, Wd = _weights(fmt, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    res = rng.standard_normal((1, N)).astype(np.float32)
    norm, wide_x = variant.startswith("norm"), variant.endswith("wide_x")
    epilogue = {"norm_bias": "bias", "residual": "residual"}.get(variant, "none")
    xs = _rmsnorm(x, g, 1e-5) if norm else x
    want = Wd @ _x_as_quantized(xs[0], 32767 if wide_x else 127).astype(np.float64)
    args = [_t(x)] + ([_t(g)] if norm else []) + [_t(_stored(fmt, packed))]
    if epilogue == "bias":
        args.append(_t(bias))
        want = want + bias
    if epilogue == "residual":
        args.append(_t(res))
        want = want + res[0]
    y = _t(np.zeros((1, N), np.float32))
    _compiled(quant.gemv, N, K, fmt, epilogue, 1e-5 if norm else None, wide_x)(*args, y)
    _close(y.numpy()[0], want)


@pytest.mark.parametrize("fmt,I,Ks", [(f, 300, (160, 768)) for f in QUANT_FORMATS] + [
    (f, 296, (160, 768)) for f in X8_FORMATS])  # 296 = 18 runs of 16 and one of 8
def test_quantized_gemv_swiglu(fmt, I, Ks):
    K = _k(fmt, *Ks)
    rng = np.random.default_rng(3)
    gate, gd = _weights(fmt, I, K, 4)
    up, ud = _weights(fmt, I, K, 5)
    W = _gate_up(fmt, gate, up)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    xq = _x_as_quantized(_rmsnorm(x, g, 1e-5)[0]).astype(np.float64)
    a, b = gd @ xq, ud @ xq
    want = a / (1 + np.exp(-a)) * b
    act = _t(np.zeros((1, I), np.float32))
    _compiled(quant.gemv_swiglu, I, K, fmt, 1e-5)(_t(x), _t(g), _t(W), act)
    _close(act.numpy()[0], want)


def _check_matmul(kernel, rng, x, packed, want, epilogue):
    """Run a prefill matmul over x (n, K) with a random bias / residual for its epilogue and
    compare with ``want`` (the product without it)."""
    n, N = x.shape[0], want.shape[1]
    args = [_t(x), _t(packed)]
    if epilogue == "bias":
        bias = rng.standard_normal(N).astype(np.float32)
        args.append(_t(bias))
        want = want + bias
    if epilogue == "residual":
        res = rng.standard_normal((n, N)).astype(np.float32)
        args.append(_t(res))
        want = want + res
    y = _t(np.zeros((n, N), np.float32))
    kernel(*args, y)
    _close(y.numpy(), want)


LINEAR_TILES = sorted({t["linear"] for t in TILES.values()})
# every format through one epilogue and tile; the epilogues and tiles, shared by all formats,
# with one 32-weight format and one k-quant
LINEAR_CASES = [(f, "bias", LINEAR_TILES[0]) for f in QUANT_FORMATS + X8_FORMATS] + [
    (f, e, t) for f in ("q4_0", "q6_k") for e in ("none", "residual") for t in LINEAR_TILES]


def _check_matmul_over_token_counts(factory, fmt, epilogue, seed, *options, qmax=None):
    """One compiled prefill matmul (130 rows; interleaved: 136) over 1, 3 and 70 tokens against
    numpy: x as it is, or (``qmax``) quantized per row as the decode GEMV quantizes it."""
    N, K = 136 if fmt in X8_FORMATS else 130, _k(fmt, 160, 768)
    rng = np.random.default_rng(seed)
    packed, Wd = _weights(fmt, N, K)
    kernel = _compiled(factory, N, K, fmt, epilogue, *options)
    for n in (1, 3, 70):
        x = rng.standard_normal((n, K)).astype(np.float32)
        xs = x if qmax is None else np.stack([_x_as_quantized(r, qmax) for r in x])
        _check_matmul(kernel, rng, x, _stored(fmt, packed), xs.astype(np.float64) @ Wd.T,
                      epilogue)


@pytest.mark.parametrize("fmt,epilogue,tile", LINEAR_CASES)
def test_quantized_prefill_linear(fmt, epilogue, tile):
    """One compiled kernel over 1, 3 and 70 tokens (a partial block of 64 rows after a whole)."""
    _check_matmul_over_token_counts(quant.linear, fmt, epilogue, 6, tile)


@pytest.mark.parametrize("factory", ["gemv", "linear_int8"])
def test_interleaved_rows_refuse_int16_x(factory):
    """The LM head's int16 x (``wide_x``) has interleaved kernels for Q8_0 and Q6_K only: a
    head in another format keeps its rows."""
    with pytest.raises(ValueError, match="int8 x only"):
        getattr(quant, factory)(64, 256, "q4_0x8", "none", *([None] if factory == "gemv" else []),
                                wide_x=True)


@pytest.mark.parametrize("fmt,int8", [
    pytest.param(f, i, id=f"{f}-{'int8' if i else 'float'}_tile")
    for f in QUANT_FORMATS for i in (False, True)] + [
    pytest.param(f, True, id=f"{f}-int8_tile") for f in X8_FORMATS] + [
    pytest.param("q4_1x8", False, id="q4_1x8-float_tile")])
def test_quantized_prefill_swiglu(fmt, int8):
    """The float tile over decoded weights (5 tokens) and the int8 tile (7: tiles of 4, 2, 1;
    x quantized per row as the decode GEMV's); interleaved rows: I = 40 (a run of 16, one of
    8), the int8 tile over 70 tokens (a block of 64, then 4 + 2)."""
    x8 = FORMATS[fmt].grouped
    I = 2 * GATE_UP_ROWS + (8 if x8 else 6)
    K, n = _k(fmt, 96, 256), (70 if x8 else 7) if int8 else 5
    rng = np.random.default_rng(7)
    gate, gd = _weights(fmt, I, K, 8)
    up, ud = _weights(fmt, I, K, 9)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = np.stack([_x_as_quantized(r) for r in x]).astype(np.float64) if int8 else x
    a, b = xs @ gd.T, xs @ ud.T
    act = _t(np.zeros((n, I), np.float32))
    kernel = (_compiled(quant.linear_swiglu_int8, I, K, fmt) if int8 else
              _compiled(quant.linear_swiglu, I, K, fmt, TILES[False]["swiglu"]))
    kernel(_t(x), _t(_gate_up(fmt, gate, up)), act)
    _close(act.numpy(), a / (1 + np.exp(-a)) * b)


# the int8 tiles (small batch buckets): every format with one epilogue, the other epilogues and
# the LM head's int16 x with one 32-weight format and one k-quant
INT8_CASES = [(f, "bias", False) for f in QUANT_FORMATS + X8_FORMATS] + [
    (f, e, w) for f in ("q4_1", "q4_k") for e, w in (("none", True), ("residual", False))] + [
    ("q4_0x8", e, False) for e in ("none", "residual")] + [
    (f, "none", True) for f in ("q8_0x8", "q6_kx8")]


@pytest.mark.parametrize("fmt,epilogue,wide_x", INT8_CASES)
def test_int8_tile_linear(fmt, epilogue, wide_x):
    """One kernel over 1, 3 and 70 tokens: 70 = 8 tiles of 8 in a block of 64, then 4 + 2 in
    the next; 3 = 2 + 1.  x quantized per row as the decode GEMV's."""
    _check_matmul_over_token_counts(quant.linear_int8, fmt, epilogue, 8, wide_x,
                                    qmax=32767 if wide_x else 127)


def _host_has_vnni() -> bool:
    from paged_decode.compile.kernels.cpu import has_vnni
    from paged_decode.compile.targets import resolve_target

    return has_vnni(resolve_target(None).target)


@pytest.mark.skipif(not _host_has_vnni(), reason="this CPU has no 256-bit vpdpbusd (AVX-512 "
                    "VNNI with VL, or AVX-VNNI): the vnni kernels cannot run here")
@pytest.mark.parametrize("fmt", X8_FORMATS)
def test_vnni_kernels_over_interleaved_rows(fmt):
    """The ``vpdpbusd`` dot products (taken where the target has VNNI) against numpy: the
    SwiGLU decode GEMV and the int8 tile over 70 tokens; their integer sums are the AVX2
    sequence's, so the GEMV's output is that kernel's bit for bit."""
    K, I = _k(fmt, 96, 512), 2 * GATE_UP_ROWS + 8
    rng = np.random.default_rng(11)
    gate, gd = _weights(fmt, I, K, 12)
    up, ud = _weights(fmt, I, K, 13)
    W = _t(_gate_up(fmt, gate, up))
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    xq = _x_as_quantized(_rmsnorm(x, g, 1e-5)[0]).astype(np.float64)
    a, b = gd @ xq, ud @ xq
    acts = []
    for vnni in (False, True):
        acts.append(_t(np.zeros((1, I), np.float32)))
        _compiled(quant.gemv_swiglu, I, K, fmt, 1e-5, quant.NTA, vnni)(_t(x), _t(g), W, acts[-1])
    _close(acts[1].numpy()[0], a / (1 + np.exp(-a)) * b)
    np.testing.assert_array_equal(acts[1].numpy(), acts[0].numpy())
    packed, Wd = _weights(fmt, 2 * I, K, 14)
    kernel = _compiled(quant.linear_int8, 2 * I, K, fmt, "none", False, True)
    xs = rng.standard_normal((70, K)).astype(np.float32)
    y = _t(np.zeros((70, 2 * I), np.float32))
    kernel(_t(xs), _t(_stored(fmt, packed)), y)
    _close(y.numpy(), np.stack([_x_as_quantized(r) for r in xs]).astype(np.float64) @ Wd.T)


@X86_ONLY
def test_quantized_kernels_take_vnni_by_the_targets_cpu():
    """A target whose CPU has VNNI (Zen 4, Ice Lake) gets ``vpdpbusd`` in its interleaved
    kernels; one without (Haswell, Zen 3) the AVX2 sequence, which every AVX2 CPU runs."""
    import tvm

    from paged_decode.compile.kernels.registry import kernels_for

    for mcpu, want in (("znver4", True), ("icelake-server", True), ("haswell", False),
                       ("znver3", False)):
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
        func = kernels_for("llvm", target).gemv(64, 256, "q4_0x8", "none", None)
        asm = tvm.compile(func, target=target).mod.inspect_source("asm")
        assert ("vpdpbusd" in asm) == want, mcpu


@X86_ONLY
def test_q6_k_decode_gemv_prefetches_into_l1_where_its_far_prefetch_stops_at_l2():
    """On Zen 4 (the L2 hint) the Q6_K x8 decode GEMV adds a near ``prefetcht0`` to its far
    ``prefetcht1``, Q5_K x8 keeps the one; a CPU without the L2 hint (Haswell: ``prefetchnta``)
    gets no near prefetch.  The GEMV with both prefetches still computes the same products."""
    import tvm

    from paged_decode.compile.kernels.registry import kernels_for

    def asm(mcpu, fmt):
        target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
        func = kernels_for("llvm", target).gemv(64, 512, fmt, "none", None)
        return tvm.compile(func, target=target).mod.inspect_source("asm")

    zen_q6, zen_q5, haswell_q6 = asm("znver4", "q6_kx8"), asm("znver4", "q5_kx8"), asm(
        "haswell", "q6_kx8")
    assert "prefetcht1" in zen_q6 and "prefetcht0" in zen_q6
    assert "prefetcht1" in zen_q5 and "prefetcht0" not in zen_q5
    assert "prefetchnta" in haswell_q6 and "prefetcht0" not in haswell_q6
    N, K = 48, 512
    packed, Wd = _weights("q6_kx8", N, K, 21)
    x = np.random.default_rng(21).standard_normal((1, K)).astype(np.float32)
    y = _t(np.zeros((1, N), np.float32))
    _compiled(quant.gemv, N, K, "q6_kx8", "none", None, False, quant.L2)(
        _t(x), _t(_stored("q6_kx8", packed)), y)
    _close(y.numpy()[0], Wd @ _x_as_quantized(x[0]).astype(np.float64))


def test_prefill_of_long_rows_takes_the_int8_tile():
    """Prefill matmuls over rows of at least INT8_MIN_K weights are the int8 tiles (LM head:
    int16 x); shorter rows keep the float tile over decoded weights."""
    long_k, short_k = quant.INT8_MIN_K, quant.INT8_MIN_K - 256

    def name(func):
        return func.attrs["global_symbol"]

    assert name(quant.linear(64, long_k, "q4_0")) == name(quant.linear_int8(64, long_k, "q4_0"))
    assert name(quant.linear(64, long_k, "q8_0", "none", TILES[False]["linear"], True)) == name(
        quant.linear_int8(64, long_k, "q8_0", "none", True))
    assert name(quant.linear_swiglu(32, long_k, "q4_k")) == name(
        quant.linear_swiglu_int8(32, long_k, "q4_k"))
    for func in (quant.linear(64, short_k, "q4_0"), quant.linear_swiglu(32, short_k, "q4_k")):
        assert "_i8" not in name(func)


@pytest.mark.parametrize("fmt", QUANT_FORMATS + ("q8_0x8", "q6_kx8"))  # x8: tied LM heads'
def test_quantized_embedding_is_the_exact_dequantized_row(fmt):
    V, H = 56, _k(fmt, 96, 512)
    packed, Wd = _weights(fmt, V, H)
    ids = np.array([0, 55, 7, 7, 50], np.int32)
    x = _t(np.zeros((5, H), np.float32))
    kernel = _compiled(quant.embedding, V, H, fmt, None)
    kernel(_t(ids), _t(_stored(fmt, packed)), x)
    np.testing.assert_array_equal(x.numpy(), Wd[ids].astype(np.float32))
    bad = _t(np.array([V], np.int32))
    with pytest.raises(Exception, match="out of range"):
        kernel(bad, _t(_stored(fmt, packed)), _t(np.zeros((1, H), np.float32)))


def test_batch_buckets_over_interleaved_rows_take_the_int8_tile():
    """Every batch bucket over interleaved rows takes the int8 tile (the decode GEMV's
    arithmetic); other quantized formats up to SMALL_ROWS rows, float weights up to theirs."""
    from paged_decode.compile.kernels.cpu.batch import SMALL_ROWS as FLOAT_SMALL_ROWS
    from paged_decode.compile.kernels.registry import kernels_for

    k = kernels_for("llvm")
    assert all(k.small_rows_limit(f) >= 1024 for f in X8_FORMATS)
    assert k.small_rows_limit("q4_0") == k.small_rows_limit("q6_k") == quant.SMALL_ROWS
    assert k.small_rows_limit("float16") == FLOAT_SMALL_ROWS


def test_float_small_buckets_take_the_matmul_once_x_outgrows_l1():
    """Float weights: the small-batch GEMVs while the bucket's rows of x (float32) fit in
    SMALL_ROWS_X_BYTES, the matmul past that; quantized weights ignore the limit."""
    from paged_decode.compile.kernels.cpu.batch import SMALL_ROWS, SMALL_ROWS_X_BYTES
    from paged_decode.compile.kernels.registry import kernels_for

    k = kernels_for("llvm")
    k_fit = SMALL_ROWS_X_BYTES // (4 * SMALL_ROWS)  # the K at which 8 rows of x fill it
    assert k.takes_small_rows("float16", SMALL_ROWS, k_fit - 1)
    assert not k.takes_small_rows("float16", SMALL_ROWS, k_fit)
    assert not k.takes_small_rows("float32", SMALL_ROWS, 2048)
    assert k.takes_small_rows("float32", 2, 2048)
    assert not k.takes_small_rows("float16", SMALL_ROWS + 1, 64)
    assert k.takes_small_rows("q4_0", quant.SMALL_ROWS, 8192)


def test_the_progress_line_names_every_weight_format():
    """The line ``prepare`` prints names the default format and every other one (its matrix,
    or its count of matrices), so a Q6_K LM head among twenty Q6_K x8 matrices is not hidden."""
    from paged_decode.compile.api import weights_line

    formats = [("embed", "q5_k"), ("lm_head", "q6_k")] + [
        (f"layers.{i}.{m}", "q6_kx8") for i in range(10) for m in ("wv", "w_down")]
    assert weights_line("tl", "q5_kx8", formats) == (
        "weights of tl as q5_kx8, 20 matrices q6_kx8, embed q5_k, lm_head q6_k")
    assert weights_line("smol", "q4_1x8", [("embed", "q8_0x8")]) == (
        "weights of smol as q4_1x8, embed q8_0x8")
    assert weights_line("f", "float32", []) == "weights of f as float32"
