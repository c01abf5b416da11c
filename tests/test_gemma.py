"""Gemma 2 / Gemma 3 text and sliding windows end to end: tiny random transformers checkpoints
(GQA, a window shorter than the test's context, soft-capping, query_pre_attn_scalar !=
head_dim, distinct local / global RoPE bases, linear RoPE scaling on full layers) generate
transformers' greedy tokens from the HF folder and from the GGUF llama.cpp's converter writes
(norms + 1, its tensor names and keys); Mistral and Qwen2 with a window likewise; the
elementwise kernels against numpy."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
import tvm

from paged_decode.compile import weights
from paged_decode.compile.kernels.cpu import elementwise
from paged_decode.compile.params import interleave_gate_up
from paged_decode.compile.targets import resolve_target
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime.step import BatchDecodeSession

from . import gguf_files
from .conftest import LOGIT_TOL, TOL, _randomize, _save, make_pool
from .test_runtime_hf import hf_reference, run_ours

PROMPT = [3, 17, 99, 41, 5, 250, 8, 77, 12, 64, 31]  # 11 tokens, then 32 more: past the window
STEPS = 32
WINDOW = 8
# one artifact per checkpoint: a batch bucket of 2 beside decode and prefill
OPTS = dict(block_size=4, max_context=64, batch_buckets=(2,))
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             intermediate_size=88, vocab_size=256, rms_norm_eps=2.0**-20, sliding_window=WINDOW)


def _gemma2(scalar: int, **changes):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**dict(SHAPE, num_hidden_layers=3, query_pre_attn_scalar=scalar,
                              attn_logit_softcapping=0.25, final_logit_softcapping=0.5,
                              rope_theta=20000.0) | changes)
    return Gemma2ForCausalLM(cfg)


ROPE3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}


def _gemma3(scalar: int, **changes):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**dict(SHAPE, num_hidden_layers=6, query_pre_attn_scalar=scalar,
                                  rope_parameters=ROPE3) | changes)
    return Gemma3ForCausalLM(cfg)


def _checkpoint(tmp_path_factory, name, make, seed):
    torch.manual_seed(0)
    model = make()
    _randomize(model, seed)
    return _save(model, tmp_path_factory, name)


@pytest.fixture(scope="session")
def gemma2_ckpt(tmp_path_factory):
    """Gemma 2, 3 layers (sliding, full, sliding), scores scaled by 24^-0.5 (head_dim 32),
    attention soft-capped at 0.25 and logits at 0.5, tied embeddings."""
    return _checkpoint(tmp_path_factory, "gemma2", lambda: _gemma2(24), 11)


@pytest.fixture(scope="session")
def gemma3_ckpt(tmp_path_factory):
    """Gemma 3, 3 layers from explicit layer_types (sliding, full, sliding), q/k norms, scores
    scaled by 24^-0.5, RoPE base 10000 on sliding layers and 1e6 x linear 4 on the full one."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    return _checkpoint(tmp_path_factory, "gemma3",
                       lambda: _gemma3(24, num_hidden_layers=3, layer_types=types), 12)


# The GGUF forms: llama.cpp stores no query_pre_attn_scalar (it scales by head_dim^-0.5 below
# 27B), so these checkpoints scale by head_dim; Gemma 3 takes llama.cpp's pattern (6 layers,
# the last full).
@pytest.fixture(scope="session")
def gemma2_gguf_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gemma2_gguf", lambda: _gemma2(32), 13)


@pytest.fixture(scope="session")
def gemma3_gguf_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gemma3_gguf", lambda: _gemma3(32), 14)


@pytest.fixture(scope="session")
def mistral_window_ckpt(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**dict(SHAPE, num_hidden_layers=2, rope_theta=10000.0,
                               intermediate_size=96))
    return _checkpoint(tmp_path_factory, "mistral_window", lambda: MistralForCausalLM(cfg), 15)


