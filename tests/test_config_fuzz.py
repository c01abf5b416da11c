"""Fuzzed configs: a mutated config.json (as a dict or as raw bytes) or GGUF metadata is a
ConfigError or a valid ModelConfig whose fields are the file's values exactly, never another
exception and never a silent coercion ("false" read as true, 96.7 read as 96)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_decode.compile import config
from paged_decode.compile.config import ModelConfig, from_hf_dict
from paged_decode.compile.rope import rope_inv_freq
from paged_decode.runtime.errors import ConfigError

from .test_config import GGUF_BASE, LLAMA, MISTRAL, QWEN2, SMALL_QWEN2

BASES = [LLAMA, MISTRAL, QWEN2, SMALL_QWEN2,  # and Llama in transformers 5 spelling:
         dict(LLAMA, rope_parameters=dict(LLAMA["rope_scaling"], rope_theta=5e5),
              rope_scaling=None)]
HF_KEYS = sorted({k for b in BASES for k in b} | {
    "head_dim", "num_key_value_heads", "attention_bias", "mlp_bias", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor",
    "quantization_config", "rope_parameters", "rope_scaling", "hidden_act", "tie_word_embeddings"})
ROPE_KEYS = ["rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "rope_theta", "partial_rotary_factor"]
DELETE = "<delete>"

# Values of every JSON kind, plus near-valid ones that sit on the rules' edges.
EDGES = st.sampled_from([0, 1, -1, 2, 3, 7, 8, 64, 96.7, 2048.0, 4096, 2**31 - 1, 2**31, 2**64,
                         10**400, 1e-6, 0.0, -0.0, 0.5, 1.0, 4.0, 1e308, math.inf, -math.inf,
                         math.nan, True, False, None, "", "false", "true", "8", "silu", "gelu",
                         "llama3", "default", "linear", "yarn", "full_attention",
                         "sliding_attention", ["sliding_attention"] * 4, ["LlamaForCausalLM"],
                         ["Qwen2ForCausalLM"], {}, [], DELETE])
SCALARS = (st.none() | st.booleans() | st.integers() | st.text(max_size=6)
           | st.floats(allow_nan=True, allow_infinity=True))
VALUES = EDGES | st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                              | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                              max_leaves=5)


def _apply(raw: dict, key: str, value) -> None:
    if value == DELETE and isinstance(value, str):
        raw.pop(key, None)
    else:
        raw[key] = value


@st.composite
def mutated_configs(draw) -> dict:
    raw = copy.deepcopy(draw(st.sampled_from(BASES)))
    for key, value in draw(st.lists(st.tuples(st.sampled_from(HF_KEYS), VALUES), max_size=4)):
        _apply(raw, key, value)
    rope_key = draw(st.sampled_from(["rope_scaling", "rope_parameters"]))
    if isinstance(raw.get(rope_key), dict):
        for key, value in draw(st.lists(st.tuples(st.sampled_from(ROPE_KEYS), VALUES),
                                        max_size=2)):
            _apply(raw[rope_key], key, value)
    return raw


# config.json key -> ModelConfig field, for the sizes read as they are
EXACT_INTS = {"hidden_size": "hidden_size", "num_hidden_layers": "n_layers",
              "num_attention_heads": "n_q_heads", "intermediate_size": "intermediate_size",
              "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings"}


def assert_valid(cfg: ModelConfig, raw: dict) -> None:
    """A config that was accepted holds exactly the file's values, and its math is finite."""
    assert ModelConfig(**cfg.__dict__) == cfg  # passes its own checks again
    for key, field in EXACT_INTS.items():
        if key in raw:
            assert type(raw[key]) is int and raw[key] == getattr(cfg, field), key
    for key, field in (("num_key_value_heads", "n_kv_heads"), ("head_dim", "head_dim")):
        if raw.get(key) is not None:
            assert type(raw[key]) is int and raw[key] == getattr(cfg, field), key
    if "tie_word_embeddings" in raw:
        assert raw["tie_word_embeddings"] is cfg.tie_word_embeddings
    if "rms_norm_eps" in raw:
        assert type(raw["rms_norm_eps"]) in (int, float)
        assert np.float32(raw["rms_norm_eps"]) == cfg.rms_norm_eps
    if raw.get("quantization_config") is not None:
        raise AssertionError("a quantized checkpoint was accepted")
    json.dumps(cfg.shape_dict())
    assert cfg.n_params() > 0
    with np.errstate(all="ignore"):
        assert np.isfinite(rope_inv_freq(cfg)).all()


def check_hf(raw) -> None:
    try:
        cfg = from_hf_dict(raw, name="fuzz")
    except ConfigError:
        return
    assert_valid(cfg, raw)


@settings(max_examples=400, deadline=None)
@given(mutated_configs())
def test_mutated_config_dict_is_config_error_or_valid(raw):
    check_hf(raw)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(HF_KEYS), VALUES, max_size=12))
def test_random_config_dict_is_config_error_or_valid(raw):
    check_hf(raw)


@st.composite
def damaged_json_bytes(draw) -> bytes:
    """A valid config.json's bytes, truncated, with bytes overwritten or inserted."""
    data = bytearray(json.dumps(draw(st.sampled_from(BASES))).encode())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["cut", "set", "insert"]))
        if edit == "cut":
            del data[at:]
        elif edit == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


JSON_DOCS = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6)
                         | st.floats(), lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.sampled_from(HF_KEYS), inner, max_size=5),
                         max_leaves=10).map(lambda doc: json.dumps(doc).encode())


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damaged_json_bytes() | st.binary(max_size=64) | JSON_DOCS)
def test_config_json_bytes_are_config_error_or_valid(tmp_path, data):
    (tmp_path / "config.json").write_bytes(data)
    try:
        cfg = config.from_hf_dir(tmp_path)
    except ConfigError:
        return
    assert_valid(cfg, json.loads(data))


GGUF_KEYS = sorted(set(GGUF_BASE) | {
    "llama.attention.head_count_kv", "llama.attention.key_length", "llama.attention.value_length",
    "llama.rope.dimension_count", "llama.expert_count", "llama.rope.scaling.type",
    "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.context_length",
    "tokenizer.ggml.tokens", "_has_output_weight", "_has_rope_freqs", "_rope_freqs"})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(GGUF_KEYS), VALUES), max_size=4))
def test_mutated_gguf_metadata_is_config_error_or_valid(changes):
    fields = dict(GGUF_BASE)
    for key, value in changes:
        _apply(fields, key, value)
    try:
        cfg = config.from_gguf_fields(fields, "fuzz", "fuzz.gguf")
    except ConfigError:
        return
    assert_valid(cfg, {})
    for key, field in (("llama.embedding_length", "hidden_size"), ("llama.block_count", "n_layers"),
                       ("llama.attention.head_count", "n_q_heads")):
        assert type(fields[key]) is int and fields[key] == getattr(cfg, field), key
