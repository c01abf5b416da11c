"""What the docstrings claim about threads: sessions (and generators) over separate pools may run
concurrently over one artifact and one weight pack, and give what sequential runs give."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from paged_decode.runtime.errors import BusyError
from paged_decode.runtime.generate import Generator
from paged_decode.runtime.sampling import SamplingParams
from paged_decode.runtime.session import PagedDecodeSession

from .conftest import make_pool

JOBS = [([1, 2, 3], SamplingParams(temperature=0.8, top_p=0.9, seed=1)),
        ([9, 8, 7, 6, 5, 4], SamplingParams())]
ROUNDS = 3


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", block_size=4, max_context=64)


def _in_threads(fn, args_list):
    """Run ``fn(*args)`` for each args in its own thread, all released at once; results in order."""
    barrier = threading.Barrier(len(args_list))
    results, errors = [None] * len(args_list), []

    def worker(i, args):
        try:
            barrier.wait()
            results[i] = [fn(*args) for _ in range(ROUNDS)]
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return results


def test_generators_on_separate_pools_match_sequential_runs(tiny):
    artifact, weights = tiny

    def generate(prompt, sampling):
        gen = Generator(artifact, weights, make_pool(artifact, 16))
        return gen.generate(prompt, max_new_tokens=40, sampling=sampling)

    sequential = [generate(*job) for job in JOBS]
    concurrent = _in_threads(generate, JOBS)
    for i, rounds in enumerate(concurrent):
        assert rounds == [sequential[i]] * ROUNDS


def test_sessions_on_separate_pools_give_bit_identical_logits(tiny):
    artifact, weights = tiny

    def decode(prompt, _sampling):
        pool = make_pool(artifact, 16)
        session, handle = PagedDecodeSession(artifact, weights, pool), pool.new_sequence()
        logits = [session.prefill(handle, prompt)]
        for step in range(30):
            logits.append(session.realize_token(handle, (7 * step + prompt[0]) % 256))
        return np.stack(logits)

    sequential = [decode(*job) for job in JOBS]
    for i, rounds in enumerate(_in_threads(decode, JOBS)):
        for got in rounds:
            np.testing.assert_array_equal(got, sequential[i])


def test_each_session_has_its_own_vm(tiny):
    artifact, weights = tiny
    a = PagedDecodeSession(artifact, weights, make_pool(artifact, 4))
    b = PagedDecodeSession(artifact, weights, make_pool(artifact, 4))
    assert len({id(artifact.vm), id(a._vm), id(b._vm)}) == 3
    assert a._params is b._params is weights.params  # weights are shared, read-only


def test_one_generator_shared_by_threads_matches_sequential_runs(tiny):
    """Generations on one generator (as an Engine's) from several threads run one at a time:
    each equals its sequential run, and the pool ends with every block free."""
    artifact, weights = tiny
    gen = Generator(artifact, weights, make_pool(artifact, 16))
    sequential = [gen.generate(p, max_new_tokens=40, sampling=s) for p, s in JOBS]
    concurrent = _in_threads(lambda p, s: gen.generate(p, max_new_tokens=40, sampling=s), JOBS)
    for i, rounds in enumerate(concurrent):
        assert rounds == [sequential[i]] * ROUNDS
    assert gen.pool.num_free == gen.pool.num_blocks


def test_a_second_generation_on_the_same_thread_is_a_busy_error(tiny):
    artifact, weights = tiny
    gen = Generator(artifact, weights, make_pool(artifact, 16))
    first = gen.stream([1, 2, 3], max_new_tokens=8)
    head = next(first)
    with pytest.raises(BusyError, match="unfinished generation on this generator"):
        gen.generate([4, 5], max_new_tokens=2)
    assert [head, *first] == gen.generate([1, 2, 3], max_new_tokens=8)
    assert gen.pool.num_free == gen.pool.num_blocks