@pytest.fixture(scope="session")
def qwen2_window_ckpt(tmp_path_factory):
    """Qwen2 with use_sliding_window: layer 1 slides (max_window_layers 1), layer 0 is full."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**dict(SHAPE, num_hidden_layers=2, intermediate_size=96, head_dim=16,
                             use_sliding_window=True, max_window_layers=1))
    return _checkpoint(tmp_path_factory, "qwen2_window", lambda: Qwen2ForCausalLM(cfg), 16)


def write_gemma_gguf(path, ckpt, gguf_arch: str):
    """A float32 GGUF of a Gemma checkpoint as convert_hf_to_gguf writes it: every norm weight
    + 1, the family's tensor names, its keys (sliding window, soft-capping, linear RoPE
    scaling); no output.weight (tied); a byte-level vocabulary so the file loads."""
    import gguf

    cfg = resolve_model(str(ckpt.path)).config
    w = gguf.GGUFWriter(path, gguf_arch)
    gguf_files.shape_keys(w, cfg)
    w.add_sliding_window(cfg.sliding_window)
    if cfg.attn_softcap:
        w.add_float32(f"{gguf_arch}.attn_logit_softcapping", cfg.attn_softcap)
    if cfg.final_softcap:
        w.add_float32(f"{gguf_arch}.final_logit_softcapping", cfg.final_softcap)
    if cfg.rope_linear_factor != 1:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_linear_factor)
    gguf_files.byte_vocabulary(w, cfg.vocab_size)
    for hf_name, value in ckpt.state.items():
        if hf_name == "lm_head.weight":
            continue
        if hf_name.endswith("norm.weight"):
            value = value + np.float32(1)
        w.add_tensor(weights.gguf_name(hf_name, cfg.arch), np.ascontiguousarray(value, np.float32))
    return gguf_files.finish(w, path)


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory, request):
    made = {}

    def get(ckpt: str, gguf_arch: str):
        if ckpt not in made:
            saved = request.getfixturevalue(ckpt)
            path = tmp_path_factory.mktemp("gemma_gguf") / f"{saved.path.name}.gguf"
            made[ckpt] = write_gemma_gguf(path, saved, gguf_arch)
        return made[ckpt]
    return get


def _assert_generates_as_transformers(load, model_path, hf_path):
    artifact, weights_ = load(model_path, **OPTS)
    ours, tokens = run_ours(artifact, weights_, PROMPT, STEPS)
    ref = hf_reference(hf_path, PROMPT, tokens)
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=LOGIT_TOL["float32"], rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]


@pytest.mark.parametrize("ckpt", ["gemma2_ckpt", "gemma3_ckpt", "mistral_window_ckpt",
                                  "qwen2_window_ckpt"])
def test_hf_folder_generates_as_transformers(request, load, ckpt):
    """32 greedy tokens after an 11-token prompt (43 positions, the window 8) equal
    transformers', logits within LOGIT_TOL at every step."""
    path = request.getfixturevalue(ckpt).path
    _assert_generates_as_transformers(load, path, path)


@pytest.mark.parametrize("ckpt,gguf_arch", [("gemma2_gguf_ckpt", "gemma2"),
                                            ("gemma3_gguf_ckpt", "gemma3")])
def test_gguf_generates_as_transformers(request, load, gemma_gguf, ckpt, gguf_arch):
    path = gemma_gguf(ckpt, gguf_arch)
    _assert_generates_as_transformers(load, path, request.getfixturevalue(ckpt).path)


@pytest.mark.parametrize("ckpt,gguf_arch", [("gemma2_gguf_ckpt", "gemma2"),
                                            ("gemma3_gguf_ckpt", "gemma3")])
def test_gguf_form_reads_as_the_hf_form(request, gemma_gguf, ckpt, gguf_arch):
    """The GGUF's config is the folder's and every parameter equal: the folder's norms + 1
    (the GGUF's as stored), llama.cpp's names (post_attention_norm, post_ffw_norm)."""
    hf = resolve_model(str(request.getfixturevalue(ckpt).path))
    source = resolve_model(str(gemma_gguf(ckpt, gguf_arch)))
    assert source.config.shape_dict() == hf.config.shape_dict()
    ours, ref = source.load_params("float32"), hf.load_params("float32")
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
    state = request.getfixturevalue(ckpt).state
    np.testing.assert_array_equal(
        ref["layers.1.post_ffn_norm"],
        state["model.layers.1.post_feedforward_layernorm.weight"] + np.float32(1))


