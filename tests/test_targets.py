"""The cross-target artifact matrix: target x {decode, prefill, batch} x weights / cache on the
tiny preset (float32 weights with a float32 or a float16 cache; Q4_0 weights with a float32 cache:
the quantized kernels, on the targets that have them).

Building runs wherever the compiler can (every target but vulkan with the PyPI TVM wheel; cuda
needs nvcc, no GPU).  Each (target, variant) artifact is built once per session and holds
every function.  Running needs the target's device: GPU runs are ``@pytest.mark.gpu`` and skip
with a reason where the device is missing; they compare prefill / decode / batch logits and
greedy tokens with the llvm artifact (tolerances from conftest: LOGIT_TOL, quantized
NATIVE_VS_DEQUANT_RTOL).
"""

from __future__ import annotations

import struct
import tarfile

import numpy as np
import pytest
import tvm

from paged_decode.compile.api import key_of
from paged_decode.compile.device_code import device_modules
from paged_decode.compile.formats import FORMATS, QUANT_FORMATS
from paged_decode.compile.kernels.registry import NO_INT64_BUFFERS, no_quantized_kernels
from paged_decode.compile.targets import KINDS, resolve_target
from paged_decode.runtime.artifact import load_artifact
from paged_decode.runtime.errors import ArtifactError, CompileError, ConfigError

from .conftest import LOGIT_TOL, NATIVE_VS_DEQUANT_RTOL, QUANT_KERNEL_RTOL, quantized_weights

# decode crosses blocks and a 128-position chunk; one batch bucket of 4 rows
OPTS = dict(block_size=8, max_context=256, batch_buckets=(4,))
PROMPT = [int(t) for t in np.random.default_rng(3).integers(2, 256, size=140)]
SPLIT = 100  # prefill in two calls: positions 0..99, then 100..139 (start_pos > 0)
STEPS = 6
DTYPES = ("float32", "float16")
# artifact variants: name -> prepare options (the name is the cache dtype, or the weight format)
VARIANTS = {"float32": dict(cache_dtype="float32"), "float16": dict(cache_dtype="float16"),
            "q4_0": dict(cache_dtype="float32", weight_dtype="q4_0")}
FUNCS = ("decode", "prefill", "batch_decode_4")
ATTENTION = {"decode": "attn_dec", "prefill": "attn_pre", "batch_decode_4": "attn_bat4"}

_DEVICES = {  # target -> (device factory, why it cannot run here when absent)
    "cuda": (lambda: tvm.cuda(0), "no CUDA GPU (tvm.cuda(0).exist is False)"),
    "metal": (lambda: tvm.metal(0), "no Metal GPU (runs on Apple silicon macOS)"),
    "opencl": (lambda: tvm.opencl(0), "no OpenCL device, or a TVM runtime without OpenCL "
                                      "(the PyPI wheel has none)"),
    "vulkan": (lambda: tvm.vulkan(0), "no Vulkan device / TVM runtime without Vulkan"),
}
_NO_WEBGPU = "WebGPU artifacts run in a browser through tvmjs, not in this Python runtime"


def _build_marks(kind: str) -> list:
    missing = resolve_target(kind).missing_toolchain()
    if kind == "vulkan" and missing:
        return [pytest.mark.xfail(strict=True, raises=CompileError, reason=missing)]
    return []


def _no_quantized(kind: str) -> str | None:
    """Why ``kind`` runs no quantized weights here (llvm: on this host's CPU)."""
    return no_quantized_kernels(kind, resolve_target(kind).target if kind == "llvm" else None)


def _matrix(run: bool):
    for kind in KINDS:
        marks = _build_marks(kind) + ([pytest.mark.gpu] if run and kind != "llvm" else [])
        for variant in VARIANTS:
            if "weight_dtype" in VARIANTS[variant] and (kind == "llvm" or _no_quantized(kind)):
                # dequantized there (test_quantized_weights_on_a_target_without_...); the llvm
                # Q4_0 artifact is the GPU rows' reference, its build and runs tested elsewhere
                # (test_batch_decode, test_runtime_hf)
                continue
            for func in FUNCS:
                if func.startswith("batch") and kind in NO_INT64_BUFFERS:
                    continue  # no batch buckets there (test_webgpu_has_no_batch_buckets)
                yield pytest.param(kind, variant, func, marks=marks, id=f"{kind}-{variant}-{func}")


