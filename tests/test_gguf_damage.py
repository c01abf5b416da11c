"""Damaged GGUF files are refused with a WeightsError naming the tensor or key, before anything
is compiled or cached: a tensor whose type or shape disagrees with its extent, NaN / inf in a
block scale or a float tensor, a token list that does not cover the vocabulary, a special token
id past it.  The files are written with gguf's GGUFWriter (tests/test_weights.py's writer), then
their header or data bytes patched where the writer cannot make the damage."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from paged_decode.compile import api
from paged_decode.compile.formats import FORMATS
from paged_decode.compile.gguf_checks import SCALE_OFFSETS
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime.errors import WeightsError

from .test_weights import write_llama_gguf

GGML = gguf.GGMLQuantizationType
Q8_TENSOR = "blk.1.attn_output.weight"


def _write(path: Path, ckpt, **kw) -> Path:
    cfg = resolve_model(str(ckpt.path)).config
    return write_llama_gguf(path, ckpt, cfg, formats=lambda name: "q8_0", **kw)


@pytest.fixture
def valid(llama_ckpt, tmp_path) -> Path:
    return _write(tmp_path / "valid.gguf", llama_ckpt)


def _patched(src: Path, dst: Path, at: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at:at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _info_offset(path: Path, name: str) -> int:
    """Byte offset of tensor ``name``'s info record after its name (n_dims, dims, type)."""
    data, key = path.read_bytes(), name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key)
    return at + 8 + len(key)


def _with_type(src: Path, dst: Path, name: str, new_type: GGML) -> Path:
    at = _info_offset(src, name)
    n_dims = struct.unpack_from("<I", src.read_bytes(), at)[0]
    return _patched(src, dst, at + 4 + 8 * n_dims, struct.pack("<I", int(new_type)))


def _with_dim(src: Path, dst: Path, name: str, axis: int, value: int) -> Path:
    return _patched(src, dst, _info_offset(src, name) + 4 + 8 * axis, struct.pack("<Q", value))


def test_the_valid_file_passes(valid):
    source = resolve_model(str(valid))
    assert source.kind == "gguf"
    assert np.isfinite(source.load_params("float32")["final_norm"]).all()


def test_a_type_implying_fewer_bytes_than_the_extent_is_named(valid, tmp_path):
    # Q4_0 blocks are 18 bytes where Q8_0's are 34: the next tensor starts past the implied end
    bad = _with_type(valid, tmp_path / "bad.gguf", Q8_TENSOR, GGML.Q4_0)
    with pytest.raises(WeightsError, match=rf"starts at byte \d+, but {Q8_TENSOR} \(Q4_0.*"
                                           "does not match its extent"):
        resolve_model(str(bad))


def test_a_shape_implying_more_bytes_than_the_extent_is_named(valid, tmp_path):
    rows = int(gguf.GGUFReader(valid).get_tensor(0).shape[1])
    first = gguf.GGUFReader(valid).get_tensor(0).name
    bad = _with_dim(valid, tmp_path / "bad.gguf", first, 1, rows + 1)
    with pytest.raises(WeightsError, match=rf"but {first} \(\w+, shape .*\) implies \d+ bytes "
                                           r"ending at \d+: a tensor.s type or shape does not match"):
        resolve_model(str(bad))


