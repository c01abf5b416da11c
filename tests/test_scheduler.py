"""Continuous batching: requests added at any step, finishing or cancelled at any step, chunked
prefill, preemption by recompute under a small pool; every request equals its solo run."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from paged_decode.runtime.batch_engine import BatchEngine, RequestStream
from paged_decode.runtime.engine import Engine
from paged_decode.runtime.errors import CapacityError, EngineStoppedError, InputError
from paged_decode.runtime.generate import Generator
from paged_decode.runtime.sampling import SamplingParams
from paged_decode.runtime.scheduler import Scheduler

from .conftest import BUCKETS, make_pool

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", **OPTS)


def _jobs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(list(rng.integers(2, 256, size=1 + (5 * i) % 11)), 3 + (7 * i) % 17)
            for i in range(n)]


def _all_free(sched: Scheduler) -> bool:
    """No block leaked: once the cache lets go of its blocks, every block is free."""
    if sched.cache is not None:
        sched.cache.evict(sched.pool.num_blocks)
    sched.pool.allocator.check_invariants()
    return sched.pool.num_free == sched.pool.num_blocks


def _solo(tiny, jobs):
    gen = Generator(*tiny, make_pool(tiny[0], 20))
    return [gen.generate(p, max_new_tokens=k) for p, k in jobs]


def _drain(sched: Scheduler, arrivals: dict, limit: int = 400) -> dict:
    """Step until no work; ``arrivals``: step -> jobs added before it.  Bounded."""
    reqs = {}
    for step in range(limit):
        for j, (prompt, k) in arrivals.get(step, []):
            reqs[j] = sched.add(prompt, max_tokens=k)
        if not sched.has_work and step > max(arrivals, default=0):
            return reqs
        sched.step()
    raise AssertionError("the scheduler did not finish")


def test_requests_joining_and_leaving_equal_their_solo_runs(tiny):
    jobs = _jobs(12)
    pool = make_pool(tiny[0], 200)
    sched = Scheduler(*tiny, pool)
    arrivals: dict = {}
    for j, step in enumerate((0, 0, 0, 1, 3, 3, 4, 8, 9, 9, 15, 20)):
        arrivals.setdefault(step, []).append((j, jobs[j]))
    reqs = _drain(sched, arrivals)
    assert [reqs[j].tokens for j in range(12)] == _solo(tiny, jobs)
    assert all(reqs[j].finish_reason == "length" for j in range(12))
    assert _all_free(sched)
    assert all(c <= 1 for c in sched.runner.plan_builds.values())


def test_preemption_under_a_small_pool_finishes_every_request_unchanged(tiny):
    jobs = _jobs(10, seed=1)
    pool = make_pool(tiny[0], 14)  # 56 slots for ten requests of up to ~30 tokens
    sched = Scheduler(*tiny, pool)
    reqs = _drain(sched, {0: list(enumerate(jobs))})
    assert sched.preemptions > 0
    assert [reqs[j].tokens for j in range(10)] == _solo(tiny, jobs)
    assert _all_free(sched)
    pool.allocator.check_invariants()


def test_a_prefill_short_of_blocks_preempts_the_newest_request_not_an_older_one(tiny):
    """First come, first served: the request that arrived last gives its blocks back, even
    when it is the one prefilling and short of blocks; the older one decodes on untouched."""
    pool = make_pool(tiny[0], 8)
    sched = Scheduler(*tiny, pool, prefill_budget=4)
    old = sched.add([5, 6], max_tokens=30)
    for _ in range(2):
        sched.step()
    new_prompt = list(range(2, 22))  # admitted with room for its prompt; the older grows
    new = sched.add(new_prompt, max_tokens=4)
    for _ in range(300):
        if not sched.has_work:
            break
        sched.step()
    assert old.preemptions == 0 and new.preemptions >= 1
    assert [old.tokens, new.tokens] == _solo(tiny, [([5, 6], 30), (new_prompt, 4)])
    assert _all_free(sched)


def test_admission_leaves_the_running_sequences_room_to_grow(tiny):
    """A request is admitted only with a block to spare per running sequence: admitted into
    the last free blocks it would be preempted as soon as the older one grows (a recompute for
    one token), readmitted into the blocks it freed, and preempted again."""
    pool = make_pool(tiny[0], 5)
    sched = Scheduler(*tiny, pool)
    old = sched.add([5, 6, 7], max_tokens=12)
    for _ in range(4):
        sched.step()
    new_prompt = list(range(2, 10))
    new = sched.add(new_prompt, max_tokens=3)
    for _ in range(300):
        if not sched.has_work:
            break
        sched.step()
    assert sched.preemptions == 0
    assert [old.tokens, new.tokens] == _solo(tiny, [([5, 6, 7], 12), (new_prompt, 3)])
    assert _all_free(sched)


def test_a_long_prompt_prefills_in_chunks_without_stalling_others(tiny):
    pool = make_pool(tiny[0], 60)
    sched = Scheduler(*tiny, pool, prefill_budget=4)
    short = sched.add([5, 6], max_tokens=30)
    sched.step()
    sched.step()
    long_prompt = list(range(2, 42))
    long = sched.add(long_prompt, max_tokens=5)
    counts = []
    while long.pending or not long.handle:
        before = len(short.tokens)
        sched.step()
        counts.append(len(short.tokens) - before)
    assert len(counts) >= 40 // 4 and all(c == 1 for c in counts)  # one token every step
    while sched.has_work:
        sched.step()
    assert [short.tokens, long.tokens] == _solo(tiny, [([5, 6], 30), (long_prompt, 5)])


def test_cancel_frees_the_blocks_and_leaves_the_others(tiny):
    jobs = _jobs(4, seed=2)
    pool = make_pool(tiny[0], 60)
    sched = Scheduler(*tiny, pool)
    reqs = [sched.add(p, max_tokens=k + 10) for p, k in jobs]
    for _ in range(4):
        sched.step()
    sched.cancel(reqs[1])
    assert reqs[1].finish_reason == "cancelled" and reqs[1].handle is None
    while sched.has_work:
        sched.step()
    solo = _solo(tiny, [(p, k + 10) for p, k in jobs])
    assert [reqs[i].tokens for i in (0, 2, 3)] == [solo[i] for i in (0, 2, 3)]
    assert reqs[1].tokens == solo[1][:len(reqs[1].tokens)]
    assert _all_free(sched)


def test_same_seed_same_tokens_in_one_batch(tiny):
    sched = Scheduler(*tiny, make_pool(tiny[0], 60))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    a, b = (sched.add([3, 4, 5], max_tokens=20, sampling=params) for _ in range(2))
    c = sched.add([3, 4, 5], max_tokens=20, sampling=SamplingParams(temperature=0.9, seed=8))
    while sched.has_work:
        sched.step()
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stop_ids_finish_a_request(tiny):
    sched = Scheduler(*tiny, make_pool(tiny[0], 60))
    (solo,) = _solo(tiny, [([9, 9, 9], 12)])
    req = sched.add([9, 9, 9], max_tokens=12, stop_ids=[solo[4]])
    while sched.has_work:
        sched.step()
    assert req.finish_reason == "stop" and req.tokens == solo[:solo.index(solo[4]) + 1]


def test_requests_that_can_never_fit_are_refused_up_front(tiny):
    pool = make_pool(tiny[0], 4)
    sched = Scheduler(*tiny, pool)
    with pytest.raises(CapacityError, match=r"need 70 KV slots, a sequence of this artifact "
                       r"holds 64"):
        sched.add([1] * 60, max_tokens=11)
    with pytest.raises(CapacityError, match=r"needs 5 KV blocks, the pool has 4"):
        sched.add([1] * 10, max_tokens=10)
    for bad in (0, -1, 2.0):
        with pytest.raises(InputError, match="max_tokens"):
            sched.add([1], max_tokens=bad)
    assert sched.waiting == [] and pool.num_free == 4


# -- the batching engine (text, a thread of its own) -------------------------------------------

@pytest.fixture(scope="module")
def engines(build):
    prepared = build("tiny", **OPTS)
    batch = BatchEngine.load(prepared.artifact_dir, prepared.weights_dir)
    yield batch, Engine.load(prepared.artifact_dir, prepared.weights_dir)
    batch.close()


PROMPTS = ["hello", "the quick brown fox", "a", "paged decode", "x" * 20, "zz"]


def test_generate_many_equals_each_prompt_alone(engines):
    batch, solo = engines
    want = ["".join(solo.stream_text(p, max_new_tokens=12)) for p in PROMPTS]
    assert batch.generate_many(PROMPTS, max_new_tokens=12) == want
    assert _all_free(batch.scheduler)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_requests_ending_in_their_first_step_keep_every_token(engines, max_new_tokens):
    """A new request's first step yields two tokens (its prompt's last chunk, then a decode
    row): both reach the text even when the request ends with the second."""
    batch, solo = engines
    want = ["".join(solo.stream_text(p, max_new_tokens=max_new_tokens)) for p in PROMPTS]
    assert batch.generate_many(PROMPTS, max_new_tokens=max_new_tokens) == want


def test_32_concurrent_streams_each_equal_its_solo_run(engines):
    batch, solo = engines
    prompts = [PROMPTS[i % len(PROMPTS)] + str(i) for i in range(32)]
    want = ["".join(solo.stream_text(p, max_new_tokens=10)) for p in prompts]
    got = [None] * 32
    barrier = threading.Barrier(32)

    def client(i):
        barrier.wait()
        got[i] = "".join(batch.submit(prompts[i], max_new_tokens=10))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want
    assert _all_free(batch.scheduler)


def test_stop_strings_cut_the_text_before_them(engines):
    batch, solo = engines
    full = "".join(solo.stream_text("hello", max_new_tokens=16))
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    stream = batch.submit("hello", max_new_tokens=16, stop=[stop])
    assert stream.text() == full[:full.find(stop)] and stream.finish_reason == "stop"
    # the request ends at the token that completes the stop string, as at a stop id; text is
    # final once it does not end inside a character (a partial one decodes as U+FFFD)
    tokens = solo.generator.generate(solo.encode_prompt("hello"), 16)
    texts = [solo.tokenizer.decode(tokens[:n], skip_special_tokens=True)
             for n in range(len(tokens) + 1)]
    final = [max(m for m in range(n + 1) if not texts[m].endswith("\ufffd"))
             for n in range(len(texts))]
    last = next(n for n in range(1, len(tokens) + 1) if stop in texts[final[n]])
    assert stream.tokens == tokens[:last]


def test_stop_token_ids_end_the_stream_without_their_text(engines):
    """A stop id the caller names ends the request like the tokenizer's end of sequence: the
    id is the last token, its text is not in the output; the eos ids still stop it too."""
    batch, solo = engines
    ids = solo.encode_prompt("hello")
    tokens = solo.generator.generate(ids, 16, stop_ids=solo.tokenizer.eos_ids)
    assert len(tokens) > 4  # no end of sequence before the id chosen below
    stop = tokens[4]
    cut = tokens.index(stop)
    stream = batch.submit("hello", max_new_tokens=16, stop_token_ids=[stop])
    text = stream.text()
    assert stream.tokens == tokens[:cut + 1] and stream.finish_reason == "stop"
    assert text == "".join(solo.stream_ids_text(ids, max_new_tokens=cut))
    none = batch.submit("hello", max_new_tokens=16, stop_token_ids=None)  # as () does
    assert none.text() == "".join(solo.stream_ids_text(ids, max_new_tokens=16))
    for bad, match in (([1.5], r"stop_token_ids: 1\.5 is a float"),
                       (7, r"stop_token_ids=7: must be an iterable")):
        with pytest.raises(InputError, match=match):
            batch.submit("hello", stop_token_ids=bad)


def test_cancelling_a_stream_frees_its_blocks(engines):
    """Cancelled as its first piece arrives: the listener runs on the engine's thread, so the
    cancel is queued before the next step however fast the steps are (a consumer thread
    cancelling after its first piece can find all 50 tokens already made)."""
    batch, _ = engines
    pieces, ended = [], threading.Event()

    def listener(stream, delta):
        if delta is None:
            ended.set()
        else:
            pieces.append(delta)
            if len(pieces) == 1:
                stream.cancel()

    stream = batch.submit("hello", max_new_tokens=50, listener=listener)
    assert ended.wait(60)
    assert stream.finish_reason == "cancelled" and len(pieces) < 50
    batch.generate_many(["a"], max_new_tokens=2)  # a step after the cancel has run
    assert _all_free(batch.scheduler)


def test_a_stream_has_ended_before_stats_stop_counting_it(engines, monkeypatch):
    """Whoever sees nothing running or waiting finds every stream's finish_reason set."""
    batch, _ = engines
    counted_at_close: list = []
    real = RequestStream._close

    def close(stream, *args):
        stats = batch.stats()
        counted_at_close.append(stats["running"] + stats["waiting"])
        real(stream, *args)

    monkeypatch.setattr(RequestStream, "_close", close)
    streams = [batch.submit(p, max_new_tokens=4) for p in PROMPTS[:3]]
    cancelled = batch.submit("hello", max_new_tokens=50)
    next(iter(cancelled))
    cancelled.cancel()
    for s in streams + [cancelled]:
        s.text()
    assert len(counted_at_close) == 4 and all(n >= 1 for n in counted_at_close)


