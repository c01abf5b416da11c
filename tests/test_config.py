"""ModelConfig from HF config.json dicts, GGUF metadata and presets; bad values are ConfigErrors."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from paged_decode.compile import config
from paged_decode.compile.config import ModelConfig, RopeScaling, from_hf_dict
from paged_decode.runtime.errors import ConfigError, PagedDecodeError

LLAMA = {  # Llama-3.2-1B's shape (transformers 4.x spelling: top-level rope_theta / rope_scaling)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "hidden_act": "silu", "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
}
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 14336, "vocab_size": 32768, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "sliding_window": None, "rms_norm_eps": 1e-5,
}
QWEN2 = {  # transformers 5.x spelling: rope_theta inside rope_parameters
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "max_position_embeddings": 32768, "sliding_window": None, "use_sliding_window": False,
}

QWEN3 = {  # Qwen3-0.6B's shape: head_dim 128 != hidden / heads
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 3072, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "rope_theta": 1000000, "max_position_embeddings": 40960,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 28,
}


def test_llama_gqa_llama3_rope_tied():
    cfg = from_hf_dict(LLAMA, name="llama-3.2-1b")
    assert (cfg.arch, cfg.n_layers, cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim) == (
        "llama", 16, 32, 8, 64)
    assert (cfg.q_size, cfg.kv_size, cfg.qkv_size) == (2048, 512, 3072)
    assert cfg.rope_theta == 500000.0 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert cfg.max_position_embeddings == 131072


def test_llama3_rope_in_transformers5_rope_parameters():
    raw = copy.deepcopy(LLAMA)
    del raw["rope_theta"]
    raw["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=500000.0)
    cfg = from_hf_dict(raw, name="llama")
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_mistral_explicit_head_dim():
    cfg = from_hf_dict(MISTRAL, name="mistral")
    # head_dim 128 = 4096 / 32 here; the explicit value wins when it differs:
    assert (cfg.arch, cfg.head_dim, cfg.q_size, cfg.rope_theta) == ("mistral", 128, 4096, 1e6)
    cfg = from_hf_dict(dict(MISTRAL, head_dim=96), name="mistral")
    assert (cfg.head_dim, cfg.q_size, cfg.hidden_size) == (96, 3072, 4096)
    assert not cfg.tie_word_embeddings and cfg.rope_scaling is None


def test_qwen2_bias_and_rope_parameters():
    cfg = from_hf_dict(QWEN2, name="qwen2")
    assert (cfg.arch, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen2", True, True)
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta) == (14, 2, 64, 1e6)
    assert cfg.rms_norm_eps == np.float32(1e-6)  # as the kernels take it (one key with the GGUF)
    assert cfg.n_params() == 494032768  # Qwen2.5-0.5B's published parameter count


def test_qwen3_qk_norm_and_explicit_head_dim():
    """Qwen3: q/k norms, no biases, head_dim from the config; the parameter count is
    transformers' own model's (built on the meta device)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = from_hf_dict(QWEN3, name="qwen3")
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias) == ("qwen3", True, False)
    assert (cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.rope_theta) == (128, 2048, 1024, 1e6)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in QWEN3.items()
                                                if k != "architectures"}))
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    with pytest.raises(ConfigError, match="attention_bias=true is not supported for Qwen3"):
        from_hf_dict(dict(QWEN3, attention_bias=True), name="qwen3")
    assert not any(f.qk_norm for f in (from_hf_dict(LLAMA, name="l"),
                                       from_hf_dict(QWEN2, name="q")))