@pytest.fixture(scope="session")
def artifact(build):
    """artifact(target, variant) -> Prepared, built once per session (a CompileError too:
    the vulkan build fails the same way for both of its functions)."""
    done: dict = {}

    def _get(kind: str, variant: str):
        if (kind, variant) not in done:
            missing = resolve_target(kind).missing_toolchain()
            if missing and kind != "vulkan":
                pytest.skip(f"cannot build {kind} here: {missing}")
            try:
                opts = dict(OPTS, batch_buckets=()) if kind in NO_INT64_BUFFERS else OPTS
                done[kind, variant] = build("tiny", target=kind, **VARIANTS[variant], **opts)
            except CompileError as e:
                done[kind, variant] = e
        if isinstance(done[kind, variant], Exception):
            raise done[kind, variant]
        return done[kind, variant]

    return _get


def _library_bytes(prepared) -> bytes:
    """What the library carries: a .so file (its packed imports are plain bytes in it), or every
    member of a .tar."""
    lib = prepared.artifact_dir / prepared.manifest.library
    if lib.suffix == ".so":
        return lib.read_bytes()
    with tarfile.open(lib) as tar:
        return b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())


def _vm_name(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()  # a length-prefixed string in the blob


@pytest.mark.parametrize("kind,variant,func", list(_matrix(run=False)))
def test_build(artifact, kind, variant, func):
    """The artifact exists, holds ``func`` in its VM executable and that function's attention
    kernel in its device code (CUDA: inside the fatbin's function table); a quantized one also
    the decode GEMV over its packed blocks."""
    prepared = artifact(kind, variant)
    m, cdt = prepared.manifest, VARIANTS[variant]["cache_dtype"]
    assert m.target_kind == kind and m.cache_dtype == cdt
    assert m.library == resolve_target(kind).library_name and m.link_note
    blob = _library_bytes(prepared)
    assert _vm_name(func) in blob
    attn = ATTENTION[func]
    prefix = "" if kind == "llvm" else "gpu_"
    assert f"{prefix}{attn}_q4kv2d16_bs8_cap32_{cdt[0]}{cdt[-2:]}".encode() in blob
    if "weight_dtype" in VARIANTS[variant]:
        assert m.weight_dtype == variant
        assert f"{prefix}gemv_norm_none_128x64_{variant}".encode() in blob  # q / k / v rows


def test_artifact_for_a_runtime_this_tvm_lacks_says_so(artifact):
    """An OpenCL artifact loaded by a TVM without the OpenCL runtime (the PyPI wheel): the error
    names the target and says a rebuild will not help."""
    if tvm.get_global_func("ffi.Module.load_from_bytes.opencl", allow_missing=True) is not None:
        pytest.skip("this TVM has the OpenCL runtime, so the artifact loads")
    prepared = artifact("opencl", "float32")
    with pytest.raises(ArtifactError, match="target 'opencl', whose runtime this TVM installation"
                                            " lacks") as err:
        load_artifact(prepared.artifact_dir)
    assert "--force" not in str(err.value)


@pytest.mark.parametrize("cdt", DTYPES)
def test_cuda_artifact_embeds_an_nvcc_fatbin(artifact, cdt):
    """The CUDA library carries compiled sm_90 code (no CUDA source left for NVRTC / nvcc at
    load time), read back out of the exported .so."""
    mods = device_modules(artifact("cuda", cdt).artifact_dir / "model.so")
    cuda = [m for m in mods if m["kind"] == "cuda"]
    assert len(cuda) == 1, mods
    assert cuda[0]["fmt"] == "fatbin" and cuda[0]["fatbin"] and not cuda[0]["source"]
    assert cuda[0]["archs"] == ["sm_90"] and cuda[0]["code_bytes"] > 1000


def test_cuda_arch_enters_key_and_fatbin(build):
    if resolve_target("cuda").missing_toolchain():
        pytest.skip(resolve_target("cuda").missing_toolchain())
    keys = {a: key_of("tiny", target=f"cuda:{a}", **OPTS) for a in ("sm_80", "sm_90")}
    assert keys["sm_80"]["digest"] != keys["sm_90"]["digest"]
    assert '"arch":"sm_80"' in keys["sm_80"]["key"]["target"]
    prepared = build("tiny", target="cuda:sm_80", **OPTS)
    (cuda,) = [m for m in device_modules(prepared.artifact_dir / "model.so") if m["kind"] == "cuda"]
    assert cuda["archs"] == ["sm_80"] and cuda["fatbin"]


def test_default_block_size_is_the_targets():
    """No block size given: 64 tokens on the CPU, 16 on GPUs; one given is kept."""
    for target, want in ((None, 64), ("llvm", 64), ("cuda", 16), ("vulkan", 16), ("metal", 16)):
        assert resolve_target(target).default_block_size == want
        key = key_of("tiny", target=target, max_context=256)["key"]
        assert key["block_size"] == want and key["max_blocks_cap"] == 256 // want, target
    assert key_of("tiny", block_size=8, max_context=256)["key"]["block_size"] == 8


def test_target_names():
    assert resolve_target("cuda").arch == "sm_90" and resolve_target("cuda:sm_80").arch == "sm_80"
    for kind in ("metal", "webgpu"):
        assert resolve_target(kind).library_name == "model.tar"
    assert str(resolve_target("metal").target.host.attrs["mtriple"]) == "arm64-apple-macos"
    assert str(resolve_target("webgpu").target.host.attrs["mtriple"]).startswith("wasm32")
    for bad in ("cuda:sm90", "cuda:80", "metal:m2", "rocm", "vulkan:1"):
        with pytest.raises(ConfigError):
            resolve_target(bad)


def test_webgpu_has_no_batch_buckets():
    """WGSL has no int64, so a WebGPU artifact has no batched steps: none by default, and
    asking for some names the fix."""
    from paged_decode.compile.api import default_buckets

    assert default_buckets("webgpu") == () and default_buckets("cuda") == default_buckets("llvm")
    with pytest.raises(ConfigError, match="target webgpu has no batched decode kernels.*"
                                          "--batch-buckets none"):
        key_of("tiny", target="webgpu", batch_buckets=(2,))


def test_quantized_weights_on_a_target_without_their_kernels():
    """WebGPU (no 8-bit buffers in WGSL) and Vulkan: asking for a quantized format names the
    reason and the fix; "auto" on a quantized GGUF dequantizes (test_weights covers the GGUF
    side); CUDA, Metal and OpenCL take the format."""
    for kind, why in (("webgpu", "WGSL has no 8-bit type"), ("vulkan", "VK_KHR_8bit_storage")):
        with pytest.raises(ConfigError, match=f"weight_dtype='q4_0': {kind}: .*{why}.*choose "
                                              "float16"):
            key_of("tiny", target=kind, weight_dtype="q4_0", batch_buckets=())
    for kind in ("cuda", "metal", "opencl"):
        assert key_of("tiny", target=kind, weight_dtype="q4_0")["key"]["weight_dtype"] == "q4_0"


def test_a_gpu_weight_tensor_past_int32_indices_is_refused():
    """GPU kernels index with int32: a 2 GiB tensor (a 262144 x 2048 float32 embedding) is a
    ConfigError naming it and the fix; in float16 it fits; the CPU takes either."""
    import dataclasses

    from paged_decode.compile.api import _check_gpu_tensor_sizes
    from paged_decode.compile.build import make_spec
    from paged_decode.compile.config import preset

    cfg = dataclasses.replace(preset("tinyllama-1.1b"), vocab_size=262144)
    big = make_spec(cfg, block_size=16, max_context=256, weight_dtype="float32")
    with pytest.raises(ConfigError, match=r"embed \(float32, 2.00 GiB\) reaches 2 GiB.*cuda "
                                          "kernels.*--weight-dtype q8_0"):
        _check_gpu_tensor_sizes(big, "cuda")
    _check_gpu_tensor_sizes(make_spec(cfg, block_size=16, max_context=256,
                                      weight_dtype="float16"), "cuda")


def test_vulkan_without_spirv_codegen_is_a_typed_error():
    missing = resolve_target("vulkan").missing_toolchain()
    if missing is None:
        pytest.skip("this TVM has SPIR-V codegen")
    assert "target.build.vulkan" in missing and "USE_VULKAN" in missing


# -- running --------------------------------------------------------------------------------------
def _device(kind: str):
    if kind == "llvm":
        return tvm.cpu()
    if kind == "webgpu":
        pytest.skip(_NO_WEBGPU)
    make, why = _DEVICES[kind]
    try:
        dev = make()
        if dev.exist:
            return dev
    except Exception:  # a runtime without this device API raises instead of saying False
        pass
    pytest.skip(why)


def _run(prepared, device) -> dict:
    """Prefill PROMPT (two calls), then STEPS greedy decode steps; logits of every call."""
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.session import PagedDecodeSession
    from paged_decode.runtime.step import BatchDecodeSession

    artifact = load_artifact(prepared.artifact_dir, device)
    weights = load_weights(prepared.weights_dir, artifact)
    pool = PagedKVCache.for_artifact(artifact, num_blocks=48)
    session = PagedDecodeSession(artifact, weights, pool)
    seq = pool.new_sequence()
    prefill = [session.prefill(seq, PROMPT[:SPLIT]), session.prefill(seq, PROMPT[SPLIT:])]
    tokens, decode = [], []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(prefill[-1] if not decode else decode[-1])))
        decode.append(session.realize_token(seq, tokens[-1]))
    replay = session.prefill(pool.new_sequence(), PROMPT + tokens)  # one prefill, same context
    # a batched step of 3 live rows in bucket 4: the sequence, its fork (the first of the two
    # to write copies their shared, partly filled last block on the device) and a shorter one
    child, other = seq.fork(), pool.new_sequence()
    session.prefill(other, PROMPT[:37])
    batch = BatchDecodeSession(artifact, weights, pool).step([seq, child, other], [5, 5, 9])
    return {"prefill": np.stack(prefill), "decode": np.stack(decode), "tokens": tokens,
            "replay": replay, "batch_decode_4": batch}