def test_bad_submissions_raise_before_queueing(engines):
    batch, solo = engines
    for kwargs, match in ((dict(max_new_tokens=0), "max_new_tokens=0"),
                          (dict(stop="x"), "stop="),
                          (dict(max_new_tokens=500), "KV slots")):
        with pytest.raises(InputError, match=match):
            batch.submit("hello", **kwargs)
    with pytest.raises(InputError, match="not valid text"):
        batch.submit("\ud800")
    with pytest.raises(InputError, match="text or a list of token ids, got NoneType"):
        batch.submit(None)
    with pytest.raises(InputError, match="must be text .* got NoneType"):
        next(solo.stream_text(None))


def test_forks_share_the_prompt_and_each_equals_its_seeded_solo_run(tiny):
    import dataclasses

    prompt = [7] * 9  # two full blocks of 4 and one token in a third
    pool = make_pool(tiny[0], 60)
    sched = Scheduler(*tiny, pool)
    params = SamplingParams(temperature=0.9, top_k=20, seed=11)
    group = sched.add_forks(prompt, 3, max_tokens=12, sampling=params)
    sched.step()  # prefilled once, forked, first tokens sampled, one decode step
    # the two full prompt blocks are held once; the third was copied on write by two forks
    assert pool.num_blocks - pool.num_free == 2 + 3
    # by the three sequences and the prefix cache, which took the full blocks as they filled
    assert pool.allocator.refcount(group[0].handle.blocks[0]) == 3 + 1
    while sched.has_work:
        sched.step()
    gen = Generator(*tiny, make_pool(tiny[0], 20))
    for i, req in enumerate(group):
        solo = gen.generate(prompt, max_new_tokens=12,
                            sampling=dataclasses.replace(params, seed=11 + i))
        assert req.tokens == solo, i
    assert len({tuple(r.tokens) for r in group}) > 1
    assert _all_free(sched)
    pool.allocator.check_invariants()


