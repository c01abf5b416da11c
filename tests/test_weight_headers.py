"""Weight files are checked when the model is resolved, before anything compiles: a damaged
safetensors file, shard index or GGUF is a WeightsError naming the file and what is wrong.
Fuzzed headers are a typed error or a file the safetensors library itself reads."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paged_decode.compile import weights
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime.errors import ConfigError, WeightsError

from .test_weights import write_llama_gguf

def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def split(data: bytes) -> tuple[dict, bytes]:
    """(header, data bytes) of a safetensors file."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header: dict | list, body: bytes, n: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if n is None else n) + text + body


def edit_header(data: bytes, edit) -> bytes:
    header, body = split(data)
    edit(header)
    return join(header, body)


def entry(name: str, **changes):
    def edit(header):
        header[name].update(changes)
    return edit


K = "model.layers.0.self_attn.k_proj.weight"  # (64, 64) float32 in the llama fixture


@pytest.fixture
def damaged(llama_ckpt, tmp_path):
    """damaged(f) -> the path of a copy of the llama checkpoint whose model.safetensors is
    f(its bytes)."""
    copy = shutil.copytree(llama_ckpt.path, tmp_path / "copy")
    original = (copy / "model.safetensors").read_bytes()

    def make(edit) -> str:
        (copy / "model.safetensors").write_bytes(edit(original))
        return str(copy)
    return make


@pytest.mark.parametrize("edit, message", [
    (lambda d: b"", r"0 bytes, shorter than the 8-byte header length"),
    (lambda d: d[:5], r"5 bytes, shorter than the 8-byte header length"),
    (lambda d: struct.pack("<Q", 2**63) + d[8:], r"header length 9223372036854775808 in a file"),
    (lambda d: struct.pack("<Q", len(d)) + d[8:], r"header length \d+ in a file of \d+ bytes"),
    (lambda d: d[:8] + b"\x00garbage" + d[16:], r"does not start with '\{'"),
    (lambda d: d[:8] + b"{garbage" + d[16:], r"the header is not JSON"),
    (lambda d: join([1, 2], split(d)[1]), r"the header does not start with '\{'"),
    (lambda d: d[:-100], r"the tensors hold \d+ data bytes, the file \d+"),
    (lambda d: d + b"\x00" * 4, r"the tensors hold \d+ data bytes, the file \d+"),
    (lambda d: edit_header(d, entry(K, dtype="F31")), rf"tensor {K}: entry .* has no known dtype"),
    (lambda d: edit_header(d, entry(K, dtype=None)), r"has no known dtype"),
    (lambda d: edit_header(d, entry(K, shape="64x64")), r"shape '64x64' / data_offsets"),
    (lambda d: edit_header(d, entry(K, shape=[64, -64])), r"are not lists of byte counts"),
    (lambda d: edit_header(d, entry(K, shape=[64, 64.0])), r"are not lists of byte counts"),
    (lambda d: edit_header(d, entry(K, data_offsets=[0])), r"are not lists of byte counts"),
    (lambda d: edit_header(d, entry(K, data_offsets=[0, True])), r"are not lists of byte counts"),
    (lambda d: edit_header(d, entry(K, shape=[2**20, 2**20])), r"hold 16384 bytes, F32 \[1048576"),
    (lambda d: edit_header(d, entry(K, shape=[2**40, 2**40, 2**40, 0])), r"overflows"),
    (lambda d: edit_header(d, entry(K, shape=[64, 63])), r"hold 16384 bytes, F32 \[64, 63\]"),
    (lambda d: edit_header(d, lambda h: h[K]["data_offsets"].__setitem__(0, 0)),
     r"hold \d+ bytes"),
    (lambda d: edit_header(d, lambda h: h.__setitem__("__metadata__", {"format": 1})),
     r"__metadata__ is not an object of strings"),
    (lambda d: edit_header(d, lambda h: h.__setitem__("extra", {"dtype": "F32", "shape": [1],
                                                                 "data_offsets": [0, 4]})),
     r"starts at data byte"),
    # a well-formed file whose tensors do not fit the config
    (lambda d: edit_header(d, entry(K, dtype="I32")), rf"{K} in .*: its dtype cannot be "
                                                      "converted to float"),
    (lambda d: edit_header(d, entry(K, dtype="U8", shape=[64, 256])), r"shape \[64, 256\], "
                                                                      r"config .* expects"),
    (lambda d: edit_header(d, lambda h: h.__setitem__("renamed", h.pop(K))),
     rf"tensor {K} is missing from"),
], ids=['empty', '5-bytes', 'length-2**63', 'length-past-end', 'header-not-json-start',
    'header-garbage', 'header-a-list', 'data-truncated', 'data-trailing', 'dtype-unknown',
    'dtype-null', 'shape-a-string', 'shape-negative', 'shape-float', 'offsets-one',
    'offsets-bool', 'shape-huge', 'shape-overflow', 'shape-offsets-disagree',
    'offsets-overlap', 'metadata-not-strings', 'tensor-overlapping', 'dtype-int',
    'shape-wrong-for-config', 'tensor-missing'])