def test_smollm2_gguf(smollm_gguf):
    from paged_decode.compile.weights import gguf_fields

    fields = gguf_fields(smollm_gguf)
    cfg = config.from_gguf_fields(fields, name="smollm2", source=str(smollm_gguf))
    assert (cfg.n_layers, cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert cfg.tie_word_embeddings and fields["_has_output_weight"] is False
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    shape = config.preset("smollm2-135m-shape")
    assert cfg.shape_dict() == dict(shape.shape_dict(), rms_norm_eps=cfg.rms_norm_eps)


def test_presets_exact_match():
    assert config.preset("tiny").name == "tiny"
    with pytest.raises(ConfigError, match="'Tiny'"):
        config.preset("Tiny")


_DELETE = object()


def _edited(base: dict, **changes) -> dict:
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(architectures=None), r"architectures=\[\]"),
    (dict(num_attention_heads=32, num_key_value_heads=6), "n_q_heads=32 .* n_kv_heads=6"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'low_freq_factor'"),
    (dict(hidden_size=_DELETE), "'hidden_size'"),
    (dict(vocab_size=_DELETE), "'vocab_size'"),
    (dict(intermediate_size=-5), "intermediate_size=-5"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0"),
    (dict(num_attention_heads=0, head_dim=None), "num_attention_heads=0"),
    (dict(head_dim=63), "head_dim=63"),
    (dict(hidden_act="gelu"), "'gelu'"),
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps=-1\.0"),
])
def test_bad_hf_config_names_value(changes, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(_edited(LLAMA, **changes), name="bad")


def test_mistral_sliding_window_is_read():
    cfg = from_hf_dict(dict(MISTRAL, sliding_window=4096), name="mistral")
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, tuple(range(cfg.n_layers)))


def test_window_of_no_positions_refused():
    """A window of 0 masks every key in transformers: refused, not run as full attention."""
    with pytest.raises(ConfigError, match=r"sliding_window=0: a window of 0 positions"):
        from_hf_dict(dict(MISTRAL, sliding_window=0), name="mistral")


def test_unknown_preset_named():
    from paged_decode.compile.weights import resolve_model

    with pytest.raises(ConfigError, match="'gpt-5'"):
        config.preset("gpt-5")
    with pytest.raises(ConfigError, match="'gpt-5'.*HF model directory.*gguf.*preset"):
        resolve_model("gpt-5")


def test_gguf_rope_freqs_are_llama3_factors():
    """A llama file's rope_freqs tensor (llama.cpp's form of llama3 scaling) divides each RoPE
    frequency: the config carries the factors and the RoPE table is the scaled one."""
    from paged_decode.compile.rope import rope_inv_freq

    factors = [1.0, 2.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    fields = dict(GGUF_BASE, _has_rope_freqs=True, _rope_freqs=factors)
    cfg = config.from_gguf_fields(fields, "l3", "x.gguf")
    assert cfg.rope_freq_factors == tuple(factors) and cfg.rope_scaling is None
    plain = config.from_gguf_fields(GGUF_BASE, "l", "x.gguf")
    assert (rope_inv_freq(plain) / rope_inv_freq(cfg)).tolist() == factors
    with pytest.raises(ConfigError, match="both set"):
        ModelConfig(**dict(cfg.__dict__, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)))


def test_gguf_metadata_errors():
    base = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.block_count": 2,
            "llama.feed_forward_length": 128, "llama.vocab_size": 256}
    assert config.from_gguf_fields(base, "ok", "x.gguf").tie_word_embeddings
    with pytest.raises(ConfigError, match="'mamba' is not supported"):
        config.from_gguf_fields(dict(base, **{"general.architecture": "mamba"}), "g", "x.gguf")
    gemma = {k.replace("llama.", "gemma3."): v for k, v in base.items()}
    with pytest.raises(ConfigError, match="gemma3.attention.sliding_window is missing"):
        config.from_gguf_fields(dict(gemma, **{"general.architecture": "gemma3"}), "g", "x.gguf")
    with pytest.raises(ConfigError, match="llama.block_count"):
        config.from_gguf_fields({k: v for k, v in base.items() if k != "llama.block_count"},
                                "b", "x.gguf")
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        config.from_gguf_fields(dict(base, **{"llama.attention.head_count_kv": 3}), "k", "x.gguf")


def test_model_config_is_frozen_and_validates():
    cfg = config.preset("tiny")
    with pytest.raises(AttributeError):
        cfg.n_layers = 3
    with pytest.raises(ConfigError, match="arch='gpt2'"):
        ModelConfig(**dict(cfg.__dict__, arch="gpt2"))