def test_a_group_of_forks_larger_than_max_running_runs_in_turns(tiny):
    """n = 5 continuations with room for 2 at a time: never more than 2 run, the ones that
    wait prefill the prompt from the prefix cache later, each equals its seeded solo run."""
    import dataclasses

    prompt = [9] * 10
    pool = make_pool(tiny[0], 40)
    sched = Scheduler(*tiny, pool, max_running=2)
    params = SamplingParams(temperature=0.9, top_k=20, seed=3)
    group = sched.add_forks(prompt, 5, max_tokens=6, sampling=params)
    most = 0
    for _ in range(200):
        if not sched.has_work:
            break
        sched.step()
        most = max(most, len(sched.running))
    assert most == 2 and all(r.finish_reason == "length" for r in group)
    assert sched.cache.tokens_saved >= 2 * 8  # later turns reused the prompt's two full blocks
    gen = Generator(*tiny, make_pool(tiny[0], 20))
    for i, req in enumerate(group):
        solo = gen.generate(prompt, max_new_tokens=6,
                            sampling=dataclasses.replace(params, seed=3 + i))
        assert req.tokens == solo, i
    assert _all_free(sched)


def test_greedy_forks_cancelled_head_and_preemption(tiny):
    """Cancelling the first continuation leaves the others; under a pool too small for all,
    forks preempted and recomputed still equal the solo run."""
    prompt = list(range(3, 14))
    (solo,) = _solo(tiny, [(prompt, 20)])
    pool = make_pool(tiny[0], 9)
    sched = Scheduler(*tiny, pool)
    group = sched.add_forks(prompt, 4, max_tokens=20)
    sched.step()
    sched.cancel(group[0])
    while sched.has_work:
        sched.step()
    assert all(r.tokens == solo for r in group[1:]) and sched.preemptions > 0
    assert _all_free(sched)