@pytest.fixture(scope="session")
def outputs(artifact):
    done: dict = {}

    def _get(kind: str, variant: str, device):
        if (kind, variant) not in done:
            done[kind, variant] = _run(artifact(kind, variant), device)
        return done[kind, variant]

    return _get


@pytest.mark.parametrize("kind,variant,func", list(_matrix(run=True)))
def test_run_matches_llvm(outputs, kind, variant, func):
    """On the target's device: the last decode step equals one prefill over the same tokens,
    a fork's batched row equals its parent's (the copy-on-write copied the shared block), and
    the logits of ``func`` (and the greedy tokens) equal the llvm artifact's.  Quantized: the
    CPU's decode GEMVs and small batches quantize x to int8 where the GPU keeps it float32, so
    the logits agree within NATIVE_VS_DEQUANT_RTOL of the largest (the CPU's replay, a float
    prefill, likewise against its decode) and tokens are not compared."""
    device = _device(kind)
    if "weight_dtype" in VARIANTS[variant] and _no_quantized("llvm"):
        pytest.skip(f"no llvm reference for {variant}: {_no_quantized('llvm')}")
    got, ref = outputs(kind, variant, device), outputs("llvm", variant, tvm.cpu())
    cdt = VARIANTS[variant]["cache_dtype"]
    assert np.isfinite(got[func]).all()
    if "weight_dtype" in VARIANTS[variant]:
        tol = NATIVE_VS_DEQUANT_RTOL * np.abs(ref[func]).max()
        replay_tol = tol if kind == "llvm" else LOGIT_TOL[cdt]
        np.testing.assert_allclose(got["replay"], got["decode"][-1], atol=replay_tol, rtol=0)
        np.testing.assert_allclose(got[func], ref[func], atol=tol, rtol=0)
    else:
        np.testing.assert_allclose(got["replay"], got["decode"][-1], atol=LOGIT_TOL[cdt], rtol=0)
        np.testing.assert_allclose(got[func], ref[func], atol=LOGIT_TOL[cdt], rtol=0)
        if func == "decode":
            assert got["tokens"] == ref["tokens"]
    np.testing.assert_array_equal(got["batch_decode_4"][1], got["batch_decode_4"][0])