def test_a_context_beyond_the_trained_positions_warns():
    from paged_decode.compile.api import context_warning
    from paged_decode.compile.build import make_spec

    cfg = config.preset("llama-160m")
    lim = cfg.max_position_embeddings
    spec = lambda **kw: make_spec(cfg, **{"block_size": 16, **kw})  # noqa: E731
    assert context_warning(spec(max_context=lim)) is None
    assert context_warning(spec(max_blocks_cap=lim // 16), by_blocks=True) is None
    msg = context_warning(spec(max_context=lim + 1))  # rounded up to whole blocks
    assert msg.startswith(f"the artifact holds {lim + 16} tokens per sequence ({lim // 16 + 1} "
                          f"blocks of 16), more than llama-160m's max_position_embeddings ({lim})")
    assert msg.endswith(f"--max-context {lim} stays within it")
    # a block size that does not divide the limit: the rounded capacity is what counts
    msg = context_warning(spec(max_context=lim, block_size=48))
    assert msg is not None and msg.endswith(f"--max-context {lim // 48 * 48} stays within it")
    msg = context_warning(spec(max_blocks_cap=lim // 16 + 1), by_blocks=True)
    assert msg.endswith(f"--max-blocks-cap {lim // 16} stays within it")


def test_prepare_warns_before_it_builds(tmp_path, caplog):
    from paged_decode.compile.api import prepare

    lines = []
    with pytest.raises(PagedDecodeError):  # readonly + an empty root: nothing is built
        prepare("tiny", max_context=4160, artifacts=tmp_path, policy="readonly",
                progress=lines.append)
    assert lines[0].startswith("warning: the artifact holds 4160 tokens per sequence")
    assert "tiny's max_position_embeddings (4096)" in lines[0]
    with pytest.raises(PagedDecodeError):  # without a progress callback: the log
        prepare("tiny", max_context=4160, artifacts=tmp_path, policy="readonly")
    assert any("the artifact holds 4160 tokens" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)


def test_prepare_takes_a_resolved_source_without_hashing_again(tmp_path, llama_ckpt,
                                                               monkeypatch):
    from paged_decode.compile import api, weights

    source = weights.resolve_model(str(llama_ckpt.path))
    monkeypatch.setattr(weights, "_sha256_files", lambda paths: pytest.fail("hashed again"))
    with pytest.raises(PagedDecodeError):  # readonly: stops at the missing artifact
        api.prepare(source, max_context=64, artifacts=tmp_path, policy="readonly")


# ------------------------------------------------------------------------------- strict fields

@pytest.mark.parametrize("base, changes, message", [
    # flags are JSON booleans: the string "false" is not false (nor true)
    (LLAMA, dict(tie_word_embeddings="false"), r"tie_word_embeddings='false': must be true or"),
    (LLAMA, dict(tie_word_embeddings=0), r"tie_word_embeddings=0: must be true or false"),
    (LLAMA, dict(tie_word_embeddings=None), r"tie_word_embeddings=None: must be true or false"),
    (QWEN2, dict(use_sliding_window="no"), r"use_sliding_window='no'"),
    # sizes are integers: not strings, null, lists, floats or bools
    (LLAMA, dict(hidden_size="2048"), r"hidden_size='2048': must be an integer, not str"),
    (LLAMA, dict(hidden_size=None), r"hidden_size=None: must be an integer"),
    (LLAMA, dict(hidden_size=[2048]), r"hidden_size=\[2048\]: must be an integer"),
    (LLAMA, dict(hidden_size=96.7), r"hidden_size=96\.7: must be an integer, not a number with"),
    (LLAMA, dict(hidden_size=2048.0), r"hidden_size=2048\.0: must be an integer"),
    (LLAMA, dict(num_hidden_layers=True), r"num_hidden_layers=True: must be an integer, not bool"),
    (LLAMA, dict(vocab_size=2**40), r"vocab_size=1099511627776: must be an integer in \[1, "),
    (LLAMA, dict(num_key_value_heads=0), r"num_key_value_heads=0: must be an integer in \[1,"),
    (LLAMA, dict(num_key_value_heads="8"), r"num_key_value_heads='8'"),
    (LLAMA, dict(head_dim=0), r"head_dim=0: must be an integer in \[1,"),
    (LLAMA, dict(max_position_embeddings=-1), r"max_position_embeddings=-1"),
    # numbers are positive and finite
    (LLAMA, dict(rms_norm_eps="1e-5"), r"rms_norm_eps='1e-5': must be a positive finite number"),
    (LLAMA, dict(rms_norm_eps=None), r"rms_norm_eps=None"),
    (LLAMA, dict(rms_norm_eps=float("nan")), r"rms_norm_eps=nan"),
    (LLAMA, dict(rope_theta=float("inf")), r"rope_theta=inf"),
    (LLAMA, dict(rope_theta=0), r"rope_theta=0"),
    (LLAMA, dict(rope_theta=10**400), r"rope_theta=1000.*: must be a positive finite number"),
    # inverse frequencies 1 / theta^(2i / d) of a base at or below 1 grow (1e-188: inf in float32)
    (LLAMA, dict(rope_theta=1e-188), r"rope_theta=1e-188: RoPE's base must be above 1"),
    (LLAMA, dict(rope_theta=1), r"rope_theta=1(\.0)?: RoPE's base must be above 1"),
    (LLAMA, dict(rope_theta=1e39), r"rope_theta=1e\+39: .*at most 3\.403e\+38 \(float32\)"),
    # rope_scaling, checked per type
    (LLAMA, dict(rope_scaling=[1, 2]), r"rope_scaling=\[1, 2\]: must be an object or null"),
    (LLAMA, dict(rope_scaling="llama3"), r"rope_scaling='llama3': must be an object"),
    (LLAMA, dict(rope_scaling={"rope_type": 3}), r"rope_scaling\.rope_type=3: must be a string"),
    (LLAMA, dict(rope_scaling={"type": "linear", "factor": 2.0}), r"type 'linear' is not supp"),
    (LLAMA, dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"'dynamic'"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], factor=0)),
     r"rope_scaling\.factor=0: must be a positive finite number"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], factor="32")), r"factor='32'"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], low_freq_factor=0.0)),
     r"low_freq_factor=0\.0"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], high_freq_factor=1.0)),
     r"high_freq_factor=1\.0: must be greater than low_freq_factor=1\.0"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], original_max_position_embeddings=8192.5)),
     r"original_max_position_embeddings=8192\.5: must be an integer"),
    (LLAMA, dict(rope_scaling=dict(LLAMA["rope_scaling"], rope_theta="big")),
     r"rope_scaling\.rope_theta='big'"),
    (QWEN2, dict(rope_parameters=dict(QWEN2["rope_parameters"], rope_type="yarn", factor=4.0)),
     r"rope_parameters type 'yarn' is not supported"),
    (QWEN2, dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                  "sliding_attention": {"rope_type": "default"}}),
     r"rope_parameters per layer type is not supported"),
    (LLAMA, dict(partial_rotary_factor=1.5), r"partial_rotary_factor=1\.5: must be in \(0, 1\]"),
    # features the code does not implement are refused, never ignored
    (LLAMA, dict(attention_bias=True), r"attention_bias=true is not supported for Llama"),
    (LLAMA, dict(attention_bias="false"), r"attention_bias='false': must be true or false"),
    (LLAMA, dict(mlp_bias=True), r"mlp_bias=true is not supported"),
    (LLAMA, dict(hidden_act=None), r"hidden_act=None: must be a string"),
    (LLAMA, dict(hidden_act="gelu_pytorch_tanh"), r"'gelu_pytorch_tanh' is not supported"),
    (LLAMA, dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     r"quantization_config \(quant_method='gptq'\) is set"),
    (LLAMA, dict(architectures="LlamaForCausalLM"), r"architectures='LlamaForCausalLM'"),
    (LLAMA, dict(architectures=[{"a": 1}]), r"architectures=\[\{'a': 1\}\]"),
    (MISTRAL, dict(sliding_window="4096"), r"sliding_window='4096': must be an integer"),
    (QWEN2, dict(layer_types=["full_attention"]), r"layer_types=\['full_attention'\]: must be"),
    (QWEN2, dict(max_window_layers=-1), r"max_window_layers=-1"),
])
def test_bad_field_is_a_config_error_naming_it(base, changes, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(_edited(base, **changes), name="bad")


def test_not_an_object_is_a_config_error():
    for raw in ([LLAMA], "config", 3, None):
        with pytest.raises(ConfigError, match="must hold a JSON object"):
            from_hf_dict(raw, name="bad")


@pytest.mark.parametrize("data, message", [
    (b"\xff\xfe{}", r"not UTF-8 text \(byte 0 is 0xff\)"),
    ('{"hidden_size": "caf\u00e9"}'.encode("latin-1"), r"not UTF-8 text \(byte \d+ is 0xe9\)"),
    (b"", r"not valid JSON"),
    (b'{"architectures": ["LlamaForCausalLM"],', r"not valid JSON"),
    (b"[" * 100_000, r"not valid JSON"),
    (b'{"hidden_size": ' + b"1" * 5000 + b"}", r"not valid JSON"),
    (b"[1, 2]", r"must hold a JSON object, got list"),
    (b"null", r"must hold a JSON object, got NoneType"),
])
def test_unreadable_config_json(tmp_path, data, message):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ConfigError, match=message):
        config.from_hf_dir(tmp_path)


