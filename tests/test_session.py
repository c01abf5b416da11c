"""Plan-once invariants of PagedDecodeSession and the Generator around it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

from paged_decode.runtime.errors import (HandleError, InputError, OffsetRebindError,
                                         TopologyChanged)
from paged_decode.runtime.generate import Generator
from paged_decode.runtime.session import PagedDecodeSession, validity_key_for

from .conftest import make_pool

BS = 4


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", block_size=BS, max_context=64)


def _block_bytes(pool, blocks):
    return [t.numpy()[list(blocks)].tobytes() for t in pool.pools]


def test_realize_count_and_nothing_recompiles_during_decode(tiny, monkeypatch):
    artifact, weights = tiny
    pool = make_pool(artifact, 20)
    session = PagedDecodeSession(artifact, weights, pool)
    assert session.realize_count == 0
    handle = pool.new_sequence()
    session.prefill(handle, [1, 2, 3])
    pools_before = tuple(pool.pools)
    calls = []
    for name, owner in (("build", relax), ("compile", tvm), ("load_module", tvm.runtime)):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(relax, "VirtualMachine", lambda *a, **k: calls.append("vm"))
    for step in range(1, 11):
        session.realize_token(handle, step)
        assert session.realize_count == step
    assert calls == []
    assert all(a is b for a, b in zip(pools_before, pool.pools))
    assert session._pools is pool.pools and session._params is weights.params


def test_growing_into_new_blocks_keeps_the_session(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 20)
    gen = Generator(artifact, weights, pool)
    tokens = gen.generate([5, 6, 7], max_new_tokens=3 * BS + 2)  # crosses three blocks
    assert len(tokens) == 3 * BS + 2
    assert gen.stats.session_builds == 1 and gen.stats.reprefills == 0
    assert gen.session.realize_count == 3 * BS + 1


def test_validity_key_fields(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    session = PagedDecodeSession(artifact, weights, pool)
    key = dataclasses.astuple(session.key)
    assert session.is_valid_for(*key)
    for i, changed in enumerate([key[0] + 1, key[1] + 1, key[2] * 2, "float16", "other",
                                 key[5] + 1]):
        mutated = list(key)
        mutated[i] = changed
        assert not session.is_valid_for(*mutated), f"field {i} ignored"


def test_new_alloc_id_rebuilds_and_reprefills(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 20)
    gen = Generator(artifact, weights, pool)
    reference = gen.generate([9, 8, 7], max_new_tokens=10)
    stream = gen.stream([9, 8, 7], max_new_tokens=10)
    got = [next(stream) for _ in range(4)]
    old_session = gen.session
    pool.clear()  # mints a new alloc_id: the session and the sequence's blocks are gone
    got += list(stream)
    assert got == reference  # recomputed from the token history
    # stats count this generation: the first session was reused, then rebuilt once
    assert gen.stats.session_builds == 1 and gen.stats.reprefills == 1
    assert gen.session is not old_session
    assert gen.session.key.alloc_id != old_session.key.alloc_id


def test_another_cap_means_another_session(load, tiny):
    artifact, weights = tiny
    # cap 3 (test_padded_and_exact_tables_give_identical_logits's build) against cap 16
    other, other_w = load("tiny", block_size=BS, max_context=12)
    pool = make_pool(artifact, 8)
    session = PagedDecodeSession(artifact, weights, pool)
    assert session.is_valid_for(*dataclasses.astuple(validity_key_for(artifact, weights, pool)))
    assert not session.is_valid_for(*dataclasses.astuple(validity_key_for(other, other_w, pool)))


def test_padded_and_exact_tables_give_identical_logits(load):
    prompt, steps = [4, 5, 6, 7, 8], 6  # 11 tokens = 3 blocks of 4
    results = []
    for ctx in (12, 64):  # cap 3 (exact) and cap 16 (padded)
        artifact, weights = load("tiny", block_size=BS, max_context=ctx)
        pool = make_pool(artifact, 16)
        session = PagedDecodeSession(artifact, weights, pool)
        handle = pool.new_sequence()
        logits = [session.prefill(handle, prompt)]
        for i in range(steps):
            logits.append(session.realize_token(handle, 10 + i))
        results.append(np.stack(logits))
    np.testing.assert_array_equal(results[0], results[1])


def test_decode_leaves_other_sequences_byte_identical(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 20)
    session = PagedDecodeSession(artifact, weights, pool)
    a, b = pool.new_sequence(), pool.new_sequence()
    session.prefill(a, [1, 2, 3, 4, 5])
    session.prefill(b, [6, 7, 8])
    snapshot = _block_bytes(pool, b.blocks)
    for t in range(2 * BS):
        session.realize_token(a, t)
    assert _block_bytes(pool, b.blocks) == snapshot


def test_conflicting_offset_rebind_is_typed_and_harmless(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    session.prefill(handle, [1, 2])
    session.bind_offset(123)
    with pytest.raises(OffsetRebindError, match="123"):
        session.realize_token(handle, 3)
    assert handle.length == 2 and session.realize_count == 0
    session.unbind_offset()
    session.bind_offset(handle.blocks[0] * BS + 2)  # the offset the step will use: no conflict
    session.realize_token(handle, 3)
    assert handle.length == 3 and session.realize_count == 1


def test_cleared_pool_surfaces_topology_changed(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    session.prefill(handle, [1, 2])
    pool.clear()
    with pytest.raises(TopologyChanged, match="drop this session"):
        session.realize_token(pool.new_sequence(), 1)
    fresh = PagedDecodeSession(artifact, weights, pool)
    with pytest.raises(HandleError):
        fresh.realize_token(handle, 1)  # the old sequence died with the old allocation


def test_token_outside_vocab_changes_nothing(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    session = PagedDecodeSession(artifact, weights, pool)
    handle = pool.new_sequence()
    session.prefill(handle, [1, 2, 3, 4])  # exactly one block: the next token needs a new one
    before = (handle.length, handle.blocks, pool.num_free, _block_bytes(pool, range(8)))
    with pytest.raises(InputError, match="outside the vocabulary"):
        session.realize_token(handle, artifact.manifest.vocab_size)
    assert (handle.length, handle.blocks, pool.num_free, _block_bytes(pool, range(8))) == before


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_weight_of_another_shape_or_dtype_is_refused_by_its_kernel(tiny, change):
    """The compiled functions leave the bound weights' checks to the kernels that read them
    (``model._per_call_inputs``): a weight tuple with one wrong tensor still fails, naming the
    kernel and its argument."""
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    names = [p[0] for p in artifact.manifest.params]
    i = names.index("layers.1.w_down")
    w = weights.params[i]
    bad_shape = (w.shape[0], w.shape[1] + 1) if change == "shape" else tuple(w.shape)
    bad_dtype = "float64" if change == "dtype" else w.dtype
    params = list(weights.params)
    params[i] = tvm.runtime.tensor(np.zeros(bad_shape, bad_dtype))
    table = tvm.runtime.tensor(np.zeros((1, artifact.max_blocks_cap), np.int32))
    token = tvm.runtime.tensor(np.ones((1,), np.int32))
    decode = artifact.new_vm()["decode"]
    decode(token, table, 1, 0, tuple(pool.pools), tuple(weights.params))  # the bound ones run
    refused = r"Mismatched W\.\w+ on argument #1 when calling:\s+`gemv_residual_"
    with pytest.raises(Exception, match=refused):
        decode(token, table, 1, 0, tuple(pool.pools), tuple(params))