# -- the GPU kernels, numerically, on any OpenCL device (pocl runs them on the CPU) ------------
# TVM's OpenCL codegen of the same thread-bound TIR the CUDA build uses (its block reductions
# take the shared-memory path instead of warp shuffles); launched through pyopencl, since the
# PyPI TVM runtime has no OpenCL.  float32 only: pocl's CPU device has no cl_khr_fp16.
def _opencl_queue():
    cl = pytest.importorskip("pyopencl", reason="pyopencl (and an OpenCL ICD such as pocl) "
                                                 "runs the GPU kernels on a CPU")
    try:
        ctx = cl.Context(cl.get_platforms()[0].get_devices())
    except Exception as e:  # no ICD / no platform
        pytest.skip(f"no OpenCL device: {e}")
    return cl, ctx, cl.CommandQueue(ctx)


def _launch(func, arrays: dict, scalars: dict, grid, block) -> dict:
    """Compile ``func`` for opencl, run it once, return every array argument after the call."""
    import re

    cl, ctx, queue = _opencl_queue()
    lib = tvm.compile(func, target=tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"}))
    src = lib.mod.imports[0].inspect_source("")
    name, sig = re.search(r"__kernel void (\w+)\(([^)]*)\)", src).groups()
    kernel = getattr(cl.Program(ctx, src).build(), name)
    bufs, args = {}, []
    for param in (p.split()[-1] for p in sig.split(",")):
        key = param.removesuffix("_ptr")
        if key in arrays:
            bufs[key] = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                  hostbuf=np.ascontiguousarray(arrays[key]))
            args.append(bufs[key])
        else:
            args.append(np.int64(scalars[key]))
    kernel(queue, tuple(g * b for g, b in zip(grid, block)), tuple(block), *args)
    out = {k: np.empty_like(arrays[k]) for k in bufs}
    for k, b in bufs.items():
        cl.enqueue_copy(queue, out[k], b)
    queue.finish()
    return out


