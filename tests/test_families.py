"""Model families (compile/arch): each family's HF checkpoint converted to GGUF the way
llama.cpp's converter writes it reads back as the same config and weights, and generates
transformers' greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paged_decode.compile import arch, weights
from paged_decode.compile.weights import resolve_model

from . import gguf_files
from .conftest import LOGIT_TOL
from .test_runtime_hf import hf_reference, llama_tied_ckpt, run_ours  # noqa: F401  (fixture)

PROMPT = [3, 17, 99, 41, 5, 250, 8, 77, 12, 64, 31]  # 11 tokens: crosses blocks of 4
STEPS = 32


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, halves -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama3_rope_factors(ckpt) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs`` for a llama3-scaled Llama (LlamaModel's
    generate_extra_tensors), from the checkpoint's own scaling parameters."""
    import math

    from transformers import AutoConfig

    hc = AutoConfig.from_pretrained(ckpt.path)
    rope = hc.rope_parameters
    base, dim = rope["rope_theta"], hc.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def write_family_gguf(path, ckpt, gguf_arch: str, *, permute_qk: bool, rope_freqs=None):
    """A float32 GGUF of ``ckpt`` as convert_hf_to_gguf writes a model of ``gguf_arch``:
    llama.cpp's metadata keys under that architecture, its tensor names, Q / K rows permuted
    only for ``permute_qk`` (Llama; Qwen's NEOX RoPE keeps HF's order), no ``output.weight``
    for tied embeddings, ``rope_freqs`` (llama3 scaling) as its tensor; a byte-level ('gpt2')
    vocabulary so the file loads as a model."""
    import gguf

    cfg = resolve_model(str(ckpt.path)).config
    w = gguf.GGUFWriter(path, gguf_arch)
    gguf_files.shape_keys(w, cfg)
    gguf_files.byte_vocabulary(w, cfg.vocab_size)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for hf_name, value in ckpt.state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if permute_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            value = llama_cpp_permute(value, cfg.n_q_heads if ".q_proj." in hf_name
                                      else cfg.n_kv_heads)
        w.add_tensor(weights.gguf_name(hf_name), np.ascontiguousarray(value, np.float32))
    return gguf_files.finish(w, path)


@pytest.fixture(scope="session")
def family_gguf(tmp_path_factory, request):
    """``family_gguf(ckpt fixture name, GGUF architecture)`` -> the GGUF path, written once."""
    made = {}

    def get(ckpt: str, gguf_arch: str):
        if (ckpt, gguf_arch) not in made:
            saved = request.getfixturevalue(ckpt)
            # named as the folder: an equal config then reuses the folder's artifact
            path = tmp_path_factory.mktemp("family_gguf") / f"{saved.path.name}.gguf"
            made[ckpt, gguf_arch] = write_family_gguf(
                path, saved, gguf_arch, permute_qk=arch.BY_GGUF[gguf_arch].gguf_qk_permuted)
        return made[ckpt, gguf_arch]
    return get


def test_registry_maps_every_name_to_its_family():
    assert {a: f.name for a, f in arch.BY_HF.items()} == {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
    assert {a: f.name for a, f in arch.BY_GGUF.items()} == {
        "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3": "gemma3", "phi3": "phi3"}
    assert weights.gguf_name("model.layers.1.self_attn.k_norm.weight") == "blk.1.attn_k_norm.weight"
    assert weights.gguf_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"


@pytest.mark.parametrize("ckpt,gguf_arch", [("qwen2_ckpt", "qwen2"), ("qwen3_ckpt", "qwen3"),
                                            ("llama_ckpt", "llama")])
def test_gguf_form_reads_as_the_hf_form(request, family_gguf, ckpt, gguf_arch):
    """The GGUF's config is the folder's (eps as float32 stores it) and every parameter is
    equal: tensor names, Q / K row order, biases, q/k norms and the tied head."""
    hf = resolve_model(str(request.getfixturevalue(ckpt).path))
    source = resolve_model(str(family_gguf(ckpt, gguf_arch)))
    assert source.kind == "gguf"
    want = dict(hf.config.shape_dict(), rms_norm_eps=float(np.float32(hf.config.rms_norm_eps)))
    assert source.config.shape_dict() == want
    ours, ref = source.load_params("float32"), hf.load_params("float32")
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)


def test_qwen3_layers_have_qk_norms(qwen3_ckpt):
    cfg = resolve_model(str(qwen3_ckpt.path)).config
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias, cfg.head_dim) == ("qwen3", True, False, 32)
    params = resolve_model(str(qwen3_ckpt.path)).load_params("float32")
    np.testing.assert_array_equal(params["layers.1.k_norm"],
                                  qwen3_ckpt.state["model.layers.1.self_attn.k_norm.weight"])
    assert params["layers.0.q_norm"].shape == (32,)


@pytest.mark.parametrize("ckpt,gguf_arch", [("qwen2_ckpt", "qwen2"), ("qwen3_ckpt", "qwen3")])
def test_gguf_generates_as_transformers(request, load, family_gguf, ckpt, gguf_arch):
    """32 greedy tokens from the GGUF equal transformers' on the HF folder, logits within
    LOGIT_TOL at every step."""
    path = family_gguf(ckpt, gguf_arch)
    artifact, weights_ = load(path, block_size=4, max_context=64)
    ours, tokens = run_ours(artifact, weights_, PROMPT, STEPS)
    ref = hf_reference(request.getfixturevalue(ckpt).path, PROMPT, tokens)
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=LOGIT_TOL["float32"], rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]


def test_llama3_gguf_rope_freqs_generate_as_transformers(load, tmp_path_factory,
                                                        llama_tied_ckpt):  # noqa: F811
    """A Llama 3.x GGUF stores llama3 RoPE scaling as the converter's ``rope_freqs`` tensor:
    its RoPE table is transformers' llama3 one, and 32 greedy tokens equal transformers' (the
    checkpoint's original context of 16 makes the scaling matter within the prompt)."""
    import torch
    from transformers import AutoModelForCausalLM

    from paged_decode.compile.rope import rope_inv_freq

    ckpt = llama_tied_ckpt
    path = write_family_gguf(tmp_path_factory.mktemp("llama3") / f"{ckpt.path.name}.gguf", ckpt,
                             "llama", permute_qk=True, rope_freqs=llama3_rope_factors(ckpt))
    source = resolve_model(str(path))
    assert source.config.rope_freq_factors is not None and source.config.rope_scaling is None
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32)
    hf_inv = model.model.rotary_emb.inv_freq.numpy()
    unscaled = rope_inv_freq(dataclasses.replace(source.config, rope_freq_factors=None))
    assert not np.allclose(hf_inv, unscaled, rtol=1e-3)  # the scaling changes the table
    np.testing.assert_allclose(rope_inv_freq(source.config), hf_inv, rtol=1e-6, atol=0)
    artifact, weights_ = load(path, block_size=4, max_context=64)
    ours, tokens = run_ours(artifact, weights_, PROMPT, STEPS)
    ref = hf_reference(ckpt.path, PROMPT, tokens)
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=LOGIT_TOL["float32"], rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]
