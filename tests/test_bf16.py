"""bfloat16 weights, natively: the pack holds each weight's 2 bytes as the checkpoint has them,
and the kernels widen them to float32 exactly (bits << 16).

The codec against torch's rounding; the CPU kernels against numpy; the GPU kernels against
numpy on OpenCL (pocl on a CPU) and CUDA (``gpu``), and built into a CUDA artifact without a
GPU; an HF checkpoint saved in bfloat16 and the BF16 GGUF llama.cpp's converter writes of it,
each generating transformers' greedy tokens with its logits; ``--weight-dtype bfloat16`` of a
float32 checkpoint storing what torch's ``.to(torch.bfloat16)`` gives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from paged_decode.compile import weights
from paged_decode.compile.api import key_of
from paged_decode.compile.formats import FORMATS, by_gguf_type
from paged_decode.compile.kernels.registry import kernels_for
from paged_decode.compile.params import gate_up_row, interleave_gate_up
from paged_decode.compile.targets import resolve_target
from paged_decode.compile.weights import resolve_formats, resolve_model
from paged_decode.runtime.errors import ConfigError

from . import gguf_files
from .conftest import BF16_LOGIT_TOL, LOGIT_TOL, _save
from .test_families import llama_cpp_permute
from .test_runtime_hf import hf_reference, run_ours
from .test_targets import LAUNCHERS, OPTS, _device, _library_bytes, _run

BF16 = FORMATS["bfloat16"]
PROMPT = [0, 5, 17, 42, 99, 7, 3, 250, 12, 64]
STEPS = 32


def _torch_bits(x: np.ndarray) -> np.ndarray:
    """uint16 patterns of torch's float32 -> bfloat16 conversion (round to nearest even)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(
        torch.int16).numpy().view(np.uint16)