def test_the_last_tensor_reading_past_the_file_is_named(valid, tmp_path):
    reader = gguf.GGUFReader(valid)
    last = reader.tensors[-1]
    bad = _with_dim(valid, tmp_path / "bad.gguf", last.name, len(last.shape) - 1,
                    int(last.shape[-1]) * 64)
    with pytest.raises(WeightsError, match=rf"{last.name} .*past the end of the"):
        resolve_model(str(bad))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_q8_0_scale_is_named(llama_ckpt, tmp_path, value):
    cfg = resolve_model(str(llama_ckpt.path)).config
    blocks = FORMATS["q8_0"].quantize(llama_ckpt.state["model.layers.1.self_attn.o_proj.weight"])
    blocks = blocks.reshape(-1, 34).copy()
    blocks[5, 0:2] = np.array([value], np.float16).view(np.uint8)
    path = _write(tmp_path / "nan.gguf", llama_ckpt,
                  raw={Q8_TENSOR: ("Q8_0", blocks.reshape(cfg.hidden_size, -1))})
    with pytest.raises(WeightsError, match=rf"{Q8_TENSOR} \(Q8_0\) has 1 NaN or infinite block "
                                           "scales"):
        resolve_model(str(path))


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_a_non_finite_f32_norm_is_named(valid, tmp_path, value):
    norm = next(t for t in gguf.GGUFReader(valid).tensors if t.name == "blk.0.attn_norm.weight")
    bad = _patched(valid, tmp_path / "inf.gguf", int(norm.data_offset) + 4 * 3,
                   np.float32(value).tobytes())
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_norm\.weight \(F32\) has 1 NaN or "
                                           "infinite values"):
        resolve_model(str(bad))


def test_a_failed_check_leaves_the_cache_as_it_was(llama_ckpt, tmp_path):
    norm_file = _write(tmp_path / "ok.gguf", llama_ckpt)
    norm = next(t for t in gguf.GGUFReader(norm_file).tensors if t.name == "output_norm.weight")
    bad = _patched(norm_file, tmp_path / "bad.gguf", int(norm.data_offset),
                   np.float32(np.nan).tobytes())
    root = tmp_path / "artifacts"
    with pytest.raises(WeightsError, match="output_norm.weight"):
        api.prepare(str(bad), artifacts=root, policy="on")
    assert not root.exists() or not any(p for p in root.rglob("*") if p.is_file())


def test_a_short_token_list_is_named(llama_ckpt, tmp_path, monkeypatch):
    add = gguf.GGUFWriter.add_token_list
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", lambda w, tokens: add(w, tokens[:-1]))
    path = _write(tmp_path / "short.gguf", llama_ckpt)
    vocab = resolve_model(str(llama_ckpt.path)).config.vocab_size
    with pytest.raises(WeightsError, match=rf"tokenizer\.ggml\.tokens has {vocab - 1} entries, "
                                           rf"but the vocabulary .* has {vocab}"):
        resolve_model(str(path))


@pytest.mark.parametrize("key", ["eos", "bos", "pad"])
def test_a_special_id_past_the_vocabulary_is_named(llama_ckpt, tmp_path, monkeypatch, key):
    vocab = resolve_model(str(llama_ckpt.path)).config.vocab_size
    add = gguf.GGUFWriter.add_token_list

    def with_id(w, tokens):
        add(w, tokens)
        getattr(w, f"add_{key}_token_id")(vocab)
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_list", with_id)
    path = _write(tmp_path / f"{key}.gguf", llama_ckpt)
    name = {"pad": "padding"}.get(key, key)
    with pytest.raises(WeightsError, match=rf"tokenizer\.ggml\.{name}_token_id={vocab} is outside "
                                           rf"the vocabulary \[0, {vocab}\)"):
        resolve_model(str(path))


@pytest.mark.parametrize("type_name", sorted(SCALE_OFFSETS))
def test_scale_offsets_are_what_gguf_dequantizes_with(type_name):
    """Each listed offset is a scale gguf's own dequantizer multiplies by: inf there makes that
    block's values non-finite and leaves the other blocks finite."""
    from gguf.quants import dequantize

    qtype = GGML[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, type_size), dtype=np.uint8)
    for at in SCALE_OFFSETS[type_name]:
        blocks[:, at:at + 2] = np.full((3, 1), 0.01, np.float16).view(np.uint8)
    for at in SCALE_OFFSETS[type_name]:
        bad = blocks.copy()
        bad[1, at:at + 2] = np.array([np.inf], np.float16).view(np.uint8)
        with np.errstate(invalid="ignore"):
            values = dequantize(bad, qtype).reshape(3, block)
        assert not np.isfinite(values[1]).any(), (type_name, at)
        assert np.isfinite(values[[0, 2]]).all(), (type_name, at)
