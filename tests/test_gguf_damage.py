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
    with pytest.raises(WeightsError, match=rf"but {first} \(\w+, shape .*\) implies \d+ "
                                           r"bytes ending at \d+: a tensor.s type or shape"):
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


@pytest.mark.parametrize("type_name, dtype", [("F16", np.float16), ("BF16", None),
                                              ("F32", np.float32)])
def test_a_non_finite_float_tensor_of_each_float_type_is_named(llama_ckpt, tmp_path, type_name,
                                                                dtype):
    """F16 and BF16 are checked on their exponent bits: one NaN, one -inf among finite values
    (the largest finite float16 included, which must pass)."""
    cfg = resolve_model(str(llama_ckpt.path)).config
    values = llama_ckpt.state["model.layers.0.self_attn.o_proj.weight"]
    if dtype is None:  # bfloat16: the high half of float32
        bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        nan, inf = np.uint16(0x7FC0), np.uint16(0xFF80)
    else:
        bits = values.astype(dtype)
        nan, inf = dtype(np.nan), dtype(-np.inf)
        bits.flat[1] = np.finfo(dtype).max
    bits = bits.copy()
    bits.flat[7], bits.flat[-1] = nan, inf
    raw = bits.view(np.uint8).reshape(cfg.hidden_size, -1)
    path = _write(tmp_path / "f.gguf", llama_ckpt, raw={Q8_TENSOR: (type_name, raw)})
    with pytest.raises(WeightsError, match=rf"{Q8_TENSOR} \({type_name}\) has 2 NaN or infinite "
                                           "values"):
        resolve_model(str(path))


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


# ---------------------------------------------------------------- non-finite logits at run time
# Weights damaged after packing (the pack's checks cannot see them): the embedding row of one
# token is NaN, so a step that reads it has non-finite logits in exactly its own rows.

NAN_TOKEN = 7


@pytest.fixture(scope="module")
def nan_world(load):
    import dataclasses

    from paged_decode.runtime._tvm import tvm

    from .test_engine_args import OPTS

    artifact, weights = load("tiny", **OPTS)
    names = [p[0] for p in artifact.manifest.params]
    at = names.index("embed")
    embed = weights.params[at].numpy().copy()
    embed[NAN_TOKEN] = np.nan
    params = list(weights.params)
    params[at] = tvm.runtime.tensor(embed, artifact.device)
    return artifact, dataclasses.replace(weights, params=tuple(params))


def _session(world):
    from paged_decode.runtime.step import BatchDecodeSession

    from .conftest import make_pool

    artifact, weights = world
    pool = make_pool(artifact, 32)
    return pool, BatchDecodeSession(artifact, weights, pool)


def _blocks(pool):
    """The free blocks (as a set: a restore may return them in another order) and ref counts."""
    free, refs = pool.allocator.state()
    return sorted(free), refs


def test_nan_logits_at_prefill_are_an_error_naming_it(nan_world):
    from paged_decode.runtime.errors import NonFiniteLogitsError

    pool, batch = _session(nan_world)
    h = pool.new_sequence()
    before = _blocks(pool)
    with pytest.raises(NonFiniteLogitsError, match=rf"prefill of sequence {h.seq_id} "
                                                   r"\(positions 0 to 5\): the logits hold NaN"):
        batch._single.prefill(h, [1, 2, NAN_TOKEN, 3, 4, 5])
    assert h.length == 0 and _blocks(pool) == before
    assert np.isfinite(batch._single.prefill(h, [1, 2, 3])).all()  # the sequence goes on


def test_nan_logits_at_a_decode_step_are_an_error_naming_it(nan_world):
    from paged_decode.runtime.errors import NonFiniteLogitsError

    pool, batch = _session(nan_world)
    h = pool.new_sequence()
    batch._single.prefill(h, [1, 2, 3])
    with pytest.raises(NonFiniteLogitsError, match=rf"decode of sequence {h.seq_id} at "
                                                   "position 3") as err:
        batch._single.realize_token(h, NAN_TOKEN)
    assert err.value.step.startswith("decode") and h.length == 3
    # position 3 is written again by the next step: the NaN K/V left there is not read
    assert np.isfinite(batch._single.realize_token(h, 4)).all() and h.length == 4


def test_nan_logits_in_one_batch_row_name_that_row(nan_world):
    from paged_decode.runtime.errors import NonFiniteLogitsError

    pool, batch = _session(nan_world)
    handles = [pool.new_sequence() for _ in range(3)]
    for i, h in enumerate(handles):
        batch._single.prefill(h, [1, 2 + i])
    before = _blocks(pool)
    with pytest.raises(NonFiniteLogitsError, match=rf"^batched decode row 1 \(sequence "
                                                   rf"{handles[1].seq_id} at position 2\):") as e:
        batch.step(handles, [4, NAN_TOKEN, 5])
    assert e.value.rows == (1,)
    assert [h.length for h in handles] == [2, 2, 2] and _blocks(pool) == before
    assert np.isfinite(batch.step(handles, [4, 6, 5])).all()


def test_a_non_finite_row_ends_only_its_own_request(nan_world):
    """Three requests step together: one's prompt holds the NaN token (its prefill rows are
    NaN), one samples it (logit_bias) and so decodes it; each ends with the error, and the
    third, stepped again without them, gives its solo tokens; every block comes back."""
    from paged_decode.runtime.errors import NonFiniteLogitsError
    from paged_decode.runtime.sampling import SamplingParams
    from paged_decode.runtime.scheduler import Scheduler

    from .conftest import make_pool

    artifact, weights = nan_world

    def run(jobs):
        pool = make_pool(artifact, 32)
        sched = Scheduler(artifact, weights, pool, prefix_cache=False)
        reqs = [sched.add(prompt, max_tokens=6, sampling=params) for prompt, params in jobs]
        for _ in range(40):
            if all(r.finished for r in reqs):
                break
            sched.step()
        return pool, reqs

    _, (solo,) = run([([1, 2, 3], None)])
    forced = SamplingParams(logit_bias={NAN_TOKEN: 100})
    pool, (at_prefill, at_decode, fine) = run([([1, NAN_TOKEN, 3], None), ([4, 5], forced),
                                               ([1, 2, 3], None)])
    assert isinstance(at_prefill.error, NonFiniteLogitsError) and at_prefill.tokens == []
    assert "prefill of sequence" in str(at_prefill.error)
    assert isinstance(at_decode.error, NonFiniteLogitsError)
    assert at_decode.tokens == [NAN_TOKEN] and "decode row" in str(at_decode.error)
    assert (fine.error, fine.finish_reason, fine.tokens) == (None, "length", solo.tokens)
    assert pool.num_free == 32


def test_the_batching_engine_ends_requests_with_the_error_not_nan_text(nan_world, build):
    from paged_decode.runtime.batch_engine import BatchEngine
    from paged_decode.runtime.errors import NonFiniteLogitsError
    from paged_decode.runtime.tokenizer import Tokenizer

    from .test_engine_args import OPTS

    artifact, weights = nan_world
    pool, _batch = _session(nan_world)
    tokenizer = Tokenizer.from_dir(build("tiny", **OPTS).weights_dir)
    with BatchEngine(artifact, weights, pool, tokenizer) as engine:
        stream = engine.submit([1, NAN_TOKEN, 3], max_new_tokens=4)
        with pytest.raises(NonFiniteLogitsError, match="prefill of sequence"):
            stream.text()
        ok = engine.submit([1, 2, 3], max_new_tokens=4)  # the engine goes on
        assert len(ok.text()) >= 0 and ok.request.finish_reason in ("length", "stop")
