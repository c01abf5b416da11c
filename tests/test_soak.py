"""Soak of the batching engine: several threads submit, fork (``submit_n``), cancel before and
in the middle of a stream (a client that disconnects) and cancel everything, against one
BatchEngine whose pool is small enough that the scheduler preempts.  Afterwards every block is
free or held by the prefix cache alone, the allocator's invariants hold, and the engine answers
a greedy request as it did before.  Seeded inputs; bounded by a count of operations (about 20 s
on the tiny model).  A scheduler whose cancel drops one handle unreleased fails it (the leaked
sequence's blocks are named).
"""

from __future__ import annotations

import collections
import random
import threading

import pytest

from paged_decode.runtime.batch_engine import BatchEngine
from paged_decode.runtime.sampling import SamplingParams

from .test_engine_args import OPTS

THREADS, OPS_PER_THREAD = 4, 250
NUM_BLOCKS = 24  # 16 blocks hold one full-length sequence: a few at once make it preempt
PREFIXES = [[(7 * i + j) % 250 + 3 for j in range(9)] for i in range(3)]  # shared by prompts


def check_blocks(engine: BatchEngine) -> None:
    """Every block of the idle engine's pool is free, or held once by the prefix cache alone
    (no sequence holds any); the allocator's own invariants hold."""
    pool, cache = engine.pool, engine.scheduler.cache
    pool.allocator.check_invariants()
    assert pool.owned_blocks() == {}, f"sequences still hold blocks: {pool.owned_blocks()}"
    cached = set(cache._by_hash.values())
    assert cached == cache._cached, (cached, cache._cached)
    held = {b for b in range(pool.num_blocks) if pool.allocator.refcount(b) > 0}
    assert held == cached, f"held by no one: {sorted(held - cached)}"
    assert all(pool.allocator.refcount(b) == 1 for b in cached)
    assert pool.num_free + len(cached) == pool.num_blocks


def _prompt(rng: random.Random) -> list[int]:
    head = rng.choice(PREFIXES) if rng.random() < 0.6 else []
    return head + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))]


def _one_op(engine: BatchEngine, rng: random.Random, tally: collections.Counter) -> None:
    op = rng.choices(["run", "fork", "cancel", "disconnect", "sampled", "cancel_all"],
                     [30, 15, 15, 20, 15, 1])[0]
    tally[op] += 1
    new = rng.randrange(1, 40)
    if op == "fork":
        streams = engine.submit_n(_prompt(rng), rng.randrange(2, 4), max_new_tokens=new)
    elif op == "sampled":
        streams = [engine.submit(_prompt(rng), max_new_tokens=new, sampling=SamplingParams(
            temperature=0.8, top_p=0.9, seed=rng.randrange(1000)))]
    else:
        streams = [engine.submit(_prompt(rng), max_new_tokens=new)]
    if op == "cancel":
        streams[0].cancel()
    elif op == "disconnect":
        for i, _piece in enumerate(streams[0]):
            if i == rng.randrange(1, 4):
                streams[0].cancel()
                break
    elif op == "cancel_all":
        engine.cancel_all()
    for s in streams:
        s.text()  # ends: its whole text, the part before a cancel, or the request's error
        assert s.finish_reason in ("stop", "length", "cancelled"), s.finish_reason


def _soak(engine: BatchEngine, seed: int) -> collections.Counter:
    tally: collections.Counter = collections.Counter()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        try:
            for _ in range(OPS_PER_THREAD):
                _one_op(engine, rng, tally)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker still waits after 120 s"
    if errors:
        raise errors[0]
    return tally


@pytest.fixture
def engine(build):
    prepared = build("tiny", **OPTS)
    with BatchEngine.load(prepared.artifact_dir, prepared.weights_dir,
                          num_blocks=NUM_BLOCKS) as e:
        yield e


def _drained(engine: BatchEngine) -> None:
    """Wait for the engine's thread to have taken every cancel in its inbox."""
    engine.submit([5, 6, 7], max_new_tokens=1).text()  # queued behind them, served after
    assert not engine.scheduler.has_work


def test_soak_leaves_every_block_free_or_cached(engine):
    probe = [3, 1, 4, 1, 5, 9, 2, 6]
    before = _greedy(engine, probe)
    tally = _soak(engine, seed=0)
    _drained(engine)
    check_blocks(engine)
    assert engine.scheduler.preemptions > 0, "the pool never ran short: nothing was preempted"
    assert tally["fork"] and tally["cancel"] and tally["disconnect"], tally
    assert _greedy(engine, probe) == before  # no stale or overwritten KV read back
    check_blocks(engine)


def _greedy(engine: BatchEngine, prompt: list[int]) -> list[int]:
    stream = engine.submit(prompt, max_new_tokens=24)
    stream.text()
    return stream.tokens


def test_the_check_catches_a_leaked_block(engine):
    _greedy(engine, [3, 1, 4, 1, 5, 9, 2, 6])
    check_blocks(engine)
    engine.pool.allocator.allocate(1)  # a block no sequence and no cache holds
    with pytest.raises(AssertionError, match="held by no one"):
        check_blocks(engine)

