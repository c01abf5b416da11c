"""Phi-3 / Phi-4-mini (compile/arch/phi3.py): fused qkv_proj and gate_up_proj, partial RoPE and
longrope's short factors with its attention factor, from the HF folder and from the GGUF that
llama.cpp's converter writes, against transformers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged_decode.compile import config as config_mod
from paged_decode.compile import rope, weights
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime.errors import ConfigError

from . import gguf_files
from .conftest import LOGIT_TOL, _randomize, _save
from .test_runtime_hf import hf_reference, run_ours

PROMPT = [3, 17, 99, 41, 5, 250, 8, 77, 12, 64, 31]  # 11 tokens: crosses blocks of 4
STEPS = 32
ORIGINAL = 64  # original_max_position_embeddings: the test's 43 positions stay within it
SHORT = [1.0, 1.25, 1.875, 2.5, 4.0, 7.5]  # one per frequency of the 12 rotated dimensions
LONG = [2.0, 3.0, 5.0, 9.0, 17.0, 33.0]


@pytest.fixture(scope="session")
def phi3_ckpt(tmp_path_factory):
    """Phi3ForCausalLM, float32: GQA 4/2, head_dim 16 of which 12 rotate (Phi-4-mini's
    partial_rotary_factor 0.75), longrope (max_position_embeddings 64^4, the original 64^1:
    an attention factor of sqrt(1 + ln(64^3) / ln(64)) = 2), MLP of 88 (a last gate / up run
    shorter than 16), untied; the factors and rms_norm_eps 2^-20 are exact in float32, so the
    GGUF has the folder's config (and artifact)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=88, vocab_size=256,
                     rms_norm_eps=2.0**-20, max_position_embeddings=ORIGINAL**4,
                     original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                     rope_scaling={"type": "longrope", "short_factor": SHORT,
                                   "long_factor": LONG},
                     tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)
    model = Phi3ForCausalLM(cfg)
    _randomize(model, seed=6)
    return _save(model, tmp_path_factory, "phi3")


def write_phi3_gguf(path, ckpt, qtype=None):
    """A float32 GGUF of ``ckpt`` as convert_hf_to_gguf's Phi3MiniModel writes it: its metadata
    (rope.dimension_count = int(partial x hidden) / heads, the original context, the sliding
    window 0 for none, the attention factor it computes), ``rope_factors_long`` / ``_short``,
    ``attn_qkv`` and ``ffn_up`` (gate then up) as HF fuses them; a byte-level vocabulary so the
    file loads as a model.  ``qtype``: matrices of whole 32-weight rows quantized to it (gguf's
    quantizer)."""
    import gguf
    from transformers import AutoConfig

    hc = AutoConfig.from_pretrained(ckpt.path)
    rp = hc.rope_parameters
    w = gguf.GGUFWriter(path, "phi3")
    w.add_context_length(hc.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(hc.original_max_position_embeddings)
    w.add_embedding_length(hc.hidden_size)
    w.add_feed_forward_length(hc.intermediate_size)
    w.add_block_count(hc.num_hidden_layers)
    w.add_head_count(hc.num_attention_heads)
    w.add_head_count_kv(hc.num_key_value_heads)
    w.add_layer_norm_rms_eps(hc.rms_norm_eps)
    w.add_rope_dimension_count(int(rp["partial_rotary_factor"] * hc.hidden_size)
                               // hc.num_attention_heads)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(hc.sliding_window or 0)
    if rp.get("long_factor"):
        scale = hc.max_position_embeddings / rp["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rp["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], np.float32))
    gguf_files.byte_vocabulary(w, hc.vocab_size)
    for hf_name, value in ckpt.state.items():
        if hf_name == "lm_head.weight" and hc.tie_word_embeddings:
            continue
        value, name = np.ascontiguousarray(value, np.float32), weights.gguf_name(hf_name, "phi3")
        if qtype is not None and value.ndim == 2 and value.shape[1] % 32 == 0:  # else F32
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    return gguf_files.finish(w, path)


