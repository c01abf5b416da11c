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

from .conftest import QUANT_KERNEL_RTOL
from .test_kernels import _compiled, _t

GGML = gguf.GGMLQuantizationType


def _gguf_type(fmt):
    return GGML[FORMATS[fmt].gguf_type]


def _random_blocks(fmt: str, n_rows: int, K: int, seed: int = 0) -> np.ndarray:
    """Random valid block bytes: random quants, finite float16 scales of both signs."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_rows * K // 32, f.block_bytes), dtype=np.uint8)
    n_scales = 2 if fmt == "q4_1" else 1
    scales = rng.uniform(-0.2, 0.2, (len(blocks), n_scales)).astype(np.float16)
    blocks[:, :2 * n_scales] = scales.view(np.uint8)
    return blocks.reshape(n_rows, -1)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_dequantize_is_bit_exact_with_gguf_on_random_blocks(fmt):
    K = 96
    packed = _random_blocks(fmt, 7, K)
    ours = FORMATS[fmt].dequantize(packed, K)
    theirs = gguf_dequantize(packed, _gguf_type(fmt)).reshape(7, K)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantize_matches_gguf_quantize(fmt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((9, 128)).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, 5] = 40.0  # an outlier
    ours = FORMATS[fmt].quantize(w)
    theirs = gguf_quantize(w, _gguf_type(fmt))
    np.testing.assert_array_equal(FORMATS[fmt].dequantize(ours, 128),
                                  gguf_dequantize(theirs, _gguf_type(fmt)).reshape(9, 128))


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


# ------------------------------------------------------------------------------- kernels

def _x_as_quantized(x: np.ndarray) -> np.ndarray:
    """x as the decode GEMV reads it: int8 per 32-block, dx = max|x| / 127, round half even."""
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * (amax / np.float32(127))).reshape(x.shape)


def _rmsnorm(x, g, eps):
    return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * g).astype(np.float32)


def _close(got, want):
    scale = max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(got, want, atol=QUANT_KERNEL_RTOL * scale, rtol=0)


def _weights(fmt, N, K, seed=0):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.1
    packed = FORMATS[fmt].quantize(w)
    return packed, FORMATS[fmt].dequantize(packed, K).astype(np.float64)


# N not a multiple of the 16-row unit or the tile; K: one block, an odd count, SmolLM2's 576
SHAPES = [(40, 32), (130, 160), (1000, 576)]


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("N,K,variant", [(*SHAPES[0], "none"), (*SHAPES[1], "residual"),
                                         (*SHAPES[2], "norm"), (*SHAPES[1], "norm_bias"),
                                         (*SHAPES[1], "float_x"), (*SHAPES[2], "norm_float_x")])
def test_quantized_gemv(fmt, N, K, variant):
    rng = np.random.default_rng(2)
    packed, Wd = _weights(fmt, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.uniform(0.5, 1.5, K).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    res = rng.standard_normal((1, N)).astype(np.float32)
    norm, float_x = variant.startswith("norm"), variant.endswith("float_x")
    epilogue = {"norm_bias": "bias", "residual": "residual"}.get(variant, "none")
    xs = _rmsnorm(x, g, 1e-5) if norm else x
    want = Wd @ (xs[0] if float_x else _x_as_quantized(xs[0])).astype(np.float64)
    args = [_t(x)] + ([_t(g)] if norm else []) + [_t(packed)]
    if epilogue == "bias":
        args.append(_t(bias))
        want = want + bias
    if epilogue == "residual":
        args.append(_t(res))
        want = want + res[0]
    y = _t(np.zeros((1, N), np.float32))
    _compiled(quant.gemv, N, K, fmt, epilogue, 1e-5 if norm else None, float_x)(*args, y)
    _close(y.numpy()[0], want)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("I,K", [(40, 64), (300, 160)])
def test_quantized_gemv_swiglu(fmt, I, K):
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


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("n", [1, 3, 70])
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual"])
@pytest.mark.parametrize("tile", sorted({t["linear"] for t in TILES.values()}))
def test_quantized_prefill_linear(fmt, n, epilogue, tile):
    N, K = 130, 160
    rng = np.random.default_rng(6)
    packed, Wd = _weights(fmt, N, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    want = x.astype(np.float64) @ Wd.T
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
    _compiled(quant.linear, N, K, fmt, epilogue, tile)(*args, y)
    _close(y.numpy(), want)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantized_prefill_swiglu(fmt):
    I, K, n = 2 * GATE_UP_ROWS + 6, 96, 5
    rng = np.random.default_rng(7)
    gate, gd = _weights(fmt, I, K, 8)
    up, ud = _weights(fmt, I, K, 9)
    x = rng.standard_normal((n, K)).astype(np.float32)
    a, b = x @ gd.T, x @ ud.T
    act = _t(np.zeros((n, I), np.float32))
    _compiled(quant.linear_swiglu, I, K, fmt, TILES[False]["swiglu"])(
        _t(x), _t(interleave_gate_up(gate, up)), act)
    _close(act.numpy(), a / (1 + np.exp(-a)) * b)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quantized_embedding_is_the_exact_dequantized_row(fmt):
    V, H = 50, 96
    packed, Wd = _weights(fmt, V, H)
    ids = np.array([0, 49, 7, 7], np.int32)
    x = _t(np.zeros((4, H), np.float32))
    _compiled(quant.embedding, V, H, fmt, None)(_t(ids), _t(packed), x)
    np.testing.assert_array_equal(x.numpy(), Wd[ids].astype(np.float32))
    bad = _t(np.array([V], np.int32))
    with pytest.raises(Exception, match="out of range"):
        _compiled(quant.embedding, V, H, fmt, None)(bad, _t(packed), _t(np.zeros((1, H),
                                                                                np.float32)))