def test_defaults_are_transformers_defaults():
    """Fields a config.json leaves out take transformers' per-architecture defaults."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from transformers import Qwen3Config

    for base, hf_cls in ((LLAMA, LlamaConfig), (MISTRAL, MistralConfig), (QWEN2, Qwen2Config),
                         (QWEN3, Qwen3Config)):
        raw = _edited(base, rms_norm_eps=_DELETE, max_position_embeddings=_DELETE,
                      num_key_value_heads=_DELETE, num_attention_heads=8, head_dim=_DELETE)
        if base in (QWEN2, QWEN3):
            raw["num_attention_heads"] = 32  # the Qwen configs' default kv heads are 32
        ref = hf_cls(**{k: v for k, v in raw.items() if k != "architectures"})
        ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // 32
        cfg = from_hf_dict(raw, name="defaults")
        assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.n_kv_heads) == (
            np.float32(ref.rms_norm_eps), ref.max_position_embeddings,
            ref.num_key_value_heads), base
        assert cfg.head_dim == ref_head_dim, base


def test_flags_and_biases_follow_transformers():
    """Qwen2 always has q/k/v biases and Mistral none, whatever attention_bias says (their
    modeling code does not read it); a real JSON false is false."""
    assert from_hf_dict(dict(QWEN2, attention_bias=False), name="q").attention_bias
    assert not from_hf_dict(dict(MISTRAL, attention_bias=True), name="m").attention_bias
    assert not from_hf_dict(dict(LLAMA, tie_word_embeddings=False), name="l").tie_word_embeddings
    assert from_hf_dict(dict(LLAMA, rope_theta=500000), name="l").rope_theta == 500000.0
    assert from_hf_dict(dict(LLAMA, hidden_act="swish"), name="l").hidden_size == 2048


def _hf_window(raw: dict) -> tuple[int | None, tuple[int, ...]]:
    """transformers' own config: (window, the layers that slide), (None, ()) for none."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    hf_cls = {"Qwen2ForCausalLM": Qwen2Config, "Qwen3ForCausalLM": Qwen3Config}.get(
        raw["architectures"][0], MistralConfig)
    ref = hf_cls(**{k: v for k, v in raw.items() if k != "architectures"})
    if ref.sliding_window is None:
        return None, ()
    if hf_cls is MistralConfig:
        return ref.sliding_window, tuple(range(ref.num_hidden_layers))
    layers = tuple(i for i, t in enumerate(ref.layer_types) if t == "sliding_attention")
    return (ref.sliding_window, layers) if layers else (None, ())