@pytest.fixture(scope="session")
def phi3_window_ckpt(tmp_path_factory):
    """Phi-3-mini-128k / Phi-3.5-mini's layout: RoPE over the whole head with longrope (its
    attention factor 2 then scales every q . k term), a window on every layer (8, shorter
    than the test's 43 positions), GQA 4/2, tied embeddings."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                     rms_norm_eps=2.0**-20, max_position_embeddings=ORIGINAL**4,
                     original_max_position_embeddings=ORIGINAL, sliding_window=8,
                     rope_scaling={"type": "longrope", "short_factor": SHORT + [1.5, 3.0],
                                   "long_factor": LONG + [40.0, 64.0]},
                     tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Phi3ForCausalLM(cfg)
    _randomize(model, seed=7)
    return _save(model, tmp_path_factory, "phi3_window")


@pytest.fixture(scope="session")
def phi3_gguf(tmp_path_factory, request):
    """``phi3_gguf(ckpt fixture name)`` -> its converter GGUF, named as the folder: the equal
    config reuses the folder's artifact."""
    made = {}

    def get(ckpt: str):
        if ckpt not in made:
            saved = request.getfixturevalue(ckpt)
            path = tmp_path_factory.mktemp("phi3_gguf") / f"{saved.path.name}.gguf"
            made[ckpt] = write_phi3_gguf(path, saved)
        return made[ckpt]
    return get


def test_config_reads_partial_rope_and_longrope(phi3_ckpt):
    """rope_dim, the short factors, the attention factor and the original context as
    transformers reads them; the RoPE table's rotated frequencies are transformers'."""
    from transformers import AutoModelForCausalLM

    cfg = resolve_model(str(phi3_ckpt.path)).config
    assert (cfg.arch, cfg.head_dim, cfg.rope_dim, cfg.rope_max_context) == ("phi3", 16, 12, 64)
    assert cfg.rope_freq_factors == tuple(SHORT) and cfg.rope_scaling is None
    hf = AutoModelForCausalLM.from_pretrained(phi3_ckpt.path, dtype=torch.float32).model.rotary_emb
    assert cfg.rope_attn_factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    assert cfg.rope_attn_factor == 2.0
    inv = rope.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv[:6], hf.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert (inv[6:] == 0).all()


def test_whole_head_longrope_scales_the_scores(phi3_window_ckpt):
    """Where RoPE covers the head, longrope's attention factor 2 is the score scale's (2^2 /
    sqrt(16)), leaving Q / K rows as stored."""
    cfg = resolve_model(str(phi3_window_ckpt.path)).config
    assert (cfg.rope_dim, cfg.rope_attn_factor, cfg.attn_scale) == (0, 1.0, 1.0)
    assert cfg.rope_freq_factors == tuple(SHORT + [1.5, 3.0]) and cfg.rope_max_context == 64
    assert rope.qk_row_order(cfg) is None and rope.qk_row_scale(cfg) is None


def test_stored_qk_rows_keep_partial_rope_scores():
    """The stored Q / K rows (rope.qk_row_order / qk_row_scale) rotated as the kernels rotate
    (pair (i, i + head_dim / 2) by frequency i) give transformers' partial-RoPE q . k, scaled
    rotated dimensions included, at every position (numpy, float64)."""
    cfg = config_mod.ModelConfig(name="t", arch="phi3", hidden_size=64, n_layers=1, n_q_heads=4,
                                 n_kv_heads=2, head_dim=16, intermediate_size=32, vocab_size=8,
                                 rope_dim=12, rope_attn_factor=1.3)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal(16), rng.standard_normal(16)
    inv = rope.rope_inv_freq(cfg).astype(np.float64)
    order, scale = rope.qk_row_order(cfg), rope.qk_row_scale(cfg).astype(np.float64)

    def hf_rope(x, pos):  # transformers' apply_rotary_pos_emb over the first 12 dimensions
        rot, rest = x[:12], x[12:]
        f = np.concatenate([inv[:6], inv[:6]]) * pos
        half = np.concatenate([-rot[6:], rot[:6]])
        scaled = (rot * np.cos(f) + half * np.sin(f)) * float(np.float32(1.3))
        return np.concatenate([scaled, rest])

    def kernel_rope(x, pos):  # the RoPE kernels' pairs over the stored rows
        s, c, n = x[order] * scale, np.cos(inv * pos), np.sin(inv * pos)
        return np.concatenate([s[:8] * c - s[8:] * n, s[8:] * c + s[:8] * n])

    for pos in (0, 5, 37):
        for kpos in (0, 3, pos):
            np.testing.assert_allclose(kernel_rope(q, pos) @ kernel_rope(k, kpos),
                                       hf_rope(q, pos) @ hf_rope(k, kpos), rtol=1e-12)


