"""``decode_dev``: decode with context_len / write_off in (1,) int64 tensors (CUDA-graph form).

On llvm it must match ``decode`` bit for bit (same kernel bodies, only the scalars' home differs)
and keep the kernel's checks: an inconsistent write_off raises before anything is written.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from .conftest import make_pool

OPTS = dict(block_size=4, max_context=64)  # cap 16 blocks; the steps below cross blocks
NUM_BLOCKS = 20
PROMPT = [0, 5, 17, 42, 99]
STEPS = 9


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", **OPTS)


def _table(artifact) -> np.ndarray:
    """A scrambled block table: logical block b lives in a non-trivial physical block."""
    cap = artifact.max_blocks_cap
    perm = np.random.default_rng(7).permutation(NUM_BLOCKS)[:cap]
    return perm.astype(np.int32).reshape(1, cap)


def _i64(value: int):
    return tvm.runtime.tensor(np.array([value], dtype=np.int64))


def _pool_bytes(pool) -> list[bytes]:
    return [t.numpy().tobytes() for t in pool.pools]


def _prefill(vm, artifact, weights, pool, table) -> np.ndarray:
    ids = tvm.runtime.tensor(np.array(PROMPT, dtype=np.int32))
    out = vm["prefill"](ids, tvm.runtime.tensor(table), 0, pool.pools, weights.params)
    return out.numpy()


def test_manifest_lists_decode_dev(tiny):
    artifact, _ = tiny
    assert "decode_dev" in artifact.manifest.functions


def test_decode_dev_matches_decode(tiny):
    """Three identical pools after one prefill: A steps through decode, B through decode_dev,
    C alternates; logits and every pool byte stay identical."""
    artifact, weights = tiny
    vm, bs = artifact.new_vm(), artifact.block_size
    table = _table(artifact)
    table_t = tvm.runtime.tensor(table)
    pools = {name: make_pool(artifact, NUM_BLOCKS) for name in "ABC"}
    first = {name: _prefill(vm, artifact, weights, p, table) for name, p in pools.items()}
    assert np.array_equal(first["A"], first["B"]) and np.array_equal(first["A"], first["C"])

    token = int(np.argmax(first["A"][-1]))
    for step in range(STEPS):
        pos = len(PROMPT) + step
        off = int(table[0, pos // bs]) * bs + pos % bs
        tok = tvm.runtime.tensor(np.array([token], dtype=np.int32))
        logits = {}
        for name, pool in pools.items():
            dev = name == "B" or (name == "C" and step % 2 == 0)
            if dev:
                out = vm["decode_dev"](tok, table_t, _i64(pos + 1), _i64(off), pool.pools,
                                       weights.params)
            else:
                out = vm["decode"](tok, table_t, pos + 1, off, pool.pools, weights.params)
            logits[name] = out.numpy()
        assert logits["A"].shape == (1, artifact.manifest.vocab_size)
        assert np.isfinite(logits["A"]).all()
        np.testing.assert_allclose(logits["B"], logits["A"], atol=1e-6, rtol=0)
        np.testing.assert_allclose(logits["C"], logits["A"], atol=1e-6, rtol=0)
        ref = _pool_bytes(pools["A"])
        assert _pool_bytes(pools["B"]) == ref, f"pool B differs after step {step}"
        assert _pool_bytes(pools["C"]) == ref, f"pool C differs after step {step}"
        token = int(np.argmax(logits["A"][-1]))


@pytest.mark.parametrize("bad", ["write_off", "context_len"])
def test_decode_dev_rejects_inconsistent_scalars(tiny, bad):
    """decode_dev asserts like decode: a write_off that does not match the table (or a
    context_len past the cap) raises, and the pool is left untouched."""
    artifact, weights = tiny
    vm, bs, cap = artifact.new_vm(), artifact.block_size, artifact.max_blocks_cap
    table = _table(artifact)
    pool = make_pool(artifact, NUM_BLOCKS)
    _prefill(vm, artifact, weights, pool, table)
    before = _pool_bytes(pool)
    pos = len(PROMPT)
    off = int(table[0, pos // bs]) * bs + pos % bs
    ctx = pos + 1
    if bad == "write_off":
        off, match = off + 1 if pos % bs < bs - 1 else off - 1, "write_off does not match"
    else:
        ctx, match = cap * bs + 1, "context_len outside"
    tok = tvm.runtime.tensor(np.array([3], dtype=np.int32))
    with pytest.raises(Exception, match=match):
        vm["decode_dev"](tok, tvm.runtime.tensor(table), _i64(ctx), _i64(off), pool.pools,
                         weights.params)
    assert _pool_bytes(pool) == before
