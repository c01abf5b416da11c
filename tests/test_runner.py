"""The step runner: ragged rows (several prompts, decode tokens and verification rows in one
step) give the logits of running each sequence's tokens one at a time; a failed step changes
no sequence."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.runtime.errors import OutOfBlocksError, TokenIdError
from paged_decode.runtime.runner import Row, StepRunner

from .conftest import BUCKETS, LOGIT_TOL, make_pool

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)
TOL = LOGIT_TOL["float32"]


@pytest.fixture
def model(load):
    return load("tiny", **OPTS)


def _solo(artifact, weights, prompt, fed=()) -> list[np.ndarray]:
    """The prompt's last logits, then each fed token's, one B = 1 call at a time."""
    runner = StepRunner(artifact, weights, make_pool(artifact, 40))
    h = runner.pool.new_sequence()
    out = [runner.single.prefill(h, prompt)]
    out += [runner.single.realize_token(h, t) for t in fed]
    return out


def _ids(n, seed, vocab):
    return np.random.default_rng(seed).integers(2, vocab, size=n).tolist()


def test_a_verification_row_returns_every_positions_logits(model):
    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    prompt, fed = _ids(6, 1, vocab), _ids(5, 2, vocab)
    want = _solo(artifact, weights, prompt, fed)
    runner = StepRunner(artifact, weights, make_pool(artifact, 40))
    h = runner.pool.new_sequence()
    runner.prefill(h, prompt)
    calls = dict(runner.realize_counts)
    got = runner.run([Row(h, fed, all_logits=True)])[0]
    assert got.shape == (5, vocab) and h.length == 11
    np.testing.assert_allclose(got, np.stack(want[1:]), atol=TOL, rtol=0)
    # five token rows: one call of the 8-row plan
    assert {b: n - calls[b] for b, n in runner.realize_counts.items() if n != calls[b]} == {8: 1}
    # dropping the last three (rejected drafts) and going on reads none of what they wrote
    h.truncate_to(8)
    row = runner.run([Row(h, [fed[2]])])[0][0]
    np.testing.assert_allclose(row, want[3], atol=TOL, rtol=0)


def test_several_prompts_and_a_decode_row_run_in_one_call(model):
    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    prompts = [_ids(n, 10 + n, vocab) for n in (3, 2, 2)]
    runner = StepRunner(artifact, weights, make_pool(artifact, 40))
    old = runner.pool.new_sequence()
    runner.prefill(old, prompts[0])
    handles = [runner.pool.new_sequence() for _ in prompts]
    rows = [Row(h, p) for h, p in zip(handles, prompts)] + [Row(old, [7])]
    got = runner.run(rows)
    assert runner.realize_counts[8] == 1 and runner.prefill_calls == 0  # 8 token rows
    for prompt, logits in zip(prompts, got):
        assert logits.shape == (1, vocab)
        np.testing.assert_allclose(logits[0], _solo(artifact, weights, prompt)[0], atol=TOL,
                                   rtol=0)
    np.testing.assert_allclose(got[3][0], _solo(artifact, weights, prompts[0], [7])[1],
                               atol=TOL, rtol=0)
    assert [h.length for h in handles] == [3, 2, 2] and old.length == 4


def test_rows_past_the_streaming_buckets_go_in_calls_that_fill_theirs(model):
    """On the CPU, 11 token rows run as calls of 8 and 3 rows (the 8- and 4-row plans), not
    one padded 16-row matrix call; 20 as 16 + 4; a full 16 stays one call.  Every row's logits
    are its solo ones (bit for bit: a row's sums do not depend on its batch)."""
    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    runner = StepRunner(artifact, weights, make_pool(artifact, 60))
    assert [runner.calls_for(n) for n in (8, 11, 16, 20, 31, 33)] == [
        [8], [8, 4], [16], [16, 4], [16, 8, 8], [32, 1]]
    prompts = [_ids(n, 30 + n, vocab) for n in (4, 5, 2)]
    handles = [runner.pool.new_sequence() for _ in prompts]
    before = dict(runner.realize_counts)
    got = runner.run([Row(h, p, all_logits=True) for h, p in zip(handles, prompts)])
    assert {b: n - before[b] for b, n in runner.realize_counts.items() if n != before[b]} == {
        8: 1, 4: 1}
    for prompt, logits in zip(prompts, got):
        solo_runner = StepRunner(artifact, weights, make_pool(artifact, 20))
        h = solo_runner.pool.new_sequence()
        want = solo_runner.run([Row(h, prompt, all_logits=True)])[0]
        np.testing.assert_array_equal(logits, want)


def test_rows_longer_than_the_largest_bucket(model):
    """A prompt chunk past the largest bucket runs the compiled prefill; a verification row
    that long spans two batched calls, in order."""
    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    long_prompt, seq = _ids(40, 3, vocab), _ids(36, 4, vocab)
    want = _solo(artifact, weights, seq[:1], seq[1:])
    runner = StepRunner(artifact, weights, make_pool(artifact, 40))
    a, b = runner.pool.new_sequence(), runner.pool.new_sequence()
    got = runner.run([Row(a, long_prompt), Row(b, seq, all_logits=True)])
    assert runner.prefill_calls == 1 and runner.realize_counts[32] == 1
    assert runner.realize_counts[4] == 1  # the last 4 of the 36 token rows
    np.testing.assert_allclose(got[0][0], _solo(artifact, weights, long_prompt)[0], atol=TOL,
                               rtol=0)
    np.testing.assert_allclose(got[1], np.stack(want), atol=TOL, rtol=0)


@pytest.mark.parametrize("fault", ["bad_token", "out_of_blocks"])
def test_a_failed_step_changes_no_sequence(model, fault):
    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    pool = make_pool(artifact, 6)
    runner = StepRunner(artifact, weights, pool)
    a, b = pool.new_sequence(), pool.new_sequence()
    runner.prefill(a, _ids(5, 5, vocab))
    runner.prefill(b, _ids(3, 6, vocab))
    before = [(h.length, h.blocks) for h in (a, b)], pool.num_free
    if fault == "bad_token":
        rows, error = [Row(a, [3, 4]), Row(b, [5, vocab])], TokenIdError
    else:
        rows, error = [Row(a, _ids(4, 7, vocab)), Row(b, _ids(12, 8, vocab))], OutOfBlocksError
    with pytest.raises(error):
        runner.run(rows)
    assert ([(h.length, h.blocks) for h in (a, b)], pool.num_free) == before
    assert runner.run([Row(a, [3]), Row(b, [4])])[0].shape == (1, vocab)  # both go on


def test_a_plans_first_call_is_not_timed_and_an_old_mean_expires(model):
    """What a drafter weighs a verification by: a plan's first call (its inputs made, memory
    first touched) does not count, and a mean not refreshed for STALE_CALLS calls is unknown
    again (so a slow moment cannot stop speculation for good)."""
    from paged_decode.runtime.runner import STALE_CALLS

    artifact, weights = model
    vocab = artifact.manifest.vocab_size
    runner = StepRunner(artifact, weights, make_pool(artifact, 40))
    h = runner.pool.new_sequence()
    runner.prefill(h, _ids(3, 5, vocab))  # the 4-row plan's first call
    assert runner.calls_for(3) == [4] and runner.cost(3) is None
    runner.run([Row(h, _ids(3, 6, vocab), all_logits=True)])
    assert runner.cost(3) == runner.seconds[4] > 0
    length = h.length
    for _ in range(STALE_CALLS):
        runner.run([Row(h, [5])])
        h.truncate_to(length)
    assert runner.cost(3) is None and runner.cost(1) == runner.seconds[1] > 0
