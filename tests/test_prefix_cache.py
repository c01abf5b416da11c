"""Prefix caching: a request beginning with cached blocks prefills only the rest and gets the
logits of a cold run; eviction never frees a block a sequence holds (a stateful test over admit,
step, finish, cancel, fork and evict)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_decode.runtime.generate import Generator
from paged_decode.runtime.prefix_cache import PrefixCache, block_hashes
from paged_decode.runtime.scheduler import Scheduler
from paged_decode.runtime.session import PagedDecodeSession

from .conftest import BUCKETS, make_pool

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # two full blocks and one token


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", **OPTS)


def test_block_hashes_chain_over_the_tokens_before():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert len(set(a)) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other first
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 2) == a


def test_a_cached_prefix_gives_the_logits_of_a_cold_run(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 30)
    session = PagedDecodeSession(artifact, weights, pool)
    cache = PrefixCache(pool)
    first = pool.new_sequence()
    session.prefill(first, SYSTEM + [40, 41])
    cache.insert(SYSTEM + [40, 41], first.blocks)
    first.release()
    prompt = SYSTEM + [50, 51, 52]
    blocks = cache.match(prompt)
    assert len(blocks) == 2 and cache.tokens_saved == 8
    warm = pool.adopt(blocks, 8)
    got = session.prefill(warm, prompt[8:])
    cold = pool.new_sequence()
    want = session.prefill(cold, prompt)
    np.testing.assert_array_equal(got, want)
    for _ in range(5):  # and the decode steps after it
        token = int(want.argmax())
        got, want = session.realize_token(warm, token), session.realize_token(cold, token)
        np.testing.assert_array_equal(got, want)


def test_a_shared_system_prompt_is_prefilled_once(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 40)
    sched = Scheduler(artifact, weights, pool)
    prompts = [SYSTEM + [60 + i, 70 + i] for i in range(4)]
    first = sched.add(prompts[0], max_tokens=6)
    while sched.has_work:
        sched.step()
    rest = [sched.add(p, max_tokens=6) for p in prompts[1:]]
    while sched.has_work:
        sched.step()
    assert sched.cache.hits == 3 and sched.cache.tokens_saved == 3 * 8
    gen = Generator(artifact, weights, make_pool(artifact, 20))
    assert [r.tokens for r in [first, *rest]] == [gen.generate(p, max_new_tokens=6)
                                                 for p in prompts]


def test_requests_running_together_share_their_system_prompt(tiny):
    """Blocks are cached as they fill and looked up when a prefill starts: four requests added
    at once prefill the shared prompt once (the first; the others, whose first block it
    writes, wait one step and find it cached), hold its blocks once, and each equals its solo
    run."""
    artifact, weights = tiny
    pool = make_pool(artifact, 40)
    sched = Scheduler(artifact, weights, pool)
    prompts = [SYSTEM + [60 + i, 70 + i] for i in range(4)]
    reqs = [sched.add(p, max_tokens=6) for p in prompts]
    sched.step()
    assert [bool(r.tokens) for r in reqs] == [True, False, False, False]
    assert sched.cache.hits == 0
    sched.step()
    assert sched.cache.hits == 3 and sched.cache.tokens_saved == 3 * 8
    assert len({tuple(r.handle.blocks[:2]) for r in reqs}) == 1  # the same two blocks
    while sched.has_work:
        sched.step()
    gen = Generator(artifact, weights, make_pool(artifact, 20))
    assert [r.tokens for r in reqs] == [gen.generate(p, max_new_tokens=6) for p in prompts]


def test_making_room_for_a_request_keeps_the_prefix_it_begins_with(tiny):
    """A request that needs more blocks than are free evicts other cached blocks, not the
    least recently used prefix it is about to reuse, and counts those blocks as had."""
    artifact, weights = tiny
    pool = make_pool(artifact, 8)
    sched = Scheduler(artifact, weights, pool)
    for prompt in (SYSTEM + [40], [30, 31, 32, 33, 34, 35, 36, 37, 38]):  # older, newer
        sched.add(prompt, max_tokens=2)  # 11 tokens written: two full blocks each
        while sched.has_work:
            sched.step()
    assert len(sched.cache) == 4 and pool.num_free == 4
    prompt = SYSTEM[:8] + [50] * 9  # 17 tokens: 5 blocks with its first token, 3 past the two
    req = sched.add(prompt, max_tokens=3)
    while sched.has_work:
        sched.step()
    assert sched.cache.tokens_saved == 8 and sched.cache.evictions <= 2
    gen = Generator(artifact, weights, make_pool(artifact, 20))
    assert req.tokens == gen.generate(prompt, max_new_tokens=3)


def test_eviction_frees_only_what_the_cache_alone_holds(tiny):
    artifact, weights = tiny
    pool = make_pool(artifact, 12)
    session = PagedDecodeSession(artifact, weights, pool)
    cache = PrefixCache(pool)
    a = pool.new_sequence()
    session.prefill(a, SYSTEM)
    cache.insert(SYSTEM, a.blocks)  # two full blocks, held by a and the cache
    assert cache.evictable == 0 and cache.evict(10) == 0 and len(cache) == 2
    a.release()
    assert cache.evictable == 2 and pool.num_free == 10
    assert cache.evict(1) == 1 and pool.num_free == 11 and len(cache) == 1
    pool.clear()
    assert len(cache) == 0 and cache.evict(5) == 0


class SchedulerMachine(RuleBasedStateMachine):
    """Random admit / step / finish / cancel / fork / evict on a small pool with the cache on.
    After every rule: the allocator's invariants; every block a live sequence or the cache
    holds is allocated (never freed under them); a finished greedy request equals its solo run.
    """

    tiny = None  # (artifact, weights), set by the test

    def __init__(self):
        super().__init__()
        artifact, weights = self.tiny
        self.pool = make_pool(artifact, 16)
        self.sched = Scheduler(artifact, weights, self.pool, max_running=4, prefill_budget=6)
        self.requests = []
        self.gen = Generator(artifact, weights, make_pool(artifact, 20))

    @rule(extra=st.lists(st.integers(2, 40), min_size=1, max_size=6),
          shared=st.integers(0, 9), k=st.integers(1, 8))
    def admit(self, extra, shared, k):
        self.requests.append(self.sched.add(SYSTEM[:shared] + extra, max_tokens=k))

    @rule(n=st.integers(2, 3), k=st.integers(1, 6))
    def fork(self, n, k):
        self.requests += self.sched.add_forks(SYSTEM + [3], n, max_tokens=k)

    @precondition(lambda self: self.sched.has_work)
    @rule(times=st.integers(1, 3))
    def step(self, times):
        for _ in range(times):
            if self.sched.has_work:
                self.sched.step()

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(data=st.data())
    def cancel(self, data):
        live = [r for r in self.requests if not r.finished]
        self.sched.cancel(data.draw(st.sampled_from(live)))

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        self.sched.cache.evict(n)

    @invariant()
    def blocks_are_held_or_free(self):
        alloc = self.pool.allocator
        alloc.check_invariants()
        held = [b for r in self.sched.running for b in r.handle.blocks]
        cached = list(self.sched.cache._by_hash.values())
        assert all(alloc.refcount(b) >= 1 for b in held + cached)
        for b in set(held + cached):
            holders = held.count(b) + cached.count(b)
            assert alloc.refcount(b) == holders, (b, alloc.refcount(b), holders)

    @invariant()
    def finished_requests_equal_their_solo_run(self):
        for r in self.requests:
            if r.finish_reason == "length" and not getattr(r, "_checked", False):
                assert r.tokens == self.gen.generate(r.prompt, max_new_tokens=r.max_tokens)
                r._checked = True

    def teardown(self):
        for r in list(self.requests):
            self.sched.cancel(r)
        self.sched.cache.evict(self.pool.num_blocks)
        assert self.pool.num_free == self.pool.num_blocks


def test_scheduler_with_the_cache_never_frees_a_held_block(tiny):
    SchedulerMachine.tiny = tiny
    run = SchedulerMachine.TestCase
    run.settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()
