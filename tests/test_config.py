"""ModelConfig from HF config.json dicts, GGUF metadata and presets; bad values are ConfigErrors."""

from __future__ import annotations

import copy

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
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.n_params() == 494032768  # Qwen2.5-0.5B's published parameter count


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
            del raw[key]
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
    (dict(num_hidden_layers=0), "n_layers=0"),
    (dict(num_attention_heads=0, head_dim=None), "n_q_heads=0"),
    (dict(head_dim=63), "head_dim=63"),
    (dict(hidden_act="gelu"), "'gelu'"),
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps=-1\.0"),
])
def test_bad_hf_config_names_value(changes, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(_edited(LLAMA, **changes), name="bad")


def test_mistral_sliding_window_rejected():
    with pytest.raises(ConfigError, match="sliding_window=4096"):
        from_hf_dict(dict(MISTRAL, sliding_window=4096), name="mistral")


def test_unknown_preset_named():
    from paged_decode.compile.weights import resolve_model

    with pytest.raises(ConfigError, match="'gpt-5'"):
        config.preset("gpt-5")
    with pytest.raises(ConfigError, match="'gpt-5'.*HF model directory.*gguf.*preset"):
        resolve_model("gpt-5")


def test_gguf_metadata_errors():
    base = {"general.architecture": "llama", "llama.embedding_length": 64,
            "llama.attention.head_count": 4, "llama.block_count": 2,
            "llama.feed_forward_length": 128, "llama.vocab_size": 256}
    assert config.from_gguf_fields(base, "ok", "x.gguf").tie_word_embeddings
    with pytest.raises(ConfigError, match="'qwen2'"):
        config.from_gguf_fields(dict(base, **{"general.architecture": "qwen2"}), "q", "x.gguf")
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