def _weights(rows: int, K: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed bfloat16 rows, their float64 values) of seeded normal weights, std 0.05."""
    w = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32) * 0.05
    packed = BF16.quantize(w)
    return packed, BF16.dequantize(packed, K).astype(np.float64)


def _silu_mul(gate, up):
    return gate / (1 + np.exp(-gate)) * up


# -- the format ----------------------------------------------------------------------------------
def test_rounding_is_torch_s():
    """Ties to even both ways, the largest values rounding up to infinity, subnormals, signed
    zeros, infinities, and a million random finite float32 bit patterns as torch rounds them;
    a NaN stays a NaN (its payload is the converter's own: torch's differs by code path)."""
    special = np.array([0.0, -0.0, 1.0, -1.5, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20,
                        3.3895314e38, 3.4028235e38, -3.4028235e38, 1e-40, -1e-45, 2 ** -126,
                        np.inf, -np.inf], np.float32)
    random = np.random.default_rng(0).integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(
        np.uint32).view(np.float32)
    for x in (special, random[np.isfinite(random)]):
        np.testing.assert_array_equal(BF16.quantize(x[None]).view(np.uint16)[0], _torch_bits(x))
    nan = BF16.quantize(np.array([[np.nan, -np.nan]], np.float32))
    assert np.isnan(BF16.dequantize(nan, 2)).all()


def test_layout_is_two_bytes_a_weight_read_back_exactly():
    assert not BF16.quantized and BF16.byte_rows and by_gguf_type("BF16") is BF16
    assert BF16.storage(3, 40) == ((3, 80), "uint8") and BF16.row_bytes(40) == 80
    assert BF16.bits_per_weight == 16
    packed, values = _weights(3, 40, 0)
    np.testing.assert_array_equal(BF16.quantize(values.astype(np.float32)), packed)
    np.testing.assert_array_equal(
        values, (packed.view(np.uint16).astype(np.uint32) << 16).view(np.float32))


def test_a_target_without_byte_buffers_keeps_bf16_exact_otherwise(qwen2_ckpt):
    """WebGPU reads no 8-bit buffers: asking for bfloat16 there is a ConfigError naming the
    target and the choices; "auto" keeps a bfloat16 checkpoint's values in float32 there, and
    bfloat16 on the targets that read bytes (the artifact key, nothing compiled)."""
    model = str(qwen2_ckpt.path)
    with pytest.raises(ConfigError, match=r"weight_dtype='bfloat16': webgpu: .*float16 or float32"):
        key_of(model, target="webgpu", weight_dtype="bfloat16")
    for target, want in (("webgpu", "float32"), ("vulkan", "float32"), ("cuda", "bfloat16"),
                         (None, "bfloat16")):
        assert key_of(model, target=target)["key"]["weight_dtype"] == want, target


# -- the CPU kernels against numpy ---------------------------------------------------------------
def _cpu(func):
    lib = tvm.compile(func, target=resolve_target(None).target)
    return lib[func.attrs["global_symbol"]]


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _close(got, want):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def cpu_kernels():
    return kernels_for("llvm", resolve_target(None).target)


@pytest.mark.parametrize("epilogue,norm", [("none", True), ("bias", True), ("residual", False)])
def test_cpu_decode_gemv(cpu_kernels, epilogue, norm):
    N, K = 300, 520  # rows in several units, K with a tail past the vector width
    rng = np.random.default_rng(1)
    w, wd = _weights(N, K, 1)
    x, g = rng.standard_normal((1, K)).astype(np.float32), rng.standard_normal(K).astype(np.float32)
    extra = {"bias": rng.standard_normal(N).astype(np.float32),
             "residual": rng.standard_normal((1, N)).astype(np.float32)}.get(epilogue)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean() + 1e-5) * g if norm else x
    y = _t(np.zeros((1, N), np.float32))
    args = [_t(x)] + ([_t(g)] if norm else []) + [_t(w)] + ([] if extra is None else [_t(extra)])
    _cpu(cpu_kernels.gemv(N, K, "bfloat16", epilogue, 1e-5 if norm else None))(*args, y)
    _close(y.numpy(), xn @ wd.T + (0 if extra is None else extra))


def test_cpu_swiglu_gemv_matmul_and_small_batch(cpu_kernels):
    """SwiGLU over gate / up runs: the decode GEMV, the prefill matmul (7 tokens: full tiles and
    single-token passes) and the small-batch GEMV (3 rows)."""
    I, K, n = 200, 136, 7
    rng = np.random.default_rng(2)
    gate, gd = _weights(I, K, 2)
    up, ud = _weights(I, K, 3)
    w = interleave_gate_up(gate, up)  # whole rows of bytes: the same runs as of values
    x, g = rng.standard_normal((n, K)).astype(np.float32), np.ones(K, np.float32)
    act = _t(np.zeros((1, I), np.float32))
    _cpu(cpu_kernels.gemv_swiglu(I, K, "bfloat16", 1e-5))(_t(x[:1]), _t(g), _t(w), act)
    xn = x[:1] / np.sqrt((x[:1].astype(np.float64) ** 2).mean() + 1e-5)
    _close(act.numpy(), _silu_mul(xn @ gd.T, xn @ ud.T))
    want = _silu_mul(x @ gd.T, x @ ud.T)
    act = _t(np.zeros((n, I), np.float32))
    _cpu(cpu_kernels.linear_swiglu(I, K, "bfloat16"))(_t(x), _t(w), act)
    _close(act.numpy(), want)
    act = _t(np.zeros((3, I), np.float32))
    _cpu(cpu_kernels.linear_swiglu_rows(I, K, "bfloat16", 3))(_t(x[:3]), _t(w), act)
    _close(act.numpy(), want[:3])


@pytest.mark.parametrize("n", [1, 70])  # one token; two 64-token blocks
def test_cpu_prefill_matmul_and_small_batch(cpu_kernels, n):
    N, K = 40, 72
    rng = np.random.default_rng(n)
    w, wd = _weights(N, K, 4)
    x = rng.standard_normal((n, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    y = _t(np.zeros((n, N), np.float32))
    _cpu(cpu_kernels.linear(N, K, "bfloat16", "bias"))(_t(x), _t(w), _t(bias), y)
    _close(y.numpy(), x @ wd.T + bias)
    rows = min(n, 4)
    y = _t(np.zeros((rows, N), np.float32))
    _cpu(cpu_kernels.linear_rows(N, K, "bfloat16", "none", rows))(_t(x[:rows]), _t(w), y)
    _close(y.numpy(), x[:rows] @ wd.T)


def test_cpu_embedding_is_exact(cpu_kernels):
    V, H = 50, 72
    w, wd = _weights(V, H, 5)
    ids = np.array([3, 0, V - 1], np.int32)
    x = _t(np.zeros((3, H), np.float32))
    _cpu(cpu_kernels.embedding(V, H, "bfloat16"))(_t(ids), _t(w), x)
    np.testing.assert_array_equal(x.numpy(), wd[ids].astype(np.float32))


# -- the GPU kernels against numpy (OpenCL through pocl; CUDA where there is a GPU) ------------
@pytest.mark.parametrize("launch", LAUNCHERS)
def test_gpu_kernels(launch):
    """GEMV (fused norm + bias; residual), SwiGLU GEMV, tiled matmul and SwiGLU matmul and the
    embedding, each weight decoded from its two stored bytes."""
    from paged_decode.compile.kernels.gpu import gemv as gpu_gemv
    from paged_decode.compile.kernels.gpu import linear as gpu_linear
    from paged_decode.compile.kernels.gpu import norm as gpu_norm

    N, K, n, I = 40, 1302, 33, 72  # K: coalesced steps of 2 weights a lane, then a tail
    rng = np.random.default_rng(6)
    w, wd = _weights(N, K, 6)
    x, g = rng.standard_normal((n, K)).astype(np.float32), rng.standard_normal(K).astype(np.float32)
    bias, res = rng.standard_normal(N).astype(np.float32), rng.standard_normal((n, N)).astype(
        np.float32)
    x1 = x[:1]
    xn = x1 / np.sqrt((x1.astype(np.float64) ** 2).mean() + 1e-5) * g
    warp = (32, gpu_gemv.R, 1)
    grid = (-(-N // (gpu_gemv.R * gpu_gemv._rows_per_warp(N))), 1, 1)
    y = launch(gpu_gemv.gemv(N, K, "bfloat16", "bias", 1e-5),
               dict(x=x1, g=g, W=w, bias=bias, y=np.zeros((1, N), np.float32)), {}, grid,
               warp)["y"]
    _close(y, xn @ wd.T + bias)
    y = launch(gpu_gemv.gemv(N, K, "bfloat16", "residual"),
               dict(x=x1, W=w, res=res[:1], y=np.zeros((1, N), np.float32)), {}, grid, warp)["y"]
    _close(y, x1 @ wd.T + res[:1])

    wgu, wgu_d = _weights(2 * I, K, 7)
    gate = wgu_d[[gate_up_row(i, I, False) for i in range(I)]]
    up = wgu_d[[gate_up_row(i, I, True) for i in range(I)]]
    act = launch(gpu_gemv.gemv_swiglu(I, K, "bfloat16", 1e-5),
                 dict(x=x1, g=g, W=wgu, act=np.zeros((1, I), np.float32)), {},
                 (-(-I // (gpu_gemv.R * gpu_gemv._rows_per_warp(I))), 1, 1), warp)["act"]
    _close(act, _silu_mul(xn @ gate.T, xn @ up.T))

    tiles = (gpu_linear.TX, gpu_linear.TY, 1)
    y = launch(gpu_linear.linear(N, K, "bfloat16", "residual"),
               dict(x=x, W=w, res=res, y=np.zeros((n, N), np.float32)), dict(n=n),
               (-(-N // gpu_linear.BN), -(-n // gpu_linear.BM), 1), tiles)["y"]
    _close(y, x @ wd.T + res)
    act = launch(gpu_linear.linear_swiglu(I, K, "bfloat16"),
                 dict(x=x, W=wgu, act=np.zeros((n, I), np.float32)), dict(n=n),
                 (-(-I // gpu_linear.BN), -(-n // gpu_linear.BM), 1), tiles)["act"]
    _close(act, _silu_mul(x @ gate.T, x @ up.T))

    ids = np.array([3, 0, N - 1, N, -1], np.int32)  # the last two: out of range, zero rows
    emb = launch(gpu_norm.embedding(N, K, "bfloat16"),
                 dict(ids=ids, table=w, x=np.full((5, K), np.nan, np.float32)), dict(n=5),
                 (5, 1, 1), (gpu_norm.block_threads(K), 1, 1))["x"]
    np.testing.assert_array_equal(emb[:3], wd[ids[:3]].astype(np.float32))
    np.testing.assert_array_equal(emb[3:], 0)


@pytest.fixture(scope="module")
def cuda_bf16(build):
    """The tiny preset in bfloat16 built for CUDA (nvcc, no GPU needed)."""
    missing = resolve_target("cuda").missing_toolchain()
    if missing:
        pytest.skip(f"cannot build cuda here: {missing}")
    return build("tiny", target="cuda", weight_dtype="bfloat16", **OPTS)


def test_cuda_artifact_holds_the_bf16_kernels(cuda_bf16):
    m = cuda_bf16.manifest
    assert (m.target_kind, m.weight_dtype) == ("cuda", "bfloat16")
    blob = _library_bytes(cuda_bf16)
    for symbol in ("gpu_gemv_norm_none_128x64_bf16", "gpu_embedding_dec_256x64_bf16"):
        assert symbol.encode() in blob, symbol


@pytest.mark.gpu
def test_cuda_run_matches_llvm(build, cuda_bf16):
    """On a CUDA GPU: the bfloat16 artifact's prefill, decode and batched logits and greedy
    tokens equal the llvm bfloat16 artifact's."""
    got = _run(cuda_bf16, _device("cuda"))
    ref = _run(build("tiny", weight_dtype="bfloat16", **OPTS), tvm.cpu())
    for func in ("prefill", "decode", "batch_decode_4"):
        np.testing.assert_allclose(got[func], ref[func], atol=LOGIT_TOL["float32"], rtol=0)
    assert got["tokens"] == ref["tokens"]