def _hf_sliding(raw: dict) -> bool:
    """Whether transformers' own config gives some layer a sliding window."""
    return bool(_hf_window(raw)[1])


SMALL_QWEN2 = dict(QWEN2, num_hidden_layers=4, max_position_embeddings=32768)


@pytest.mark.parametrize("base, changes", [
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=4096, max_window_layers=2)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=_DELETE, max_window_layers=0)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=1024,
                       layer_types=["full_attention", "sliding_attention"] * 2)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=1024, num_hidden_layers=30)),
    (dict(QWEN3, num_hidden_layers=4), dict(use_sliding_window=True, sliding_window=1024,
                                            max_window_layers=2)),
    (MISTRAL, dict(sliding_window=_DELETE)),  # MistralConfig's default window is 4096
    (MISTRAL, dict(sliding_window=1024)),
])
def test_sliding_window_is_read_as_transformers_reads_it(base, changes):
    raw = _edited(base, **changes)
    assert _hf_sliding(raw)  # the reference: transformers runs some layer with a window
    cfg = from_hf_dict(raw, name="sliding")
    assert (cfg.sliding_window, cfg.sliding_layers) == _hf_window(raw)


@pytest.mark.parametrize("base, changes", [
    (SMALL_QWEN2, dict(use_sliding_window=False, sliding_window=4096, max_window_layers=0)),
    (SMALL_QWEN2, dict(use_sliding_window=False, sliding_window=131072, max_window_layers=21,
                       layer_types=["sliding_attention"] * 4)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=4096, max_window_layers=28)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=None, max_window_layers=0)),
    (SMALL_QWEN2, dict(use_sliding_window=True, sliding_window=4096,
                       layer_types=["full_attention"] * 4)),
    (MISTRAL, dict(sliding_window=None)),
])
def test_full_attention_configs_still_load(base, changes):
    """Qwen2 configs often carry a window with use_sliding_window false: full attention."""
    raw = _edited(base, **changes)
    assert not _hf_sliding(raw)
    cfg = from_hf_dict(raw, name="full")
    assert (cfg.n_layers, cfg.sliding_window, cfg.sliding_layers) == (
        raw["num_hidden_layers"], 0, ())