def test_damaged_safetensors_is_named_at_resolve(damaged, edit, message):
    path = damaged(edit)
    with pytest.raises(WeightsError, match=message) as e:
        resolve_model(path)
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_damaged_checkpoint_fails_before_anything_compiles(damaged, tmp_path, monkeypatch):
    from paged_decode.compile import api

    monkeypatch.setattr(api, "ensure_artifact", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(WeightsError, match="model.safetensors: damaged safetensors file"):
        api.prepare(damaged(lambda d: d[:-1]), artifacts=tmp_path / "art")


# ------------------------------------------------------------------------------- shard index

@pytest.fixture
def sharded(llama_sharded_ckpt, tmp_path):
    return shutil.copytree(llama_sharded_ckpt.path, tmp_path / "sharded")


def _index(path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda p, i: b"{not json", r"not valid JSON"),
    (lambda p, i: b"\xff\xfe\x00", r"not valid JSON"),
    (lambda p, i: b"[]", r"weight_map is None, not a non-empty object"),
    (lambda p, i: json.dumps(dict(i, weight_map=[1])).encode(), r"weight_map is \[1\]"),
    (lambda p, i: json.dumps(dict(i, weight_map={})).encode(), r"weight_map is \{\}"),
    (lambda p, i: json.dumps(dict(i, weight_map=dict(i["weight_map"], **{K: 3}))).encode(),
     rf"weight_map puts {K} in 3, not a file name"),
    (lambda p, i: json.dumps(dict(i, weight_map=dict(i["weight_map"], **{K: "/etc/passwd"})))
     .encode(), r"'/etc/passwd', not a file name inside the model directory"),
    (lambda p, i: json.dumps(dict(i, weight_map=dict(i["weight_map"], **{K: "../x"})))
     .encode(), r"'\.\./x', not a file name inside"),
    (lambda p, i: json.dumps(dict(i, weight_map=dict(i["weight_map"], **{K: "gone.safetensors"})))
     .encode(), r"shard files missing: \[.*gone\.safetensors'\]"),
], ids=['not-json', 'not-utf8', 'not-an-object', 'weight-map-list', 'weight-map-empty',
    'shard-not-str', 'shard-absolute', 'shard-parent', 'shard-missing'])
def test_broken_shard_index_is_named(sharded, edit, message):
    (sharded / "model.safetensors.index.json").write_bytes(edit(sharded, _index(sharded)))
    with pytest.raises(WeightsError, match=r"model\.safetensors\.index\.json: .*" + message):
        resolve_model(str(sharded))


def test_index_and_shards_disagree(sharded):
    index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    elsewhere = next(s for s in shards if s != index["weight_map"][K])
    index["weight_map"][K] = elsewhere
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=rf"weight_map puts {K} in {elsewhere}, which does "
                                           "not hold it"):
        resolve_model(str(sharded))


def test_damaged_shard_is_named(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(WeightsError, match=rf"{shard.name}: damaged safetensors file: the "
                                           r"tensors hold \d+ data bytes"):
        resolve_model(str(sharded))


# ------------------------------------------------------------------------------- GGUF

@pytest.fixture(scope="module")
def tiny_gguf(llama_ckpt, tmp_path_factory) -> bytes:
    cfg = resolve_model(str(llama_ckpt.path)).config
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf", llama_ckpt, cfg
                            ).read_bytes()


@pytest.mark.parametrize("cut", [0, 3, 24, 100, 1000, -4096, -1])
def test_truncated_gguf_is_a_weights_error(tiny_gguf, tmp_path, cut):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(tiny_gguf[:cut])
    with pytest.raises(WeightsError, match=rf"cut{cut}\.gguf: (not a readable GGUF file|tensor "
                                           r".* past the end)"):
        resolve_model(str(path))