# -- whole models against transformers -----------------------------------------------------------
@pytest.fixture(scope="module")
def llama_bf16_ckpt(tmp_path_factory, llama_ckpt):
    """llama_ckpt's model cast to bfloat16 by torch and saved so (safetensors BF16)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_ckpt.path).to(torch.bfloat16)
    return _save(model, tmp_path_factory, "llama_bf16")


@pytest.fixture(scope="module")
def llama_bf16_gguf(tmp_path_factory, llama_bf16_ckpt):
    """The BF16 GGUF convert_hf_to_gguf --outtype bf16 writes of it: matrices BF16 by gguf's
    own quantizer, the norms F32, Q / K rows permuted, llama's keys, a byte-level vocabulary."""
    import gguf

    ckpt = llama_bf16_ckpt
    cfg = resolve_model(str(ckpt.path)).config
    path = tmp_path_factory.mktemp("bf16_gguf") / "llama_bf16.gguf"
    w = gguf.GGUFWriter(path, "llama")
    gguf_files.shape_keys(w, cfg)
    gguf_files.byte_vocabulary(w, cfg.vocab_size)
    for hf_name, value in ckpt.state.items():
        if ".q_proj." in hf_name or ".k_proj." in hf_name:
            value = llama_cpp_permute(value, cfg.n_q_heads if ".q_proj." in hf_name
                                      else cfg.n_kv_heads)
        if value.ndim == 2:
            bf16 = gguf.GGMLQuantizationType.BF16
            w.add_tensor(weights.gguf_name(hf_name), gguf.quants.quantize(value, bf16),
                         raw_dtype=bf16)
        else:
            w.add_tensor(weights.gguf_name(hf_name), np.ascontiguousarray(value, np.float32))
    return gguf_files.finish(w, path)