GGUF_BASE = {"general.architecture": "llama", "llama.embedding_length": 64,
             "llama.attention.head_count": 4, "llama.block_count": 2,
             "llama.feed_forward_length": 128, "llama.vocab_size": 256}


@pytest.mark.parametrize("changes, message", [
    ({"llama.embedding_length": 64.5}, r"llama\.embedding_length=64\.5: must be an integer"),
    ({"llama.block_count": "2"}, r"llama\.block_count='2'"),
    ({"llama.attention.head_count": [4, 4]}, r"llama\.attention\.head_count=\[4, 4\]"),
    ({"llama.attention.head_count_kv": 0}, r"llama\.attention\.head_count_kv=0"),
    ({"llama.vocab_size": True}, r"llama\.vocab_size=True"),
    ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, r"layer_norm_rms_epsilon=nan"),
    ({"llama.rope.freq_base": -1.0}, r"llama\.rope\.freq_base=-1\.0"),
    ({"llama.context_length": None}, r"llama\.context_length=None"),
    ({"llama.attention.value_length": 8}, r"value_length=8: a value head size"),
    ({"llama.rope.dimension_count": 7}, r"rope_dim=7: must be 0 .* or an even number"),
    ({"llama.expert_count": 8}, r"llama\.expert_count=8: mixture-of-experts"),
    ({"llama.rope.scaling.type": "yarn"}, r"rope\.scaling\.type='yarn'"),
    ({"_has_rope_freqs": True}, r"rope_freqs tensor holds no values; head_dim 16 needs 8"),
    ({"_has_rope_freqs": True, "_rope_freqs": [1.0] * 7}, r"holds 7 values; head_dim 16 needs 8"),
    ({"_has_rope_freqs": True, "_rope_freqs": [1.0] * 7 + [float("inf")]},
     r"rope_freq_factors=.*: must be 8 positive finite float32 numbers"),
    ({"_has_rope_freqs": True, "_rope_freqs": [1.0] * 7 + [0.0]}, r"rope_freq_factors="),
    ({"general.architecture": ["llama"]}, r"general\.architecture=\['llama'\]"),
    ({"general.architecture": "qwen3moe"}, r"general\.architecture='qwen3moe' is not supp"),
])
def test_bad_gguf_metadata_is_a_config_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        config.from_gguf_fields(dict(GGUF_BASE, **changes), "bad", "x.gguf")