def test_gguf_form_reads_as_the_hf_form(phi3_ckpt, phi3_gguf):
    """The converter's GGUF has the folder's config, and every parameter is equal: the fused
    attn_qkv / ffn_up split and regrouped as the folder's qkv_proj / gate_up_proj."""
    hf, source = resolve_model(str(phi3_ckpt.path)), resolve_model(str(phi3_gguf("phi3_ckpt")))
    assert source.kind == "gguf"
    assert source.config.shape_dict() == hf.config.shape_dict()
    ours, ref = source.load_params("float32"), hf.load_params("float32")
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
    # the gate / up halves of gate_up_proj land in w_gate_up's runs, unscaled
    from paged_decode.compile.params import split_gate_up

    gate, up = split_gate_up(ref["layers.1.w_gate_up"])
    fused = phi3_ckpt.state["model.layers.1.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(gate, fused[:88])
    np.testing.assert_array_equal(up, fused[88:])
    v_rows = phi3_ckpt.state["model.layers.0.self_attn.qkv_proj.weight"][64 + 32:]
    np.testing.assert_array_equal(ref["layers.0.wqkv"][64 + 32:], v_rows)


@pytest.mark.parametrize("form", ["hf", "gguf"])
@pytest.mark.parametrize("ckpt", ["phi3_ckpt", "phi3_window_ckpt"])
def test_generates_as_transformers(request, load, phi3_gguf, ckpt, form):
    """32 greedy tokens from the folder and from its GGUF equal transformers' on the folder,
    logits within LOGIT_TOL at every step: partial RoPE with longrope, and whole-head RoPE with
    longrope and a window of 8 (every layer) over 43 positions."""
    folder = request.getfixturevalue(ckpt).path
    path = folder if form == "hf" else phi3_gguf(ckpt)
    if ckpt == "phi3_window_ckpt":  # GGUF: phi3.attention.sliding_window
        assert resolve_model(str(path)).config.sliding_window == 8
        if form == "hf":
            assert_window_matters(folder, request.getfixturevalue("tmp_path"))
    artifact, weights_ = load(path, block_size=4, max_context=ORIGINAL)
    ours, tokens = run_ours(artifact, weights_, PROMPT, STEPS)
    ref = hf_reference(folder, PROMPT, tokens)
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=LOGIT_TOL["float32"], rtol=0, err_msg=f"step {step}")
    assert tokens == [int(np.argmax(r)) for r in ref[:-1]]


def test_quantized_gguf_keeps_the_fused_blocks(tmp_path, phi3_ckpt, phi3_window_ckpt):
    """A Q8_0 GGUF: the fused attn_qkv / ffn_up blocks are sliced and regrouped byte for byte
    (V, gate, up; Q / K too where RoPE covers the head, the attention factor then in the score
    scale); Q / K rows under partial RoPE's attention factor are the file's values reordered,
    scaled and quantized again."""
    import gguf

    from paged_decode.compile.formats import FORMATS
    from paged_decode.compile.params import interleave_gate_up

    q8 = gguf.GGMLQuantizationType.Q8_0
    for ckpt in (phi3_window_ckpt, phi3_ckpt):
        path = write_phi3_gguf(tmp_path / f"{ckpt.path.name}.q8_0.gguf", ckpt, q8)
        source = resolve_model(str(path))
        down = tuple((f"layers.{i}.w_down", "float32") for i in range(2))  # rows of 88
        params = source.load_params("q8_0", down if ckpt is phi3_ckpt else ())
        qkv = gguf.quants.quantize(ckpt.state["model.layers.1.self_attn.qkv_proj.weight"], q8)
        gate_up = gguf.quants.quantize(ckpt.state["model.layers.1.mlp.gate_up_proj.weight"], q8)
        inter = source.config.intermediate_size
        np.testing.assert_array_equal(params["layers.1.w_gate_up"],
                                      interleave_gate_up(gate_up[:inter], gate_up[inter:]))
        np.testing.assert_array_equal(params["layers.1.wqkv"][96:], qkv[96:])  # V
        qk = params["layers.1.wqkv"][:96]
        if source.config.rope_attn_factor == 1:
            np.testing.assert_array_equal(qk, qkv[:96])
        else:  # the file's values through the RoPE row views, then Q8_0 again
            stored = FORMATS["q8_0"].dequantize(qkv[:96], 64).reshape(6, 16, 64)
            stored = stored[:, rope.qk_row_order(source.config)] * rope.qk_row_scale(
                source.config)[:, None]
            np.testing.assert_array_equal(qk, FORMATS["q8_0"].quantize(
                stored.reshape(96, 64).astype(np.float32)))