def _ref_attention(q, k_pool, v_pool, table, ctx, bs):
    """q (Hq, D) against positions [0, ctx) through the block table, float64."""
    hq, d = q.shape
    pos = np.arange(ctx)
    k, v = (p.transpose(0, 2, 1, 3)[table[pos // bs], pos % bs].astype(np.float64)
            for p in (k_pool, v_pool))  # (ctx, Hkv, D) from (blocks, Hkv, bs, D)
    g = hq // k.shape[1]
    out = np.empty((hq, d))
    for h in range(hq):
        s = k[:, h // g] @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max())
        out[h] = p / p.sum() @ v[:, h // g]
    return out.reshape(-1)


@pytest.mark.parametrize("ctx", [1, 127, 128, 129, 320])
def test_gpu_paged_attention_decode_on_opencl(ctx):
    """Online softmax over several 128-position chunks, GQA 9/3, head_dim 64, permuted table."""
    from paged_decode.compile.kernels.gpu.attention import paged_attention_decode

    hq, hkv, d, bs, cap, nb = 9, 3, 64, 16, 20, 25
    rng = np.random.default_rng(ctx)
    k, v = (rng.standard_normal((nb, hkv, bs, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(nb)[:cap].astype(np.int32)[None]
    q = rng.standard_normal((1, hq * d)).astype(np.float32)
    out = _launch(paged_attention_decode(hq, hkv, d, bs, cap, "float32"),
                  dict(q=q, k_pool=k, v_pool=v, bt=table, out=np.zeros_like(q)),
                  dict(context_len=ctx, num_blocks=nb), (hq, 1, 1), (128, 1, 1))["out"]
    np.testing.assert_allclose(out[0], _ref_attention(q[0].reshape(hq, d), k, v, table[0], ctx,
                                                      bs), atol=1e-4, rtol=0)


def test_gpu_prefill_attention_and_rope_on_opencl():
    from paged_decode.compile.kernels.gpu.attention import (paged_attention_prefill,
                                                            rope_kv_write_prefill)

    hq, hkv, d, bs, cap, nb, n, start = 4, 2, 16, 4, 6, 11, 9, 3
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((nb, hkv, bs, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(nb)[:cap].astype(np.int32)[None]
    qkv = rng.standard_normal((n, (hq + 2 * hkv) * d)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    r = _launch(rope_kv_write_prefill(hq, hkv, d, bs, cap, "float32"),
                dict(qkv=qkv, k_pool=k, v_pool=v, inv_freq=inv_freq, bt=table,
                     q_rot=np.zeros((n, hq * d), np.float32)),
                dict(start_pos=start, num_blocks=nb, n=n), (hq + 2 * hkv, n, 1), (d // 2, 1, 1))
    pos = start + np.arange(n)
    ang = pos[:, None] * inv_freq[None].astype(np.float64)  # (n, d/2)
    x = qkv[:, hq * d:(hq + hkv) * d].reshape(n, hkv, d).astype(np.float64)
    x0, x1, c, s = x[..., :d // 2], x[..., d // 2:], np.cos(ang)[:, None], np.sin(ang)[:, None]
    rot = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], -1)
    blk, slot = table[0, pos // bs], pos % bs
    np.testing.assert_allclose(r["k_pool"][blk, :, slot], rot, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(r["v_pool"][blk, :, slot],
                                  qkv[:, (hq + hkv) * d:].reshape(n, hkv, d))
    out = _launch(paged_attention_prefill(hq, hkv, d, bs, cap, "float32"),
                  dict(q=r["q_rot"], k_pool=r["k_pool"], v_pool=r["v_pool"], bt=table,
                       out=np.zeros((n, hq * d), np.float32)),
                  dict(start_pos=start, num_blocks=nb, n=n), (hq, n, 1), (128, 1, 1))["out"]
    for i in range(n):
        ref = _ref_attention(r["q_rot"][i].reshape(hq, d), r["k_pool"], r["v_pool"], table[0],
                             start + i + 1, bs)
        np.testing.assert_allclose(out[i], ref, atol=1e-4, rtol=0)


def test_gpu_batched_rope_and_attention_on_opencl():
    """Ragged rows: contexts 1, 130 (two 128-position chunks) and 37, each through its own
    permuted table row, a padding row (context 0) that writes nothing and reads zeros, and a row
    whose offset does not match its table (writes nothing, still attends)."""
    from paged_decode.compile.kernels.gpu.attention import (paged_attention_batch,
                                                            rope_kv_write_batch)

    hq, hkv, d, bs, cap, nb, B = 4, 2, 16, 16, 10, 40, 5
    ctx = np.array([1, 130, 0, 37, 20], np.int64)
    rng = np.random.default_rng(7)
    k, v = (rng.standard_normal((nb, hkv, bs, d)).astype(np.float32) for _ in range(2))
    table = np.stack([rng.permutation(nb)[:cap] for _ in range(B)]).astype(np.int32)
    pos = np.maximum(ctx - 1, 0)
    offs = table[np.arange(B), pos // bs].astype(np.int64) * bs + pos % bs
    offs[4] += 1  # not the table's slot for position 19: the row must write nothing
    qkv = rng.standard_normal((B, (hq + 2 * hkv) * d)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    r = _launch(rope_kv_write_batch(hq, hkv, d, bs, cap, "float32", B),
                dict(qkv=qkv, k_pool=k, v_pool=v, inv_freq=inv_freq, bt=table, write_offs=offs,
                     context_lens=ctx, q_rot=np.zeros((B, hq * d), np.float32)),
                dict(num_blocks=nb), (hq + 2 * hkv, B, 1), (d // 2, 1, 1))
    k_want, v_want = k.copy(), v.copy()
    for row in (0, 1, 3):  # the live rows with matching offsets
        ang = pos[row] * inv_freq.astype(np.float64)
        x = qkv[row, hq * d:(hq + hkv) * d].reshape(hkv, d).astype(np.float64)
        rot = np.concatenate([x[:, :d // 2] * np.cos(ang) - x[:, d // 2:] * np.sin(ang),
                              x[:, d // 2:] * np.cos(ang) + x[:, :d // 2] * np.sin(ang)], -1)
        blk, slot = offs[row] // bs, offs[row] % bs
        k_want[blk, :, slot] = rot
        v_want[blk, :, slot] = qkv[row, (hq + hkv) * d:].reshape(hkv, d)
    np.testing.assert_allclose(r["k_pool"], k_want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(r["v_pool"], v_want)
    out = _launch(paged_attention_batch(hq, hkv, d, bs, cap, "float32", B),
                  dict(q=r["q_rot"], k_pool=r["k_pool"], v_pool=r["v_pool"], bt=table,
                       context_lens=ctx, out=np.full((B, hq * d), np.nan, np.float32)),
                  dict(num_blocks=nb), (hq, B, 1), (128, 1, 1))["out"]
    np.testing.assert_array_equal(out[2], 0)
    for row in (0, 1, 3, 4):
        ref = _ref_attention(r["q_rot"][row].reshape(hq, d), r["k_pool"], r["v_pool"],
                             table[row], ctx[row], bs)
        np.testing.assert_allclose(out[row], ref, atol=1e-4, rtol=0, err_msg=f"row {row}")


@pytest.mark.parametrize("N,K", [(40, 72), (8448, 576)])  # 1 and 4 rows per warp
def test_gpu_norm_gemv_on_opencl(N, K):
    from paged_decode.compile.kernels.gpu import gemv as gpu_gemv

    rng = np.random.default_rng(N)
    x, g = rng.standard_normal((1, K)).astype(np.float32), rng.standard_normal(K).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean() + 1e-5) * g
    rows = gpu_gemv.R * gpu_gemv._rows_per_warp(N)
    y = _launch(gpu_gemv.gemv(N, K, "float32", "bias", 1e-5),
                dict(x=x, g=g, W=w, bias=bias, y=np.zeros((1, N), np.float32)), {},
                (-(-N // rows), 1, 1), (32, gpu_gemv.R, 1))["y"]
    np.testing.assert_allclose(y, xn @ w.astype(np.float64).T + bias, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 33])
def test_gpu_tiled_linear_on_opencl(n):
    from paged_decode.compile.kernels.gpu import linear as gpu_linear

    N, K = 72, 40  # neither a multiple of the 64-column tile nor of the 16-wide k step
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    res = rng.standard_normal((n, N)).astype(np.float32)
    y = _launch(gpu_linear.linear(N, K, "float32", "residual"),
                dict(x=x, W=w, res=res, y=np.zeros((n, N), np.float32)), dict(n=n),
                (-(-N // gpu_linear.BN), -(-n // gpu_linear.BM), 1),
                (gpu_linear.TX, gpu_linear.TY, 1))["y"]
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.astype(np.float64).T + res, atol=1e-4,
                               rtol=1e-5)


# -- the quantized GPU kernels on OpenCL: each format's blocks decoded from their bytes ----------
def _close(got, want):
    np.testing.assert_allclose(got, want, atol=QUANT_KERNEL_RTOL * np.abs(want).max(), rtol=0)


def _launch_cuda(func, arrays: dict, scalars: dict, grid, block) -> dict:
    """``_launch``'s contract on a CUDA GPU through TVM's runtime (which sizes the grid)."""
    dev = _device("cuda")
    arch = "sm_" + dev.compute_version.replace(".", "")
    lib = tvm.compile(func, target=tvm.target.Target({"kind": "cuda", "arch": arch},
                                                     host={"kind": "llvm"}))
    tensors = {k: tvm.runtime.tensor(np.ascontiguousarray(v), dev) for k, v in arrays.items()}
    lib[func.attrs["global_symbol"]](*[tensors[p.name] for p in func.params])
    return {k: t.numpy() for k, t in tensors.items()}


# the quantized kernels on every device that runs them: OpenCL (pocl on a CPU) here, CUDA on an
# NVIDIA machine (scripts/gpu_check.sh), whose code generation differs
LAUNCHERS = [pytest.param(_launch, id="opencl"),
             pytest.param(_launch_cuda, id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("launch", LAUNCHERS)
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_gpu_quantized_kernels(fmt, launch):
    """GEMV (fused norm + bias; residual), SwiGLU GEMV, tiled matmul and embedding over the packed
    blocks, against float64 numpy over the dequantized weights (x stays float32 on GPUs)."""
    from paged_decode.compile.kernels.gpu import gemv as gpu_gemv
    from paged_decode.compile.kernels.gpu import linear as gpu_linear
    from paged_decode.compile.kernels.gpu import norm as gpu_norm
    from paged_decode.compile.params import gate_up_row

    # units per row not a multiple of a warp's 32; a 32-weight format's K not one of 256
    N, K, n, I = 40, 1312 if FORMATS[fmt].block == 32 else 1280, 33, 72
    rng = np.random.default_rng(K)
    w, wd = quantized_weights(fmt, N, K, 1)
    x, g = rng.standard_normal((n, K)).astype(np.float32), rng.standard_normal(K).astype(np.float32)
    bias, res = rng.standard_normal(N).astype(np.float32), rng.standard_normal((n, N)).astype(
        np.float32)
    x1 = x[:1]
    xn = x1 / np.sqrt((x1.astype(np.float64) ** 2).mean() + 1e-5) * g
    grid = (-(-N // (gpu_gemv.R * gpu_gemv._rows_per_warp(N))), 1, 1)
    y = launch(gpu_gemv.gemv(N, K, fmt, "bias", 1e-5),
                dict(x=x1, g=g, W=w, bias=bias, y=np.zeros((1, N), np.float32)), {}, grid,
                (32, gpu_gemv.R, 1))["y"]
    _close(y, xn @ wd.T + bias)
    y = launch(gpu_gemv.gemv(N, K, fmt, "residual"),
                dict(x=x1, W=w, res=res[:1], y=np.zeros((1, N), np.float32)), {}, grid,
                (32, gpu_gemv.R, 1))["y"]
    _close(y, x1 @ wd.T + res[:1])

    wgu, wgu_d = quantized_weights(fmt, 2 * I, K, 2)
    gate = wgu_d[[gate_up_row(i, I, False) for i in range(I)]]
    up = wgu_d[[gate_up_row(i, I, True) for i in range(I)]]
    act = launch(gpu_gemv.gemv_swiglu(I, K, fmt, 1e-5),
                  dict(x=x1, g=g, W=wgu, act=np.zeros((1, I), np.float32)), {},
                  (-(-I // (gpu_gemv.R * gpu_gemv._rows_per_warp(I))), 1, 1),
                  (32, gpu_gemv.R, 1))["act"]
    _close(act, (xn @ gate.T) / (1 + np.exp(-(xn @ gate.T))) * (xn @ up.T))

    tiles = (gpu_linear.TX, gpu_linear.TY, 1)
    y = launch(gpu_linear.linear(N, K, fmt, "residual"),
                dict(x=x, W=w, res=res, y=np.zeros((n, N), np.float32)), dict(n=n),
                (-(-N // gpu_linear.BN), -(-n // gpu_linear.BM), 1), tiles)["y"]
    _close(y, x @ wd.T + res)
    act = launch(gpu_linear.linear_swiglu(I, K, fmt),
                  dict(x=x, W=wgu, act=np.zeros((n, I), np.float32)), dict(n=n),
                  (-(-I // gpu_linear.BN), -(-n // gpu_linear.BM), 1), tiles)["act"]
    _close(act, (x @ gate.T) / (1 + np.exp(-(x @ gate.T))) * (x @ up.T))

    ids = np.array([3, 0, N - 1, N, -1], np.int32)  # the last two: out of range, zero rows
    emb = launch(gpu_norm.embedding(N, K, fmt),
                  dict(ids=ids, table=w, x=np.full((5, K), np.nan, np.float32)), dict(n=5),
                  (5, 1, 1), (gpu_norm.block_threads(K), 1, 1))["x"]
    np.testing.assert_array_equal(emb[:3], wd[ids[:3]].astype(np.float32))  # exact: no sums
    np.testing.assert_array_equal(emb[3:], 0)


def test_gpu_quantized_gemv_of_many_rows_on_opencl():
    """Four rows per warp (the large-N path) over Q4_K super-blocks."""
    from paged_decode.compile.kernels.gpu import gemv as gpu_gemv

    N, K = 8448, 256
    assert gpu_gemv._rows_per_warp(N) == 4
    w, wd = quantized_weights("q4_k", N, K, 3)
    x = np.random.default_rng(4).standard_normal((1, K)).astype(np.float32)
    y = _launch(gpu_gemv.gemv(N, K, "q4_k"), dict(x=x, W=w, y=np.zeros((1, N), np.float32)), {},
                (N // (gpu_gemv.R * 4), 1, 1), (32, gpu_gemv.R, 1))["y"]
    _close(y, x @ wd.T)


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_gpu_float16_scales_decode_from_their_bits(launch):
    """The GPU kernels read a block's float16 scale as two bytes (no float16 loads): normal,
    subnormal, negative, signed zero and largest-finite scales decode bit for bit, through the
    embedding."""
    from paged_decode.compile.kernels.gpu import norm as gpu_norm

    scales = np.array([1.0, -0.5, 6.1e-5, 3e-7, -3e-7, 0.0, -0.0, 65504.0, 2.0 ** -14],
                      np.float16)
    q = np.random.default_rng(5).integers(1, 128, (len(scales), 32)).astype(np.int8)
    q[:, ::2] *= -1  # both signs, no 0 (whose product's sign would not show the scale's)
    table = np.concatenate([scales.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    ids = np.arange(len(scales), dtype=np.int32)
    emb = launch(gpu_norm.embedding(len(scales), 32, "q8_0"),
                 dict(ids=ids, table=table, x=np.zeros((len(scales), 32), np.float32)),
                 dict(n=len(scales)), (len(scales), 1, 1), (32, 1, 1))["x"]
    want = scales.astype(np.float32)[:, None] * q.astype(np.float32)
    np.testing.assert_array_equal(emb.view(np.uint32), want.view(np.uint32))
