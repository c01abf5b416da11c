"""Weight formats: our quantizer / dequantizer against the gguf package's, and the kernels that
read the packed blocks against numpy."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from paged_decode.compile.formats import FORMATS, QUANT_FORMATS
from paged_decode.compile.kernels.cpu import quant
from paged_decode.compile.kernels.cpu.linear import TILES
from paged_decode.compile.params import GATE_UP_ROWS, interleave_gate_up

from .conftest import QUANT_KERNEL_RTOL, quantized_weights
from .test_kernels import _compiled, _t

GGML = gguf.GGMLQuantizationType


def _gguf_type(fmt):
    return GGML[FORMATS[fmt].gguf_type]


# byte offsets of each format's float16 scales inside a block (the rest are random quant bytes)
SCALE_BYTES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
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
    assert {FORMATS[f].gguf_type for f in QUANT_FORMATS} == {"Q8_0", "Q4_0", "Q4_1", "Q4_K",
                                                             "Q5_K", "Q6_K"}
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


# relative RMS error of quantizing standard-normal weights: ggml's k-quant quantizers reach
# about 0.07 / 0.035 / 0.018 (Q4_K / Q5_K / Q6_K) on such data; ours may not be worse by much
K_QUANT_RMS = {"q4_k": 0.08, "q5_k": 0.04, "q6_k": 0.02}


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


def test_smollm2_tensors_pack_as_the_file_holds_them(smollm_gguf):
    """The native pack's bytes of each parameter dequantize to what gguf gives for the file
    (Q / K rows unpermuted as transformers does)."""
    from paged_decode.compile.weights import resolve_formats, resolve_model

    source = resolve_model(str(smollm_gguf))
    base, others = resolve_formats(source, "auto")
    assert (base, others) == ("q4_1", (("embed", "q8_0"),))
    params = source.load_params(base, others)
    floats = source.load_params("float32")
    cfg = source.config
    for name in ("embed", "layers.0.wqkv", "layers.7.w_gate_up", "layers.29.w_down",
                 "layers.3.wo"):
        fmt = "q8_0" if name == "embed" else "q4_1"
        K = floats[name].shape[1]
        np.testing.assert_array_equal(FORMATS[fmt].dequantize(params[name], K), floats[name],
                                      err_msg=name)
    assert params["embed"].nbytes == cfg.vocab_size * cfg.hidden_size // 32 * 34


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
    return quantized_weights(fmt, N, K, seed, scale=0.1)


# N not a multiple of the 16-row unit or the tile; K: one block, an odd count of blocks (k-quants:
# of 32-weight units too), SmolLM2's 576 (k-quants: 5 super-blocks, not a multiple of 4 units)
SHAPES = [(40, (32, 256)), (130, (160, 768)), (1000, (576, 1280))]


# every format through the plain, fused-norm and LM-head (int16 x) GEMVs; the epilogues, shared
# by all formats, with one 32-weight format and one k-quant
GEMV_CASES = [(f, *SHAPES[i], v) for f in QUANT_FORMATS
              for i, v in ((0, "none"), (2, "norm"), (1, "wide_x"))] + [
    (f, *SHAPES[i], v) for f in ("q4_1", "q4_k")
    for i, v in ((1, "residual"), (1, "norm_bias"), (2, "norm_wide_x"))]


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
    args = [_t(x)] + ([_t(g)] if norm else []) + [_t(packed)]
    if epilogue == "bias":
        args.append(_t(bias))
        want = want + bias
    if epilogue == "residual":
        args.append(_t(res))
        want = want + res[0]
    y = _t(np.zeros((1, N), np.float32))
    _compiled(quant.gemv, N, K, fmt, epilogue, 1e-5 if norm else None, wide_x)(*args, y)
    _close(y.numpy()[0], want)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("I,Ks", [(300, (160, 768))])
def test_quantized_gemv_swiglu(fmt, I, Ks):
    K = _k(fmt, *Ks)
    rng = np.random.default_rng(3)
    gate, gd = _weights(fmt, I, K, 4)
    up, ud = _weights(fmt, I, K, 5)
    W = interleave_gate_up(gate, up)
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
LINEAR_CASES = [(f, "bias", LINEAR_TILES[0]) for f in QUANT_FORMATS] + [
    (f, e, t) for f in ("q4_0", "q6_k") for e in ("none", "residual") for t in LINEAR_TILES]


def _check_matmul_over_token_counts(factory, fmt, epilogue, seed, *options, qmax=None):
    """One compiled prefill matmul (130 rows) over 1, 3 and 70 tokens against numpy: x as it
    is, or (``qmax``) quantized per row as the decode GEMV quantizes it."""
    N, K = 130, _k(fmt, 160, 768)
    rng = np.random.default_rng(seed)
    packed, Wd = _weights(fmt, N, K)
    kernel = _compiled(factory, N, K, fmt, epilogue, *options)
    for n in (1, 3, 70):
        x = rng.standard_normal((n, K)).astype(np.float32)
        xs = x if qmax is None else np.stack([_x_as_quantized(r, qmax) for r in x])
        _check_matmul(kernel, rng, x, packed, xs.astype(np.float64) @ Wd.T, epilogue)


@pytest.mark.parametrize("fmt,epilogue,tile", LINEAR_CASES)
def test_quantized_prefill_linear(fmt, epilogue, tile):
    """One compiled kernel over 1, 3 and 70 tokens (a partial block of 64 rows after a whole)."""
    _check_matmul_over_token_counts(quant.linear, fmt, epilogue, 6, tile)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("int8", [False, True], ids=["float_tile", "int8_tile"])
def test_quantized_prefill_swiglu(fmt, int8):
    """The float tile over decoded weights (5 tokens) and the int8 tile (7: tiles of 4, 2, 1;
    x quantized per row as the decode GEMV's)."""
    I, K, n = 2 * GATE_UP_ROWS + 6, _k(fmt, 96, 256), 7 if int8 else 5
    rng = np.random.default_rng(7)
    gate, gd = _weights(fmt, I, K, 8)
    up, ud = _weights(fmt, I, K, 9)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = np.stack([_x_as_quantized(r) for r in x]).astype(np.float64) if int8 else x
    a, b = xs @ gd.T, xs @ ud.T
    act = _t(np.zeros((n, I), np.float32))
    kernel = (_compiled(quant.linear_swiglu_int8, I, K, fmt) if int8 else
              _compiled(quant.linear_swiglu, I, K, fmt, TILES[False]["swiglu"]))
    kernel(_t(x), _t(interleave_gate_up(gate, up)), act)
    _close(act.numpy(), a / (1 + np.exp(-a)) * b)


# the int8 tiles (small batch buckets): every format with one epilogue, the other epilogues and
# the LM head's int16 x with one 32-weight format and one k-quant
INT8_CASES = [(f, "bias", False) for f in QUANT_FORMATS] + [
    (f, e, w) for f in ("q4_1", "q4_k") for e, w in (("none", True), ("residual", False))]


@pytest.mark.parametrize("fmt,epilogue,wide_x", INT8_CASES)
def test_int8_tile_linear(fmt, epilogue, wide_x):
    """One kernel over 1, 3 and 70 tokens: 70 = 8 tiles of 8 in a block of 64, then 4 + 2 in
    the next; 3 = 2 + 1.  x quantized per row as the decode GEMV's."""
    _check_matmul_over_token_counts(quant.linear_int8, fmt, epilogue, 8, wide_x,
                                    qmax=32767 if wide_x else 127)


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


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantized_embedding_is_the_exact_dequantized_row(fmt):
    V, H = 50, _k(fmt, 96, 512)
    packed, Wd = _weights(fmt, V, H)
    ids = np.array([0, 49, 7, 7], np.int32)
    x = _t(np.zeros((4, H), np.float32))
    kernel = _compiled(quant.embedding, V, H, fmt, None)
    kernel(_t(ids), _t(packed), x)
    np.testing.assert_array_equal(x.numpy(), Wd[ids].astype(np.float32))
    bad = _t(np.array([V], np.int32))
    with pytest.raises(Exception, match="out of range"):
        kernel(bad, _t(packed), _t(np.zeros((1, H), np.float32)))
