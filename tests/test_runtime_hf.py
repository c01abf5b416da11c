"""End to end against HF transformers: prefill logits, 48 decode steps, greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_decode.bench.baselines import hf_forward
from paged_decode.runtime.kv_pool import k_rows
from paged_decode.runtime.session import PagedDecodeSession

from .conftest import (BATCHED, LOGIT_TOL, TOL, _randomize, _save, make_pool,
                       QUANT_MODEL_RTOL)

PROMPT = [3, 17, 99, 41, 5, 250, 8, 77, 12, 64, 31]  # 11 tokens: crosses blocks of 4
STEPS = 48


@pytest.fixture(scope="session")
def llama_tied_ckpt(tmp_path_factory):
    """Tied embeddings, llama3 rope_scaling, MHA-free GQA 6/2, untouched head_dim."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, intermediate_size=160, vocab_size=288,
                      tie_word_embeddings=True, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})
    model = LlamaForCausalLM(cfg)
    _randomize(model, seed=3)
    return _save(model, tmp_path_factory, "llama_tied")


def hf_reference(path, prompt, ours):
    """HF logits at the prompt's end and after each of ``ours`` tokens (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out, past = hf_forward(model, torch.tensor([prompt]))
        logits = [out.logits[0, -1].numpy()]
        for tok in ours:
            out, past = hf_forward(model, torch.tensor([[tok]]), past)
            logits.append(out.logits[0, -1].numpy())
    return logits


def run_ours(artifact, weights, prompt, steps, num_blocks=40):
    pool = make_pool(artifact, num_blocks)
    pool.new_sequence().reserve(6)  # another sequence owns the first blocks
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    logits = [session.prefill(handle, prompt)]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(session.realize_token(handle, tokens[-1]))
    assert session.realize_count == steps
    return logits, tokens


CASES = [("llama_ckpt", 4, "float32"), ("llama_ckpt", 16, "float32"),
         ("llama_ckpt", None, "float32"),  # the CPU's default block size (64)
         ("qwen2_ckpt", 4, "float32"), ("qwen3_ckpt", 4, "float32"),
         ("llama_tied_ckpt", 4, "float32"),
         ("llama_ckpt", 4, "float16")]
# the checkpoints test_batch_decode builds batched: at blocks of 4 in float32 they take that build
BATCHED_CKPTS = ("llama_ckpt", "qwen2_ckpt")


def _opts(ckpt, block_size=4, cache_dtype="float32", **more):
    """``ckpt``'s prepare options: :data:`conftest.BATCHED` where that build fits."""
    if ckpt in BATCHED_CKPTS and block_size == 4 and cache_dtype == "float32" and not more:
        return BATCHED
    return dict(block_size=block_size, max_context=64, cache_dtype=cache_dtype, **more)


@pytest.mark.parametrize("ckpt,block_size,cache_dtype", CASES)
def test_matches_hf(request, load, ckpt, block_size, cache_dtype):
    path = request.getfixturevalue(ckpt).path
    artifact, weights = load(path, **_opts(ckpt, block_size, cache_dtype))
    ours, tokens = run_ours(artifact, weights, PROMPT, STEPS)
    ref = hf_reference(path, PROMPT, tokens)
    tol = LOGIT_TOL[cache_dtype]
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]


# test_batch_decode's float16 build of llama_ckpt (weights and cache; one bucket, of 16 rows)
LLAMA_F16 = dict(BATCHED, weight_dtype="float16", cache_dtype="float16", batch_buckets=(16,))


def test_f16_weights_track_f32(load, llama_ckpt):
    """float16 weights (in the float16-cache build test_batch_decode makes; the cache alone:
    test_matches_hf's float16 case): prefill logits within 5e-2 of float32's."""
    a32, w32 = load(llama_ckpt.path, **_opts("llama_ckpt"))
    a16, w16 = load(llama_ckpt.path, **LLAMA_F16)
    assert (a16.manifest.weight_dtype, a16.manifest.cache_dtype) == ("float16", "float16")
    l32, _ = run_ours(a32, w32, PROMPT, 8)
    l16, _ = run_ours(a16, w16, PROMPT, 8)
    np.testing.assert_allclose(l16[0], l32[0], atol=LOGIT_TOL["float16"], rtol=0)