@pytest.mark.parametrize("gguf_arch", ["qwen2", "qwen3"])
def test_gguf_families_read_their_own_keys(gguf_arch):
    """A qwen2 / qwen3 file's keys are under its architecture; the family gives its layer
    features (Qwen2's q/k/v biases, Qwen3's q/k norms); llama's keys are not read."""
    g = gguf_arch
    fields = {"general.architecture": g, f"{g}.embedding_length": 64,
              f"{g}.attention.head_count": 4, f"{g}.attention.head_count_kv": 2,
              f"{g}.attention.key_length": 32, f"{g}.block_count": 3,
              f"{g}.feed_forward_length": 96, f"{g}.rope.freq_base": 1e6,
              f"{g}.context_length": 4096, "tokenizer.ggml.tokens": ["a"] * 300}
    cfg = config.from_gguf_fields(fields, "q", "x.gguf")
    assert (cfg.arch, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        g, 3, 2, 32, 300)
    assert (cfg.attention_bias, cfg.qk_norm) == (g == "qwen2", g == "qwen3")
    assert cfg.rope_theta == 1e6 and cfg.max_position_embeddings == 4096
    with pytest.raises(ConfigError, match=rf"{g}\.rope\.scaling\.type='yarn'"):
        config.from_gguf_fields(dict(fields, **{f"{g}.rope.scaling.type": "yarn"}), "q", "x")
    with pytest.raises(ConfigError, match=r"rope_freqs tensor=True\) is not supported"):
        config.from_gguf_fields(dict(fields, _has_rope_freqs=True, _rope_freqs=[1.0] * 16), "q",
                                "x")
    with pytest.raises(ConfigError, match=rf"{g}\.embedding_length"):
        config.from_gguf_fields(dict(GGUF_BASE, **{"general.architecture": g}), "q", "x.gguf")




def test_config_values_are_exact_types():
    cfg = from_hf_dict(LLAMA, name="l")
    assert all(type(getattr(cfg, f)) is int for f in ("hidden_size", "n_layers", "head_dim"))
    assert type(cfg.rms_norm_eps) is float and type(cfg.tie_word_embeddings) is bool
    with pytest.raises(ConfigError, match="tie_word_embeddings='yes': must be a bool"):
        ModelConfig(**dict(cfg.__dict__, tie_word_embeddings="yes"))
    with pytest.raises(ConfigError, match="rope_theta='1e4'"):
        ModelConfig(**dict(cfg.__dict__, rope_theta="1e4"))
    with pytest.raises(ConfigError, match="rope_scaling.factor=0"):
        RopeScaling(0, 1.0, 4.0, 8192)


def test_values_the_kernels_take_as_float32_make_one_key():
    """config.json's eps 1e-06 and its GGUF's float32 9.99999997e-07, an explicit scale of
    1 / sqrt(head_dim) and the default: the same kernels, so the same key (one compile)."""
    import dataclasses

    hf = from_hf_dict(QWEN2, name="qwen2")
    gguf = dataclasses.replace(hf, rms_norm_eps=float(np.float32(1e-6)),
                               attn_scale=1.0 / 64 ** 0.5)
    assert gguf.shape_dict() == hf.shape_dict()
    assert dataclasses.replace(hf, rms_norm_eps=2e-6).shape_dict() != hf.shape_dict()
    assert dataclasses.replace(hf, attn_scale=0.1).shape_dict() != hf.shape_dict()
