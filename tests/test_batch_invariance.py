"""Batch invariance: a sequence's logits are bit-identical whether its token runs alone (the
B = 1 ``decode``, fused GEMVs) or as any row of any ``batch_decode_<B>`` (the int8 tiles, the
float small-batch GEMVs and matmul tiles, the batched attention), whatever the other rows hold;
so greedy speculative decoding, which verifies drafted tokens as batch rows, gives exactly the
tokens of decoding without it."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.compile.kernels.cpu import batch, gemv, linear, norm
from paged_decode.runtime.runner import Row, StepRunner

from .conftest import SMOL_OPTS, TINY_LONG, make_pool
from .test_kernels import _compiled, _t

# 16-token blocks and 640 positions: the tiny preset's attention (4 heads x 16 dims) splits a
# context of 512 positions or more among parallel parts (attention.PARALLEL_MIN_WORK), so
# both of the decode kernel's ways are compared
OPTS = TINY_LONG
LONG, SHORT = 600, 20
# q4_1: rows interleaved by 8 with an offset term and an LM head by rows; q8_0: interleaved
# rows without an offset and an interleaved head taking int16 activations; the float formats:
# small buckets in the small-batch GEMVs, the others in the matmul tiles (kernels.cpu.float_dot)
FORMATS = ["q4_1", "q8_0", "float32", "float16", "bfloat16"]


def _runner(load, fmt: str) -> StepRunner:
    artifact, weights = load("tiny", weight_dtype=fmt, **OPTS)
    return StepRunner(artifact, weights, make_pool(artifact, 160))


def _prefilled(runner, ids) -> object:
    handle = runner.pool.new_sequence()
    runner.single.prefill(handle, list(ids))
    return handle


def _among_others(runner, handle, token: int, others: int, rng) -> np.ndarray:
    """The logits of ``token`` on ``handle`` as one row among ``others`` other sequences'
    rows (random tokens; one long context, the rest short ones), at a random place; nothing is
    kept."""
    vocab, length = runner.artifact.manifest.vocab_size, handle.length
    lengths = [LONG - 7] + [int(n) for n in rng.integers(1, 60, others - 1)]
    seqs = [_prefilled(runner, rng.integers(0, vocab, n)) for n in lengths]
    rows = [Row(s, [int(rng.integers(0, vocab))]) for s in seqs]
    place = int(rng.integers(0, others + 1))
    rows.insert(place, Row(handle, [token]))
    try:
        return runner.run(rows)[place][0]
    finally:
        handle.truncate_to(length)
        for s in seqs:
            s.release()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_logits_do_not_depend_on_the_batch(load, fmt):
    """Alone vs among 1-31 others in every bucket (padding rows included), for a context the
    attention walks in one part and one it splits."""
    runner = _runner(load, fmt)
    rng = np.random.default_rng(0)
    vocab = runner.artifact.manifest.vocab_size
    for length in (SHORT, LONG):
        handle = _prefilled(runner, rng.integers(0, vocab, length))
        alone = runner.run([Row(handle, [7])])[0][0]
        handle.truncate_to(length)
        for others in (1, 3, 5, 12, 31):  # buckets 2, 4, 8, 16, 32
            got = _among_others(runner, handle, 7, others, rng)
            assert np.array_equal(got, alone), (
                f"{fmt}: context {length}, among {others} others: max |diff| "
                f"{np.abs(got - alone).max()}")
        handle.release()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_verified_rows_logits_are_the_decode_steps(load, fmt):
    """A row of k tokens of one sequence (a verification) gives, at each position, exactly the
    logits of decoding those tokens one at a time."""
    runner = _runner(load, fmt)
    rng = np.random.default_rng(1)
    vocab = runner.artifact.manifest.vocab_size
    prompt = rng.integers(0, vocab, 40).tolist()
    tokens = rng.integers(0, vocab, 6).tolist()
    handle = _prefilled(runner, prompt)
    steps = [runner.run([Row(handle, [t])])[0][0] for t in tokens]
    handle.truncate_to(len(prompt))
    verified = runner.run([Row(handle, tokens, all_logits=True)])[0]
    for i, (a, b) in enumerate(zip(steps, verified)):
        assert np.array_equal(a, b), f"{fmt}: position {i}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.slow
def test_greedy_speculation_on_smollm2_gives_the_tokens_of_plain_decoding(build, load,
                                                                         smollm_gguf):
    """A code edit and a rewrite on the SmolLM2 GGUF's own blocks, where prompt lookup drafts
    tokens: greedy output with speculation is token for token the output without (while batch
    rows summed in other orders than the B = 1 step, both prompts' outputs changed, at their
    4th and 38th token)."""
    import inspect

    from paged_decode.runtime import block_allocator, scheduler
    from paged_decode.runtime.scheduler import Scheduler
    from paged_decode.runtime.speculative import SpeculativeConfig
    from paged_decode.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(build(str(smollm_gguf), **SMOL_OPTS).weights_dir)
    artifact, weights = load(str(smollm_gguf), **SMOL_OPTS)
    prompts = ["Rename the class BlockAllocator to BlockPool in this Python code and return "
               f"the whole file.\n\n```python\n{inspect.getsource(block_allocator)[:1200]}\n```",
               "Rewrite the following text in plain words, keeping every point in the same "
               f"order.\n\n{inspect.getdoc(scheduler)[:1600]}"]

    def run(ids, speculative):
        sched = Scheduler(artifact, weights, make_pool(artifact, 64), speculative=speculative)
        req = sched.add(ids, max_tokens=48)
        while sched.has_work:
            sched.step()
        return req.tokens, sched

    for prompt in prompts:
        ids = tokenizer.encode_prompt(prompt, True)
        plain, _ = run(ids, None)
        spec, sched = run(ids, SpeculativeConfig())
        assert sched.drafted_tokens > 0  # it did verify drafts (how many: by measured costs)
        assert spec == plain


def _weights(rng, rows: int, K: int, wdt: str) -> np.ndarray:
    """A (rows, K) matrix as the kernels take it (bfloat16: its bytes, (rows, 2K) uint8)."""
    import ml_dtypes

    w = rng.standard_normal((rows, K)).astype(np.float32)
    if wdt == "bfloat16":
        return w.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(rows, 2 * K)
    return w.astype(wdt)


def _call(fn, *arrays, shape):
    out = _t(np.zeros(shape, np.float32))
    fn(*map(_t, arrays), out)
    return out.numpy()


# K = 100: full 16-lane blocks and a partial one; 42 rows: a matmul tile of 2 weight rows;
# K = 4200: the float16 GEMV's float16 x, the float32 GEMV's row pairs
FLOAT_SHAPES = [("float32", 42, 100), ("float16", 42, 100), ("bfloat16", 42, 100),
                ("float16", 16, 4200), ("float32", 16, 4200)]


@pytest.mark.parametrize("wdt,N,K", FLOAT_SHAPES)
def test_float_kernels_sum_a_row_in_the_gemvs_order(wdt, N, K):
    """Over float weights the small-batch GEMVs and the matmul tiles (both targets' tiles)
    give each row exactly the B = 1 GEMV's result (``kernels.cpu.float_dot``)."""
    rng = np.random.default_rng(2)
    w = _weights(rng, N, K, wdt)
    x = rng.standard_normal((8, K)).astype(np.float32)
    res = rng.standard_normal((8, N)).astype(np.float32)
    one = _compiled(gemv.gemv, N, K, wdt, "residual")
    alone = np.concatenate([_call(one, x[i:i + 1], w, res[i:i + 1], shape=(1, N))
                            for i in range(8)])
    for B in (3, batch.SMALL_ROWS):
        got = _call(_compiled(batch.gemv_rows, N, K, wdt, "residual", B), x[:B], w, res[:B],
                    shape=(B, N))
        assert np.array_equal(got, alone[:B]), f"small-batch GEMV, B = {B}"
    for tile in (linear.TILES[True]["linear"], linear.TILES[False]["linear"]):
        got = _call(_compiled(linear.linear, N, K, wdt, "residual", tile), x, w, res,
                    shape=(8, N))
        assert np.array_equal(got, alone), f"matmul tile {tile}"


@pytest.mark.parametrize("wdt", ["float32", "float16", "bfloat16"])
def test_float_swiglu_kernels_sum_a_row_in_the_gemvs_order(wdt):
    """The SwiGLU GEMV (its fused norm) against the RMSNorm kernel and the batched SwiGLU
    kernels, row by row, bit for bit."""
    rng = np.random.default_rng(3)
    inter, K = 40, 100
    w = _weights(rng, 2 * inter, K, wdt)
    x = rng.standard_normal((8, K)).astype(np.float32)
    g = rng.standard_normal(K).astype(np.float32)
    one = _compiled(gemv.gemv_swiglu, inter, K, wdt, 1e-5)
    alone = np.concatenate([_call(one, x[i:i + 1], g, w, shape=(1, inter)) for i in range(8)])
    xn = _call(_compiled(norm.rmsnorm, K, 1e-5, None), x, g, shape=(8, K))
    for B in (3, batch.SMALL_ROWS):
        got = _call(_compiled(batch.gemv_rows_swiglu, inter, K, wdt, B), xn[:B], w,
                    shape=(B, inter))
        assert np.array_equal(got, alone[:B]), f"small-batch SwiGLU GEMV, B = {B}"
    got = _call(_compiled(linear.linear_swiglu, inter, K, wdt), xn, w, shape=(8, inter))
    assert np.array_equal(got, alone), "SwiGLU matmul tile"
