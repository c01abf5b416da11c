"""GGUF files in Q5_0 / Q5_1 run natively: SmolLM2-135M requantized by llama.cpp's own
quantizer, loaded with its blocks as stored, against transformers' float32 dequantization of
the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_decode.runtime.generate import Generator
from paged_decode.runtime.tokenizer import Tokenizer

from .conftest import SMOL_NATIVE_LOGIT_TOL, make_pool

PROMPT = "What is the capital of France?"
N_TOKENS = 16


@pytest.fixture(scope="module", params=["q5_0", "q5_1"])
def smol_q5(request, tmp_path_factory, smollm_gguf, build, load):
    """(kind, GGUF path, artifact, weights, tokenizer): SmolLM2 made ``kind`` by llama.cpp."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the test extra) makes the file")
    from paged_decode.bench import baselines

    kind = request.param
    path = tmp_path_factory.mktemp(kind) / f"smollm2-{kind}.gguf"
    baselines.quantize_gguf(smollm_gguf, path, kind, 2, requantize=True)
    opts = {"block_size": 16, "max_context": 128, "weight_dtype": "auto"}
    prepared = build(str(path), **opts)
    artifact, weights = load(str(path), **opts)
    return kind, path, artifact, weights, Tokenizer.from_dir(prepared.weights_dir)


@pytest.mark.slow
def test_q5_files_run_natively_and_follow_transformers(smol_q5):
    """The layers stay in the file's format (its CPU layout, rows interleaved by 8), and the
    greedy tokens agree with transformers' up to the first near tie, as the native Q4_1
    file's do (test_smollm2), and for at least the first 4.  Measured: Q5_0 all 16; Q5_1 the
    first 10, parting where transformers' own top two are 0.16 apart."""
    from transformers import AutoModelForCausalLM

    kind, path, artifact, weights, tok = smol_q5
    assert artifact.manifest.weight_dtype == f"{kind}x8"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]),
                     add_bos=False)
    ours = Generator(artifact, weights, make_pool(artifact, 8)).generate(ids, N_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids + ours])).logits[0].numpy()[len(ids) - 1:]
    agreed = 0
    for i, token in enumerate(ours):
        best = int(np.argmax(ref[i]))
        if token != best:
            margin = ref[i][best] - ref[i][token]
            assert margin < SMOL_NATIVE_LOGIT_TOL["decode"], (i, tok.decode(ours[:i + 1]), margin)
            break
        agreed += 1
    assert agreed >= 4, (kind, tok.decode(ours))


def _bf16_bits(x: np.ndarray, flush_below: float = 0.0) -> np.ndarray:
    """bfloat16 bit patterns of float32 ``x`` (round to nearest even), as uint8 bytes;
    magnitudes below ``flush_below`` made 0."""
    x = np.where(np.abs(x) < flush_below, np.float32(0), x)
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits.view(np.uint8).reshape(x.shape[0], -1)


def test_q5_bf16_and_f16_tensors_pack_natively(llama_wide_ckpt, tmp_path, caplog):
    """A GGUF mixing Q5_1 (the embedding), Q5_0, F16 and BF16 matrices beside Q8_0 ones loads
    without a dequantization warning: Q5 blocks and BF16 values are the file's bytes (a BF16
    matrix is bfloat16, a weight of 1e5 and one of 1e-7 among them), an F16 matrix its float16
    values.  On a target without bfloat16 kernels (no 8-bit buffers) a BF16 matrix is float16
    where every value is a float16 (none below float16's smallest normal 2^-14) and float32
    (each value exact) where some are not (the 1e5 weight in the up projection, whose gate then
    takes float32 too; in the down projection, the random weights' own values below 2^-14)."""
    import gguf
    from safetensors.numpy import load_file

    from paged_decode.compile.api import write_weight_pack
    from paged_decode.compile.params import gate_up_row
    from paged_decode.compile.weights import resolve_formats, resolve_model

    from .test_weights import write_llama_gguf

    cfg = resolve_model(str(llama_wide_ckpt.path)).config
    state = llama_wide_ckpt.state
    wide_range = state["model.layers.1.mlp.up_proj.weight"].copy()
    wide_range[0, :2] = [1e5, 1e-7]
    raw = {
        "token_embd.weight": ("Q5_1", gguf.quants.quantize(
            state["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q5_1)),
        "blk.0.attn_output.weight": ("Q5_0", gguf.quants.quantize(
            state["model.layers.0.self_attn.o_proj.weight"], gguf.GGMLQuantizationType.Q5_0)),
        "blk.0.ffn_down.weight": ("F16", state["model.layers.0.mlp.down_proj.weight"].astype(
            np.float16).view(np.uint8)),
        "blk.0.ffn_up.weight": ("BF16", _bf16_bits(state["model.layers.0.mlp.up_proj.weight"],
                                                   2.0 ** -14)),
        "blk.0.ffn_gate.weight": ("BF16", _bf16_bits(
            state["model.layers.0.mlp.gate_proj.weight"], 2.0 ** -14)),
        "blk.1.ffn_down.weight": ("BF16", _bf16_bits(state["model.layers.1.mlp.down_proj.weight"])),
        "blk.1.ffn_gate.weight": ("BF16", _bf16_bits(
            state["model.layers.1.mlp.gate_proj.weight"], 2.0 ** -14)),
        "blk.1.ffn_up.weight": ("BF16", _bf16_bits(wide_range, 2.0 ** -14)),
    }
    params = {"token_embd.weight": "embed", "blk.0.attn_output.weight": "layers.0.wo",
              "blk.0.ffn_down.weight": "layers.0.w_down",
              "blk.1.ffn_down.weight": "layers.1.w_down"}
    path = write_llama_gguf(tmp_path / "mixed.gguf", llama_wide_ckpt, cfg,
                            formats=lambda name: "q8_0", raw=raw)
    source = resolve_model(str(path))
    natives = {"embed": "q5_1", "layers.0.wo": "q5_0", "layers.0.w_down": "float16"}
    with caplog.at_level("WARNING"):
        base, others = resolve_formats(source, "auto")
        assert (base, dict(others)) == ("q8_0", {
            **natives, "layers.0.w_gate_up": "bfloat16", "layers.1.w_down": "bfloat16",
            "layers.1.w_gate_up": "bfloat16"})
        assert dict(resolve_formats(source, "auto", no_bytes="no 8-bit buffers")[1]) == {
            **natives, "layers.0.w_gate_up": "float16", "layers.1.w_down": "float32",
            "layers.1.w_gate_up": "float32"}
        out = tmp_path / "pack"
        out.mkdir()
        write_weight_pack(source, base, out, others)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    packed = load_file(str(out / "params.safetensors"))
    for name, param in params.items():
        type_name, stored = raw[name]
        if type_name == "F16":
            assert packed[param].dtype == np.float16, param
            np.testing.assert_array_equal(packed[param], stored.view(np.float16), err_msg=param)
        else:  # Q5 blocks, bfloat16 values: the file's bytes
            np.testing.assert_array_equal(packed[param], stored, err_msg=param)
    I = cfg.intermediate_size
    for layer in (0, 1):
        both = packed[f"layers.{layer}.w_gate_up"]
        assert both.dtype == np.uint8  # 2 bytes a weight
        for up, part in ((False, "gate"), (True, "up")):
            rows = both[[gate_up_row(i, I, up) for i in range(I)]]
            np.testing.assert_array_equal(rows, raw[f"blk.{layer}.ffn_{part}.weight"][1])