def _pack_is_two_bytes_a_weight(prepared) -> dict:
    """The pack's arrays (checked: every matrix bfloat16, ``(rows, 2 K)`` uint8, and the file
    holds exactly 2 bytes per matrix weight plus 4 per norm value and its header)."""
    from safetensors.numpy import load_file

    meta = json.loads((prepared.weights_dir / "weights.json").read_text())
    assert (meta["weight_dtype"], meta["weight_formats"]) == ("bfloat16", {})
    assert prepared.manifest.weight_dtype == "bfloat16"
    matrix, vector = 0, 0
    for name, shape, dtype in meta["params"]:
        if dtype == "uint8":
            matrix += shape[0] * shape[1] // 2
        else:
            assert dtype == "float32" and len(shape) == 1, (name, shape, dtype)
            vector += shape[0]
    file = prepared.weights_dir / "params.safetensors"
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    assert file.stat().st_size == header + 2 * matrix + 4 * vector
    return load_file(str(file))


def _generates_as_transformers(load, model_path, hf_path):
    artifact, weights_ = load(model_path, block_size=4, max_context=64)
    ours, tokens = run_ours(artifact, weights_, PROMPT, STEPS)
    ref = hf_reference(hf_path, PROMPT, tokens)
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=BF16_LOGIT_TOL, rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]


