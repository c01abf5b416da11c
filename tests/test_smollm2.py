"""The real model: SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_decode.runtime.generate import Generator
from paged_decode.runtime.session import PagedDecodeSession
from paged_decode.runtime.tokenizer import Tokenizer

from .conftest import LOGIT_TOL, make_pool

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers."]
N_TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(load, build, smollm_gguf):
    prepared = build(str(smollm_gguf), block_size=16, max_context=256)
    artifact, weights = load(str(smollm_gguf), block_size=16, max_context=256)
    return artifact, weights, Tokenizer.from_dir(prepared.weights_dir)


@pytest.fixture(scope="module")
def hf_model(smollm_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name,
                                                dtype=torch.float32).eval()


def _chat_ids(tok, prompt):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]),
                      add_bos=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_match_transformers(smol, hf_model, prompt):
    artifact, weights, tok = smol
    ids = _chat_ids(tok, prompt)
    ours = Generator(artifact, weights, make_pool(artifact, 16)).generate(ids, N_TOKENS)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False)
    theirs = out[0, len(ids):].tolist()
    n = min(len(ours), len(theirs))  # transformers stops at eos, ours yields it and stops too
    assert ours[:n] == theirs[:n], (tok.decode(ours), tok.decode(theirs))
    assert n >= 8


def test_prefill_and_decode_logits_match_transformers(smol, hf_model):
    artifact, weights, tok = smol
    ids = _chat_ids(tok, PROMPTS[0])
    pool = make_pool(artifact, 16)
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    ours = [session.prefill(handle, ids)]
    for t in range(4):
        ours.append(session.realize_token(handle, int(np.argmax(ours[-1]))))
    seq = ids + [int(np.argmax(x)) for x in ours[:-1]]
    with torch.no_grad():
        ref = hf_model(torch.tensor([seq])).logits[0, len(ids) - 1:].numpy()
    # 30 layers of float32 on logits of magnitude ~20: a looser bound than the tiny models'
    for step, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, atol=20 * LOGIT_TOL["float32"], rtol=0,
                                   err_msg=f"step {step}")


def test_answers_in_english(smol):
    artifact, weights, tok = smol
    gen = Generator(artifact, weights, make_pool(artifact, 16))
    text = tok.decode(gen.generate(_chat_ids(tok, PROMPTS[0]), 16, stop_ids=tok.eos_ids),
                      skip_special_tokens=True)
    assert "Paris" in text