def test_run_prints_n_samples(artifact_root):
    from click.testing import CliRunner

    from paged_decode.cli import run_cmd

    result = CliRunner().invoke(run_cmd, [
        "--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
        str(artifact_root), "--prompt", "hello", "--max-new-tokens", "8", "--n", "3",
        "--temperature", "0.8", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert [f"--- sample {i} of 3 ---" in result.output for i in (1, 2, 3)] == [True] * 3


def _text_within(stream, seconds: float = 60) -> str | None:
    """The stream's whole text, or None if it has not ended within ``seconds``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(stream.text()), daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else None


@pytest.mark.parametrize("raised", [RuntimeError, SystemExit])
def test_a_raising_listener_ends_its_own_request_only(engines, raised):
    batch, solo = engines
    calls: list = []

    def bad(stream, delta):
        calls.append(delta)
        raise raised("listener failed")

    other = batch.submit("paged", max_new_tokens=8)
    failed = batch.submit("hello", max_new_tokens=30, listener=bad)
    want = "".join(solo.stream_text("paged", max_new_tokens=8))
    assert _text_within(other) == want
    assert _text_within(batch.submit("paged", max_new_tokens=8)) == want  # the engine goes on
    assert batch.alive and len(calls) == 1  # not called again once it raised
    assert failed.finish_reason == "error" and isinstance(failed.error, raised)
    assert _all_free(batch.scheduler)


def test_a_group_larger_than_the_engine_holds_is_refused_not_queued(build):
    prepared = build("tiny", **OPTS)
    with BatchEngine.load(prepared.artifact_dir, prepared.weights_dir, max_running=1,
                          max_waiting=1) as batch:
        assert batch.capacity == 2
        with pytest.raises(InputError, match=r"n=3: .* at most 2"):
            batch.submit_n("hello", 3, max_new_tokens=2)
        assert batch.stats()["running"] + batch.stats()["waiting"] == 0
        pair = batch.submit_n("hello", 2, max_new_tokens=2)  # as many as it holds: taken
        assert [_text_within(s) is not None for s in pair] == [True, True]
        assert [s.finish_reason for s in pair] == ["length", "length"]
        # more prompts than it holds: generate_many feeds them in as earlier ones finish
        solo = Engine.load(prepared.artifact_dir, prepared.weights_dir)
        want = ["".join(solo.stream_text(p, max_new_tokens=6)) for p in PROMPTS]
        assert batch.generate_many(PROMPTS, max_new_tokens=6) == want
    with pytest.raises(EngineStoppedError, match="closed"):
        batch.submit("hello", max_new_tokens=2)


def test_generate_many_refused_midway_cancels_what_it_submitted(engines, monkeypatch):
    batch, _ = engines
    submitted: list = []
    real = batch.submit

    def recording(*args, **kwargs):
        submitted.append(real(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(batch, "submit", recording)
    with pytest.raises(CapacityError):
        batch.generate_many(["hello", "x" * 300], max_new_tokens=40)
    assert len(submitted) == 1 and _text_within(submitted[0]) is not None
    assert submitted[0].finish_reason == "cancelled"
    assert _all_free(batch.scheduler)


def test_cancel_all_ends_every_request_and_the_engine_goes_on(engines, monkeypatch):
    batch, solo = engines
    gate = threading.Event()
    real = batch.scheduler.step
    monkeypatch.setattr(batch.scheduler, "step", lambda: (gate.wait(60), real())[1])
    streams = [batch.submit(p, max_new_tokens=40) for p in PROMPTS[:3]]
    batch.cancel_all()
    gate.set()
    assert all(_text_within(s) is not None for s in streams)
    assert [s.finish_reason for s in streams] == ["cancelled"] * 3
    want = "".join(solo.stream_text("paged", max_new_tokens=8))
    assert batch.generate_many(["paged"], max_new_tokens=8) == [want]
    assert _all_free(batch.scheduler)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engines, monkeypatch):
    batch, solo = engines
    real = batch.scheduler.runner.run

    def broken(*args):
        monkeypatch.setattr(batch.scheduler.runner, "run", real)  # fails once
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(batch.scheduler.runner, "run", broken)
    stream = batch.submit("hello", max_new_tokens=8)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        stream.text()
    assert stream.finish_reason == "error"
    want = "".join(solo.stream_text("paged", max_new_tokens=8))
    assert batch.generate_many(["paged"], max_new_tokens=8) == [want]
    assert _all_free(batch.scheduler)