def test_configs_read_the_gemma_features(gemma2_ckpt, gemma3_ckpt, gemma3_gguf_ckpt):
    g2 = resolve_model(str(gemma2_ckpt.path)).config
    assert (g2.gate_act, g2.post_norms, g2.embed_scale, g2.attn_scale, g2.attn_softcap,
            g2.final_softcap, g2.sliding_window, g2.sliding_layers) == (
        "gelu_tanh", True, 8.0, np.float32(24 ** -0.5), 0.25, 0.5, WINDOW, (0, 2))
    g3 = resolve_model(str(gemma3_ckpt.path)).config
    assert (g3.qk_norm, g3.rope_theta, g3.rope_local_theta, g3.rope_linear_factor,
            g3.sliding_layers, g3.final_softcap, g3.attn_softcap) == (
        True, 1e6, 10000.0, 4.0, (0, 2), 0.0, 0.0)
    assert resolve_model(str(gemma3_gguf_ckpt.path)).config.sliding_layers == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("ckpt,change", [
    ("gemma2_ckpt", dict(sliding_window=64)), ("gemma2_ckpt", dict(attn_logit_softcapping=None)),
    ("gemma2_ckpt", dict(query_pre_attn_scalar=32)),
    ("gemma3_ckpt", dict(sliding_window=64)), ("gemma3_ckpt", dict(query_pre_attn_scalar=32)),
    ("gemma3_ckpt", dict(rope_parameters=dict(ROPE3, sliding_attention={
        "rope_type": "default", "rope_theta": 1e6}))),
])
def test_each_feature_changes_transformers_logits(request, ckpt, change):
    """The references above would catch a feature left out: each one, changed in transformers'
    own model, moves its last logits by far more than LOGIT_TOL."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = request.getfixturevalue(ckpt).path
    tokens = PROMPT + list(range(20, 52))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    changed = AutoModelForCausalLM.from_pretrained(
        path, config=AutoConfig.from_pretrained(path, **change), dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = (m(torch.tensor([tokens])).logits[0, -1].numpy() for m in (model, changed))
    assert np.abs(a - b).max() > 20 * LOGIT_TOL["float32"]


@pytest.mark.parametrize("ckpt", ["gemma2_ckpt", "gemma3_ckpt"])
def test_batched_rows_track_solo_decode(request, load, ckpt):
    """Two sequences in the 2-row bucket (prompts 11 and 5 tokens, fed 12 more each, past the
    window) against each decoded alone: logits within LOGIT_TOL."""
    artifact, weights_ = load(request.getfixturevalue(ckpt).path, **OPTS)
    prompts = [PROMPT, PROMPT[3:8]]
    fed = np.random.default_rng(3).integers(2, 256, size=(2, 12)).tolist()
    solo = BatchDecodeSession(artifact, weights_, make_pool(artifact, 40))._single
    want = []
    for prompt, tokens in zip(prompts, fed):
        h = solo.pool.new_sequence()
        solo.prefill(h, prompt)
        want.append([np.array(solo.realize_token(h, t)) for t in tokens])
        h.release()
    pool = make_pool(artifact, 40)
    session = BatchDecodeSession(artifact, weights_, pool)
    handles = [pool.new_sequence() for _ in prompts]
    for h, prompt in zip(handles, prompts):
        session._single.prefill(h, prompt)
    for step in range(12):
        got = session.step(handles, [fed[0][step], fed[1][step]])
        for row in range(2):
            np.testing.assert_allclose(got[row], want[row][step], atol=LOGIT_TOL["float32"],
                                       rtol=0, err_msg=f"step {step} row {row}")


# ---------------------------------------------------------------------------- kernels

@functools.lru_cache(maxsize=None)
def _compiled(factory, *args):
    func = factory(*args)
    lib = tvm.compile(func, target=resolve_target(None).target)
    return lib[func.attrs["global_symbol"]]


def _run(kernel, out_shape, *inputs):
    out = tvm.runtime.tensor(np.zeros(out_shape, np.float32))
    kernel(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], out)
    return out.numpy()


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("inter", [88, 96, 5])
def test_gelu_tanh_gate_kernel(inter):
    """The gate / up runs of a gate_up product (a last shorter run where inter % 16) ->
    gelu_tanh(gate) * up, as transformers' gelu_pytorch_tanh in float64."""
    rng = np.random.default_rng(inter)
    gate, up = (rng.standard_normal((3, inter)).astype(np.float32) * 3 for _ in range(2))
    y = interleave_gate_up(gate.T, up.T).T  # rows of w_gate_up -> columns of the product
    got = _run(_compiled(elementwise.gelu_tanh_gate, inter, None), (3, inter), y)
    want = _gelu_tanh(gate.astype(np.float64)) * up
    np.testing.assert_allclose(got, want, atol=TOL["float32"], rtol=TOL["float32"])


