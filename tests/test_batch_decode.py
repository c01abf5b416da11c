"""Batched ragged decode: sequences of different lengths joining and leaving at different steps
give, each, the greedy tokens of its solo generation; each bucket's plan is built once; a bad
step changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from paged_decode.runtime.errors import (CapacityError, HandleError, InputError,
                                         PagedDecodeError, TokenIdError)
from paged_decode.runtime.generate import Generator
from paged_decode.runtime.step import BatchDecodeSession

from .conftest import BUCKETS, LOGIT_TOL, QUANT_BATCH_RTOL, make_pool

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)


@pytest.fixture(params=["tiny", "llama", "qwen2"])
def model(request, load):
    """(artifact, weights) of a Llama-shaped preset, a GQA Llama checkpoint and a Qwen2 one
    (attention bias, tied embeddings), built with the default batch buckets."""
    name = request.param
    source = {"tiny": "tiny", "llama": "llama_ckpt", "qwen2": "qwen2_ckpt"}[name]
    if source != "tiny":
        source = request.getfixturevalue(source).path
    return load(source, **OPTS)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return [list(rng.integers(2, vocab, size=1 + (3 * i) % 9)) for i in range(n)]


def _run_batched(artifact, weights, prompts, new_tokens, join_every: int = 1, ready=None):
    """Sequence i joins at step ``i * join_every`` (prefilled alone), decodes its own number of
    tokens in batched steps, and leaves (released) when done.  Returns (tokens, session).
    ``ready()`` is called once the session exists, before the first step."""
    pool = make_pool(artifact, 200)
    session = BatchDecodeSession(artifact, weights, pool)
    if ready is not None:
        ready()
    out = [[] for _ in prompts]
    live: dict[int, object] = {}
    step = 0
    while step == 0 or live:
        for i in range(len(prompts)):
            if i * join_every == step:
                h = pool.new_sequence()
                out[i].append(int(session._single.prefill(h, prompts[i]).argmax()))
                live[i] = h
        active = [i for i in live if len(out[i]) < new_tokens[i]]
        if active:
            logits = session.step([live[i] for i in active], [out[i][-1] for i in active])
            for row, i in enumerate(active):
                out[i].append(int(logits[row].argmax()))
        for i in [i for i in live if len(out[i]) >= new_tokens[i]]:
            live.pop(i).release()
        step += 1
        if step > 4 * len(prompts) + max(new_tokens):  # bounded: every sequence ends
            raise AssertionError("the batched run did not finish")
    assert pool.num_free == pool.num_blocks
    return out, session


def _solo(artifact, weights, prompts, new_tokens):
    gen = Generator(artifact, weights, make_pool(artifact, 20))
    return [gen.generate(p, max_new_tokens=k) for p, k in zip(prompts, new_tokens)]


def test_batched_greedy_equals_each_solo_generation(model, monkeypatch):
    """20 sequences of different prompt lengths, joining a step apart and leaving at their own
    lengths: the live count passes through every bucket up to 16 (17-20 live rows run as 16 +
    the rest: calls fill their buckets on the CPU), and every sequence's greedy tokens equal
    its solo run.  Nothing is compiled or loaded while the batch changes (the module loader,
    VirtualMachine and the compiler counted), and each plan used is built once."""
    artifact, weights = model
    assert artifact.manifest.batch_buckets == BUCKETS
    prompts = _prompts(20, artifact.manifest.vocab_size)
    new_tokens = [40 - i for i in range(20)]
    calls = []

    def count(name, real):
        def counted(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return counted

    def ready():
        for owner, name in ((tvm.runtime, "load_module"), (tvm.relax, "VirtualMachine"),
                            (tvm, "compile"), (tvm.relax, "build")):
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, count(name, getattr(owner, name)))

    batched, session = _run_batched(artifact, weights, prompts, new_tokens, ready=ready)
    assert calls == []
    monkeypatch.undo()
    assert batched == _solo(artifact, weights, prompts, new_tokens)
    counts = session.realize_counts
    assert all(counts[b] > 0 for b in (1, 2, 4, 8, 16)) and counts[32] == 0, counts
    assert session.plan_builds == {1: 1, 2: 1, 4: 1, 8: 1, 16: 1, 32: 0}


def _state(pool, handles):
    return ([(h.length, h.blocks) for h in handles if h.is_live], pool.num_free,
            [np.from_dlpack(t).tobytes() for t in pool.pools])


@pytest.mark.parametrize("bad", ["token", "duplicate", "released", "too_many", "at_capacity",
                                 "mismatched"])
def test_a_rejected_step_changes_no_sequence(bad, load):
    artifact, weights = load("tiny", **OPTS)
    pool = make_pool(artifact, 60)
    session = BatchDecodeSession(artifact, weights, pool)
    handles = [pool.new_sequence() for _ in range(3)]
    for i, h in enumerate(handles):
        session._single.prefill(h, [3 + i] * (4 + i))
    tokens = [5, 6, 7]
    error: type[PagedDecodeError] = InputError
    if bad == "token":
        tokens[1], error = artifact.manifest.vocab_size, TokenIdError
    elif bad == "duplicate":
        handles[2], error = handles[0], HandleError
    elif bad == "released":
        gone = pool.new_sequence()
        gone.release()
        handles[1], error = gone, HandleError
    elif bad == "too_many":
        handles = [pool.new_sequence() for _ in range(33)]
        tokens = [1] * 33
    elif bad == "at_capacity":
        session._single.prefill(handles[2], [1] * (artifact.max_tokens - handles[2].length))
        error = CapacityError
    else:
        tokens = tokens[:2]
    before = _state(pool, handles)
    with pytest.raises(error):
        session.step(handles, tokens)
    assert _state(pool, handles) == before
    pool.allocator.check_invariants()


Q4_0_BUCKETS = (4, 8)


# the tiny preset's float16 rows are bit-identical to decode's (tests/test_batch_invariance.py)
@pytest.mark.parametrize("source,dtype,rows", [
    ("tiny", "q4_0", 8), ("tiny", "q4_0", 4),
    ("llama_ckpt", "float16", 16), ("qwen2_ckpt", "float16", 4)])
def test_batched_logits_track_solo_ones(load, request, source, dtype, rows):
    """Half-precision weights and cache, or Q4_0 weights: each row of a batched step against the
    same sequence decoded alone (B = 1, its own pool), fed the same tokens, within the float16
    tolerance, or, Q4_0, QUANT_BATCH_RTOL of the largest logit (a bound: quantized rows are
    bit-identical to decode's, tests/test_batch_invariance.py).  float16 on the Llama and Qwen2 (bias, tied) checkpoints too: six rows in a 16-row
    bucket (the matmul tiles), four in a 4-row one (the small-batch GEMVs)."""
    opts = (dict(weight_dtype="float16", cache_dtype="float16") if dtype == "float16"
            else dict(weight_dtype=dtype))
    if source != "tiny":
        source = request.getfixturevalue(source).path
    # one bucket is enough here (float16 runs the small-batch GEMVs or the matmul tiles, Q4_0
    # the int8 tiles); the default set is built and checked in float32 above.  The Q4_0 cases
    # share one build holding both of their buckets.
    buckets = Q4_0_BUCKETS if dtype == "q4_0" else (rows,)
    artifact, weights = load(source, **opts, **dict(OPTS, batch_buckets=buckets))
    vocab = artifact.manifest.vocab_size
    live = min(rows, 6)
    prompts = _prompts(live, vocab)
    fed = np.random.default_rng(7).integers(2, vocab, size=(live, 5)).tolist()
    solo_session = BatchDecodeSession(artifact, weights, make_pool(artifact, 60))._single
    want = []
    for prompt, tokens in zip(prompts, fed):
        h = solo_session.pool.new_sequence()
        solo_session.prefill(h, prompt)
        want.append([np.array(solo_session.realize_token(h, t)) for t in tokens])
        h.release()
    pool = make_pool(artifact, 60)
    session = BatchDecodeSession(artifact, weights, pool)
    handles = [pool.new_sequence() for _ in prompts]
    for h, prompt in zip(handles, prompts):
        session._single.prefill(h, prompt)
    for step in range(5):
        logits = session.step(handles, [tokens[step] for tokens in fed])
        for row in range(live):
            tol = (LOGIT_TOL["float16"] if dtype == "float16"
                   else QUANT_BATCH_RTOL * np.abs(want[row][step]).max())
            np.testing.assert_allclose(logits[row], want[row][step], atol=tol, rtol=0)
    assert session.realize_counts[rows] == 5  # every step ran the one bucket