@pytest.mark.parametrize("block_size", [4, None])  # None: the CPU's default (64)
def test_pool_holds_hf_keys_and_values(load, llama_ckpt, block_size):
    """After a prefill and three decode steps, each position's K and V in the pool, read as rows
    through the artifact's ``k_block_layout`` (``kv_pool.k_rows``), are HF's cached keys (RoPE
    applied) and values for that position: the layout the manifest states is the one the kernels
    write."""
    from transformers import AutoModelForCausalLM

    artifact, weights = load(llama_ckpt.path, **_opts("llama_ckpt", block_size))
    pool = make_pool(artifact, 40)
    pool.new_sequence().reserve(6)  # another sequence owns the first blocks
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    tokens = PROMPT + [7, 19, 3]
    session.prefill(handle, PROMPT)
    for tok in tokens[len(PROMPT):]:
        session.realize_token(handle, tok)
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt.path, dtype=torch.float32).eval()
    with torch.no_grad():
        _, past = hf_forward(model, torch.tensor([tokens]))
    bs = artifact.block_size
    offs = [handle.write_offset(p) for p in range(len(tokens))]
    for layer in range(artifact.manifest.n_layers):
        k = k_rows(pool.pools[2 * layer].numpy(), artifact.k_block_layout)
        v = pool.pools[2 * layer + 1].numpy()
        ours_k = np.stack([k[o // bs, :, o % bs] for o in offs], 1)  # (Hkv, positions, D)
        ours_v = np.stack([v[o // bs, :, o % bs] for o in offs], 1)
        np.testing.assert_allclose(ours_k, past.layers[layer].keys[0].numpy(),
                                   atol=TOL["float32"], rtol=TOL["float32"])
        np.testing.assert_allclose(ours_v, past.layers[layer].values[0].numpy(),
                                   atol=TOL["float32"], rtol=TOL["float32"])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_quantized_weights_track_f32(load, build, llama_ckpt, fmt):
    """A float checkpoint quantized by our quantizer: the pack dequantizes to what gguf's own
    quantize -> dequantize gives, the LM head is Q8_0, and generation stays near float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file

    from paged_decode.compile.formats import FORMATS, INTERLEAVED
    from paged_decode.compile.weights import resolve_model

    opts = _opts("llama_ckpt", weight_dtype=fmt)
    a32, w32 = load(llama_ckpt.path, **_opts("llama_ckpt"))
    aq, wq = load(llama_ckpt.path, **opts)
    # the CPU layout: layers' rows and the Q8_0 LM head interleaved by 8, the embedding by rows
    assert aq.manifest.weight_dtype == INTERLEAVED[fmt].name
    formats = aq.manifest.key["weight_formats"]
    assert formats == {"embed": fmt, **({} if fmt == "q8_0" else {"lm_head": "q8_0x8"})}
    packed = load_file(str(build(llama_ckpt.path, **opts).weights_dir
                           / "params.safetensors"))
    floats = resolve_model(str(llama_ckpt.path)).load_params("float32")
    qtype = GGMLQuantizationType[FORMATS[fmt].gguf_type]
    for name in ("layers.0.wqkv", "layers.1.w_gate_up", "layers.0.w_down", "embed"):
        K = floats[name].shape[1]
        stored = FORMATS[formats.get(name, aq.manifest.weight_dtype)]
        np.testing.assert_array_equal(stored.dequantize(packed[name], K),
                                      dequantize(quantize(floats[name], qtype), qtype)
                                      .reshape(floats[name].shape), err_msg=name)
    assert packed["lm_head"].dtype == np.uint8
    l32, t32 = run_ours(a32, w32, PROMPT, 8)
    lq, tq = run_ours(aq, wq, PROMPT, 8)
    assert len(tq) == len(t32)
    scale = np.abs(l32[0]).max()
    np.testing.assert_allclose(lq[0], l32[0], atol=QUANT_MODEL_RTOL[fmt] * scale, rtol=0)


def _q4_k_m_like(name: str) -> str:
    """A Q4_K_M-like mix of k-quants by GGUF tensor name: Q6_K output and layer 0's V and down
    (llama.cpp raises those), Q5_K gate / up and layer 1's down, Q4_K the rest."""
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return "q6_k"
    if ".ffn_gate." in name or ".ffn_up." in name or name == "blk.1.ffn_down.weight":
        return "q5_k"
    return "q4_k"


def _hf_logits(cfg, params, tokens) -> np.ndarray:
    """transformers' float32 logits at every position of ``tokens``, from our params dict."""
    from paged_decode.bench.baselines import hf_model

    with torch.no_grad():
        return hf_model(cfg, params, "float32")(torch.tensor([tokens])).logits[0].numpy()


def test_k_quant_gguf_runs_its_formats_natively(load, llama_wide_ckpt, tmp_path_factory):
    """A GGUF mixing Q4_K / Q5_K / Q6_K per tensor (layer 0's V apart from Q / K) runs each
    tensor in its own format: the pack holds the file's bytes, and logits follow transformers
    on the file's dequantized weights."""
    from paged_decode.compile.formats import FORMATS
    from paged_decode.compile.weights import interleave_formats, resolve_formats, resolve_model

    from .conftest import NATIVE_VS_DEQUANT_RTOL
    from .test_weights import write_llama_gguf

    path = tmp_path_factory.mktemp("kquant") / "mix.gguf"
    cfg = resolve_model(str(llama_wide_ckpt.path)).config
    write_llama_gguf(path, llama_wide_ckpt, cfg, formats=_q4_k_m_like)
    source = resolve_model(str(path))
    base, others = resolve_formats(source, "auto")
    assert base == "q4_k"
    assert dict(others) == {"layers.0.wv": "q6_k", "layers.0.w_down": "q6_k",
                            "layers.0.w_gate_up": "q5_k", "layers.1.w_gate_up": "q5_k",
                            "layers.1.w_down": "q5_k", "lm_head": "q6_k"}
    native, floats = source.load_params(base, others), source.load_params("float32")
    assert "layers.0.wqkv" not in native and "layers.1.wqkv" in native
    q, kv = cfg.q_size, cfg.kv_size
    floats_split = {"layers.0.wqk": floats["layers.0.wqkv"][:q + kv],
                    "layers.0.wv": floats["layers.0.wqkv"][q + kv:]}
    for name, packed in native.items():
        if packed.dtype == np.uint8:
            fmt = dict(others).get(name, base)
            want = floats_split.get(name, floats.get(name))
            np.testing.assert_array_equal(FORMATS[fmt].dequantize(packed, want.shape[1]), want,
                                          err_msg=name)
    artifact, weights = load(path, block_size=4, max_context=64)
    # the CPU layout: the matrices and the Q6_K head interleaved by 8 (the embedding keeps rows)
    base8, others8 = interleave_formats(cfg, base, others)
    assert base8 == "q4_kx8" and dict(others8) == {
        **dict(others), "layers.0.wv": "q6_kx8", "layers.0.w_down": "q6_kx8",
        "layers.0.w_gate_up": "q5_kx8", "layers.1.w_gate_up": "q5_kx8",
        "layers.1.w_down": "q5_kx8", "embed": "q4_k", "lm_head": "q6_kx8"}
    assert artifact.manifest.weight_dtype == base8
    assert artifact.manifest.key["weight_formats"] == dict(others8)
    logits, tokens = run_ours(artifact, weights, PROMPT, 8)
    want = _hf_logits(source.config, floats, PROMPT + tokens)[len(PROMPT) - 1:]
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(logits), want, atol=NATIVE_VS_DEQUANT_RTOL * scale,
                               rtol=0)


def _assert_tracks_float(artifact, weights, ckpt, fmt: str):
    """8 greedy tokens of ours from the artifact: logits within QUANT_MODEL_RTOL[fmt] (of their
    largest magnitude) of transformers' float32 model on the same tokens."""
    from paged_decode.compile.weights import resolve_model

    logits, tokens = run_ours(artifact, weights, PROMPT, 8)
    source = resolve_model(str(ckpt.path))
    want = _hf_logits(source.config, source.load_params("float32"), PROMPT + tokens)
    want = want[len(PROMPT) - 1:]
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(logits), want, atol=QUANT_MODEL_RTOL[fmt] * scale, rtol=0)


def test_hf_checkpoint_quantized_to_q4_k_tracks_float(load, llama_wide_ckpt):
    """``--weight-format q4_k`` on an HF directory: matrices in Q4_K (the LM head Q8_0), logits
    within QUANT_MODEL_RTOL of transformers' float32 model."""
    artifact, weights = load(llama_wide_ckpt.path, weight_dtype="q4_k", block_size=4,
                             max_context=64)
    assert artifact.manifest.weight_dtype == "q4_kx8"  # the CPU layout
    assert artifact.manifest.key["weight_formats"] == {"embed": "q4_k", "lm_head": "q8_0x8"}
    _assert_tracks_float(artifact, weights, llama_wide_ckpt, "q4_k")


def test_hf_checkpoint_in_the_q4_k_m_mix_tracks_float(load, llama_wide_ckpt):
    """``--weight-format q4_k_m`` on an HF directory: llama.cpp's mix (of 2 layers, layer 1
    takes Q6_K V, its rows apart from Q / K, and down projection; the LM head Q6_K, its rows
    interleaved too: its int16 x is one its kernels take), logits
    within QUANT_MODEL_RTOL of transformers' float32 model."""
    artifact, weights = load(llama_wide_ckpt.path, weight_dtype="q4_k_m", block_size=4,
                             max_context=64)
    assert artifact.manifest.weight_dtype == "q4_kx8"
    assert artifact.manifest.key["weight_formats"] == {
        "embed": "q4_k", "lm_head": "q6_kx8", "layers.1.wv": "q6_kx8",
        "layers.1.w_down": "q6_kx8"}
    assert "layers.1.wqk" in {p[0] for p in artifact.manifest.params}
    _assert_tracks_float(artifact, weights, llama_wide_ckpt, "q4_k_m")