def assert_window_matters(folder, tmp_path):
    """transformers' logits with the window differ from the same weights' without it within
    the test's positions (the comparison above would catch a window left out)."""
    import json
    import shutil

    plain = tmp_path / "no_window"
    shutil.copytree(folder, plain)
    cfg = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(dict(cfg, sliding_window=None)))
    tokens = list(range(20, 20 + STEPS))
    a, b = hf_reference(folder, PROMPT, tokens), hf_reference(plain, PROMPT, tokens)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) > 100 * LOGIT_TOL["float32"]


def test_config_without_a_window_key_has_none(phi3_window_ckpt):
    """Phi3Config's sliding_window defaults to None (no window), not the 4096 of Mistral's and
    Qwen's config classes."""
    import json

    from transformers import Phi3Config

    cfg = json.loads((phi3_window_ckpt.path / "config.json").read_text())
    assert config_mod.from_hf_dict(cfg, "w").sliding_window == 8
    cfg.pop("sliding_window")
    assert Phi3Config(**cfg).sliding_window is None
    assert config_mod.from_hf_dict(cfg, "w").sliding_window == 0


def test_fused_tensor_of_other_rows_is_a_weights_error(tmp_path, phi3_ckpt):
    """A config whose heads do not match the fused qkv_proj's rows fails before anything
    builds, naming the fused tensor and both row counts."""
    import json
    import shutil

    from paged_decode.runtime.errors import WeightsError

    folder = shutil.copytree(phi3_ckpt.path, tmp_path / "phi3_kv1")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=1)))
    with pytest.raises(WeightsError, match=r"layers\.0\.self_attn\.qkv_proj\.weight holds 128 "
                                           r"rows, not 96"):
        resolve_model(str(folder))


def test_context_past_the_original_is_refused(phi3_ckpt):
    """Past original_max_position_embeddings transformers and llama.cpp switch to the long
    factors, which are not run: such an artifact is a ConfigError naming the fix, before
    anything builds; the default context stays within it."""
    from paged_decode.compile.api import key_of

    with pytest.raises(ConfigError, match=r"68 tokens .*original_max_position_embeddings "
                                          r"\(64\).*--max-context <= 64"):
        key_of(str(phi3_ckpt.path), target="llvm", block_size=4, max_context=65)
    with pytest.raises(ConfigError, match=r"--max-blocks-cap <= 16"):
        key_of(str(phi3_ckpt.path), target="llvm", block_size=4, max_blocks_cap=17)
    assert key_of(str(phi3_ckpt.path), target="llvm", block_size=4)["key"]["max_blocks_cap"] == 16


@pytest.mark.parametrize("change,match", [
    (dict(partial_rotary_factor=0.7), r"partial_rotary_factor=0.7: must be in \(0, 1\]"),
    (dict(rope_scaling={"type": "longrope", "short_factor": SHORT[:5], "long_factor": LONG}),
     r"rope_scaling.short_factor=.*list of 6 positive numbers"),
    (dict(rope_scaling={"type": "longrope", "short_factor": SHORT}), r"lacks .*'long_factor'"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), r"type 'yarn' is not supported"),
])
def test_bad_rope_fields_are_refused(phi3_ckpt, change, match):
    import json

    cfg = json.loads((phi3_ckpt.path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update({"rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                "partial_rotary_factor": 0.75})
    assert config_mod.from_hf_dict(cfg, "phi3").rope_dim == 12  # the config before the change
    with pytest.raises(ConfigError, match=match):
        config_mod.from_hf_dict({**cfg, **change}, "phi3")