def test_softcap_and_scale_kernels():
    x = np.random.default_rng(0).standard_normal((2, 37)).astype(np.float32) * 40
    got = _run(_compiled(elementwise.softcap, 37, 30.0, None), (2, 37), x)
    np.testing.assert_allclose(got, 30 * np.tanh(x.astype(np.float64) / 30), atol=1e-4, rtol=0)
    got = _run(_compiled(elementwise.scale, 37, 8.0, 1), (1, 37), x[:1])
    np.testing.assert_array_equal(got, x[:1] * np.float32(8))


def test_rmsnorm_add_kernel():
    rng = np.random.default_rng(1)
    x, res = (rng.standard_normal((3, 40)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(40).astype(np.float32)
    got = _run(_compiled(elementwise.rmsnorm_add, 40, 1e-6, None), (3, 40), x, w, res)
    x64 = x.astype(np.float64)
    want = res + x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, atol=TOL["float32"], rtol=0)


def test_gpu_elementwise_kernels_on_opencl():
    """The GPU set's four kernels (one block per row) on OpenCL against the same references."""
    from paged_decode.compile.kernels.gpu import elementwise as gpu
    from paged_decode.compile.kernels.gpu.common import block_threads

    from .test_targets import _launch

    rng = np.random.default_rng(2)
    inter, n = 88, 3
    gate, up = (rng.standard_normal((n, inter)).astype(np.float32) * 3 for _ in range(2))
    y = interleave_gate_up(gate.T, up.T).T
    got = _launch(gpu.gelu_tanh_gate(inter), dict(y=y, act=np.zeros((n, inter), np.float32)),
                  dict(n=n), (n, 1, 1), (block_threads(inter), 1, 1))["act"]
    np.testing.assert_allclose(got, _gelu_tanh(gate.astype(np.float64)) * up,
                               atol=TOL["float32"], rtol=TOL["float32"])
    x = rng.standard_normal((n, 40)).astype(np.float32) * 40
    got = _launch(gpu.softcap(40, 30.0), dict(x=x, y=np.zeros_like(x)), dict(n=n), (n, 1, 1),
                  (block_threads(40), 1, 1))["y"]
    np.testing.assert_allclose(got, 30 * np.tanh(x.astype(np.float64) / 30), atol=1e-4, rtol=0)
    got = _launch(gpu.scale(40, 8.0), dict(x=x, y=np.zeros_like(x)), dict(n=n), (n, 1, 1),
                  (block_threads(40), 1, 1))["y"]
    np.testing.assert_array_equal(got, x * np.float32(8))
    res, w = rng.standard_normal((n, 40)).astype(np.float32), rng.standard_normal(40).astype(
        np.float32)
    got = _launch(gpu.rmsnorm_add(40, 1e-6), dict(x=x, w=w, res=res, y=np.zeros_like(x)),
                  dict(n=n), (n, 1, 1), (block_threads(40), 1, 1))["y"]
    x64 = x.astype(np.float64)
    want = res + x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_gemma_graph_builds_for_a_gpu_target(build, gemma2_ckpt):
    """The GPU kernel set builds Gemma 2's graph (OpenCL device code, run on no device here):
    the window on sliding layers only, soft-capped scores, the GELU-tanh gate, the post norms'
    fused add and the logit soft-cap."""
    from .test_targets import _library_bytes

    prepared = build(gemma2_ckpt.path, target="opencl", **OPTS)
    blob = _library_bytes(prepared)
    for name in (b"gpu_gelu_tanh_gate_dec_88", b"gpu_rmsnorm_add_pre_64",
                 b"gpu_softcap_dec_256_0p5", b"gpu_scale_dec_64_8"):
        assert name in blob, name
    # layer 1 is full, layers 0 and 2 slide: both kernels, each soft-capped and scaled
    tags = {m.group(1) for m in re.finditer(
        rb"gpu_attn_dec_q4kv2d32_bs4_cap16_f32(\w*?)_kernel", blob)}
    for tag in (b"_win8_softcap0p25_scale0p204", b"_softcap0p25_scale0p204"):
        assert any(t.startswith(tag) for t in tags), (tag, tags)