def test_gguf_tensor_shape_checked_at_resolve(llama_ckpt, tmp_path):
    cfg = resolve_model(str(llama_ckpt.path)).config
    state = dict(llama_ckpt.state)
    state[K] = state[K][:32]
    ckpt = llama_ckpt._replace(state=state)
    path = write_llama_gguf(tmp_path / "short.gguf", ckpt, cfg)
    with pytest.raises(WeightsError, match=rf"{K} in .*short\.gguf \(as blk\.0\.attn_k\.weight\): "
                                           r"shape \[32, 64\]"):
        resolve_model(str(path))


@fuzz(60)
@given(st.data())
def test_fuzzed_gguf_is_typed_error_or_valid(tiny_gguf, tmp_path, data):
    raw = bytearray(tiny_gguf)
    cut = data.draw(st.integers(0, len(raw)))
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, max(cut - 1, 0)))
        if at < len(raw):
            raw[at] = data.draw(st.integers(0, 255))
    path = tmp_path / f"f{data.draw(st.integers(0, 2**62))}.gguf"  # a new name: a new reader
    path.write_bytes(bytes(raw[:cut]))
    try:
        source = resolve_model(str(path))
    except (WeightsError, ConfigError) as e:
        assert "\n" not in str(e)
        return
    assert source.kind == "gguf" and source.config.n_layers >= 1


# ------------------------------------------------------------------------------- header fuzz

DTYPES = ["F32", "F16", "BF16", "I32", "U8", "F64", "I64", "BOOL"]
SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1, "F64": 8, "I64": 8, "BOOL": 1}


@st.composite
def safetensors_files(draw) -> bytes:
    """A valid file of a few small tensors (zero-size ones included)."""
    tensors = draw(st.lists(st.tuples(st.sampled_from(DTYPES),
                                      st.lists(st.integers(0, 3), max_size=3)),
                            min_size=1, max_size=4))
    header, pos = {}, 0
    for i, (dtype, shape) in enumerate(tensors):
        n = SIZES[dtype]
        for d in shape:
            n *= d
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    body = bytes(draw(st.integers(0, 1)) for _ in range(pos))  # 0/1 bytes: no NaN patterns
    return join(header, body)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**65)
                           | st.text(max_size=5) | st.floats(), lambda inner: st.lists(
                               inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                    max_size=3), max_leaves=6)


@st.composite
def damaged_safetensors(draw) -> bytes:
    data = draw(safetensors_files())
    kind = draw(st.sampled_from(["cut", "length", "json", "entry", "bytes"]))
    header, body = split(data)
    if kind == "cut":
        return data[:draw(st.integers(0, len(data)))]
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + data[8:]
    if kind == "json":
        return join(draw(JSON_VALUES), body)
    if kind == "entry":
        name = draw(st.sampled_from(sorted(header)))
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "other"]))
        if isinstance(header[name], dict):
            header[name][key] = draw(JSON_VALUES | st.sampled_from(DTYPES))
        return join(header, body)
    raw = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


@fuzz(400)
@given(damaged_safetensors() | safetensors_files())
@example(data=b'\x0c\x00\x00\x00\x00\x00\x00\x00{"\\n": null}\x00\x00\x00\x00')  # a name's newline
def test_fuzzed_safetensors_header_is_typed_error_or_readable(tmp_path, data):
    """What the check accepts, the safetensors library reads: every tensor, with the header's
    dtype and shape."""
    from safetensors import safe_open

    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    try:
        entries = weights._safetensors_header(path)
    except WeightsError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
        return
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(entries)
        for name, (dtype, shape) in entries.items():
            t = f.get_tensor(name)
            assert tuple(t.shape) == shape and t.element_size() == SIZES[dtype], name


@fuzz(40)
@given(st.data())
def test_fuzzed_checkpoint_is_typed_error_or_valid(damaged, data):
    original = {}

    def edit(d):
        original["size"] = len(d)
        cut = data.draw(st.integers(0, len(d)))
        if data.draw(st.booleans()):
            return struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + d[8:cut]
        return d[:cut]
    path = damaged(edit)
    try:
        source = resolve_model(path)
    except WeightsError as e:
        assert "model.safetensors" in str(e) and "\n" not in str(e)
        return
    assert source.kind == "hf"
    assert (weights.Path(path) / "model.safetensors").stat().st_size == original["size"]