def test_bf16_checkpoint_runs_bfloat16(build, load, llama_bf16_ckpt):
    """auto keeps a bfloat16 checkpoint bfloat16: 2 bytes a weight, the file's values; 32
    greedy tokens and their logits as transformers gives them (float32 of the same values)."""
    packed = _pack_is_two_bytes_a_weight(build(llama_bf16_ckpt.path, block_size=4,
                                               max_context=64))
    state = llama_bf16_ckpt.state
    np.testing.assert_array_equal(packed["layers.1.wo"].view(np.uint16),
                                  _torch_bits(state["model.layers.1.self_attn.o_proj.weight"]))
    _generates_as_transformers(load, llama_bf16_ckpt.path, llama_bf16_ckpt.path)


def test_bf16_gguf_runs_bfloat16(build, load, llama_bf16_gguf, llama_bf16_ckpt):
    """A BF16 GGUF: its tensors' bytes as the file has them (the Q / K rows back in HF order),
    and transformers' tokens and logits on the HF folder."""
    import gguf

    packed = _pack_is_two_bytes_a_weight(build(llama_bf16_gguf, block_size=4, max_context=64))
    tensors = {t.name: t for t in gguf.GGUFReader(llama_bf16_gguf).tensors}
    for param, name in (("embed", "token_embd.weight"), ("lm_head", "output.weight"),
                        ("layers.0.wo", "blk.0.attn_output.weight")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.BF16
        np.testing.assert_array_equal(packed[param], np.asarray(tensors[name].data).view(
            np.uint8).reshape(packed[param].shape), err_msg=param)
    _generates_as_transformers(load, llama_bf16_gguf, llama_bf16_ckpt.path)


def test_weight_dtype_bfloat16_rounds_as_torch(llama_ckpt, llama_bf16_ckpt):
    """--weight-dtype bfloat16 of the float32 checkpoint stores exactly what the checkpoint
    torch cast to bfloat16 holds (which the tests above run against transformers)."""
    source = resolve_model(str(llama_ckpt.path))
    assert resolve_formats(source, "bfloat16") == ("bfloat16", ())
    assert resolve_formats(source, "auto") == ("float32", ())  # float32 stays float32
    ours = source.load_params("bfloat16")
    ref = resolve_model(str(llama_bf16_ckpt.path)).load_params("bfloat16")
    assert ours.keys() == ref.keys()
    for name in ref:
        if ref[name].dtype == np.uint8:  # matrices; norms stay float32 in both
            np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
