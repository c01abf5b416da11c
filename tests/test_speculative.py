"""Speculative decoding: prompt-lookup drafts verified in one step give exactly the tokens of
decoding without them (greedy), the same log-probabilities at every step (nothing a rejected
draft wrote is read), and with sampling exactly the sampler's distribution."""

from __future__ import annotations

import re

import numpy as np
import pytest

from paged_decode.runtime.errors import InputError
from paged_decode.runtime.sampling import Sampler, SamplingParams, filtered_probs
from paged_decode.runtime.scheduler import Scheduler
from paged_decode.runtime.speculative import (NgramDrafter, SpeculativeConfig, best_length,
                                              expected_tokens)

from .conftest import BUCKETS, LOGIT_TOL, TINY_LONG, make_pool

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)
# every proposal verified whole: what is checked is the verification, not the cost model's
# choice (test_draft_length_follows_acceptance), which on a tiny model is host overhead
SPEC = SpeculativeConfig(draft_tokens=7, adaptive=False)


@pytest.fixture
def tiny(load):
    return load("tiny", **OPTS)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves, so lookup finds drafts (the random model's greedy
    output then repeats too)."""
    rng = np.random.default_rng(3)
    return [rng.integers(2, vocab, size=5 + i).tolist() * 2 for i in range(n)]


def _run(artifact, weights, prompts, speculative, **request):
    sched = Scheduler(artifact, weights, make_pool(artifact, 120), speculative=speculative)
    reqs = [sched.add(p, **request) for p in prompts]
    while sched.has_work:
        sched.step()
    sched.cache.evict(sched.pool.num_blocks)  # no block leaked, rejected drafts' included
    sched.pool.allocator.check_invariants()
    assert sched.pool.num_free == sched.pool.num_blocks
    return reqs, sched


def _draft_config(load) -> SpeculativeConfig:
    """The tiny preset's own weights in Q8_0 drafting for it in float32 (one tokenizer), in
    test_batch_invariance's Q8_0 build (its own 16-token blocks: a draft keeps its own pool)."""
    from paged_decode.runtime.draft_model import DraftModel

    return SpeculativeConfig(method="draft", draft_tokens=5, adaptive=False,
                             draft_model=DraftModel(*load("tiny", weight_dtype="q8_0",
                                                          **TINY_LONG)))


@pytest.mark.parametrize("method,streams", [("ngram", 1), ("ngram", 3), ("draft", 1),
                                            ("draft", 3)])
def test_greedy_speculation_changes_no_token_and_no_logprob(tiny, load, method, streams):
    artifact, weights = tiny
    prompts = _prompts(streams, artifact.manifest.vocab_size)
    if method == "draft":  # prompts that do not repeat: the draft model's own guesses
        prompts = [p[:len(p) // 2] for p in prompts]
    opts = dict(max_tokens=40, top_logprobs=3)
    config = SPEC if method == "ngram" else _draft_config(load)
    plain, _ = _run(artifact, weights, prompts, None, **opts)
    spec, sched = _run(artifact, weights, prompts, config, **opts)
    assert sched.drafted_tokens > 0 and sched.accepted_tokens > 0  # it did speculate
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason == "length"
        for x, y in zip(a.logprobs, b.logprobs):  # every step's distribution, as computed
            np.testing.assert_allclose([x.logprob] + [p for _, p in x.top],
                                       [y.logprob] + [p for _, p in y.top],
                                       atol=LOGIT_TOL["float32"] * 10, rtol=0)
    assert sched.accepted_tokens <= sched.drafted_tokens
    if method == "draft":  # every request's draft sequence went back to the draft pool
        pool = config.draft_model.runner.pool
        assert pool.num_free == pool.num_blocks


def test_a_stop_id_inside_accepted_drafts_ends_the_request_there(tiny):
    artifact, weights = tiny
    prompts = _prompts(1, artifact.manifest.vocab_size)
    plain, _ = _run(artifact, weights, prompts, None, max_tokens=40)
    stop = plain[0].tokens[20]  # a token the repetition makes a verification accept
    first = plain[0].tokens.index(stop)
    spec, _ = _run(artifact, weights, prompts, SPEC, max_tokens=40, stop_ids=[stop])
    assert spec[0].tokens == plain[0].tokens[:first + 1]
    assert spec[0].finish_reason == "stop"


class _Tags:
    """A decoder that writes token t as ``<t>``."""

    def push(self, token: int) -> str:
        return f"<{token}>"

    def flush(self) -> str:
        return ""


def test_a_stop_string_inside_accepted_drafts_ends_the_request_at_its_last_token(tiny):
    """The token completing a stop string is the request's last, as a stop id's would be: the
    tokens verification accepted past it are not the request's (nor its usage)."""
    from paged_decode.runtime.request import StopStrings

    artifact, weights = tiny
    prompts = _prompts(1, artifact.manifest.vocab_size)
    free = _run(artifact, weights, prompts, SPEC, max_tokens=40)[0][0]
    tags = "".join(f"<{t}>" for t in free.tokens)

    def text(j: int, k: int) -> str:
        return "".join(f"<{t}>" for t in free.tokens[j:k])

    def end(stop: str) -> int:  # the tokens up to the end of the stop string's first match
        return tags[:tags.find(stop) + len(stop)].count("<")

    # the shortest stop string whose first match ends with a token that one verification took
    # together with the next one (the tokens of one verification share their time)
    j, last = next((j, k) for k in range(1, len(free.tokens))
                   if free.token_times[k - 1] == free.token_times[k]
                   for j in range(k - 1, -1, -1) if end(text(j, k)) == k)
    stop = text(j, last)
    sched = Scheduler(artifact, weights, make_pool(artifact, 120), speculative=SPEC)
    req = sched.add(prompts[0], max_tokens=40)
    req.text = StopStrings(_Tags(), (stop,), req.stop_ids)
    while sched.has_work:
        sched.step()
    assert req.tokens == free.tokens[:last] and req.finish_reason == "stop"
    assert req.text.text == tags[:tags.find(stop)]


def test_speculation_needs_batch_buckets(load):
    artifact, weights = load("tiny", block_size=4, max_context=64)
    with pytest.raises(InputError, match="--batch-buckets"):
        Scheduler(artifact, weights, make_pool(artifact, 20), speculative=SPEC)


@pytest.mark.parametrize("bad", [dict(method="eagle"), dict(draft_tokens=0),
                                 dict(draft_tokens=2.5), dict(ngram_min=3, ngram_max=2),
                                 dict(method="draft"), dict(draft_model=object())])
def test_bad_speculative_options_are_refused(bad):
    with pytest.raises(InputError):
        SpeculativeConfig(**bad)


def test_lookup_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(SpeculativeConfig(ngram_max=3, ngram_min=1))
    seq = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert drafter.propose(seq, 3) == [4, 5, 7] and drafter.match == 2  # [2, 3] latest at 6
    assert drafter.propose(seq + [4], 2) == [5, 7] and drafter.match == 3
    assert drafter.propose([8, 6], 4) == [] and drafter.match == 0


def test_draft_length_follows_acceptance():
    def cost(rows):
        return {2: 1.2, 4: 1.6, 8: 2.4}[1 << (rows - 1).bit_length()]

    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert best_length(0.1, 7, cost) == 0  # a verification would not pay for itself
    assert best_length(0.6, 7, cost) in (1, 3)
    assert best_length(0.95, 7, cost) == 7
    drafter = NgramDrafter(SPEC)
    drafter.propose([1, 2, 1], 3)
    before = drafter.acceptance()
    for _ in range(10):
        drafter.record(3, 0)
    assert drafter.acceptance() < before / 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=1),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=2)])
@pytest.mark.parametrize("draft", [0, 3, 7])
def test_draft_sampling_keeps_the_samplers_distribution(params, draft):
    """Rejection sampling with a drafted token: over many draws each token's frequency is its
    probability under the sampler's filters (every cell within 4.5 standard deviations)."""
    logits = np.array([2.0, 1.5, 0.3, -1.0, 0.9, 1.1, -0.2, 0.0], np.float32)
    ids, probs = filtered_probs(logits, params)
    want = np.zeros(len(logits))
    want[ids] = probs
    sampler, n = Sampler(params), 20000
    counts = np.bincount([sampler.sample_draft(logits, draft) for _ in range(n)],
                         minlength=len(logits))
    sd = np.sqrt(n * want * (1 - want)) + 1e-9
    assert (np.abs(counts - n * want) <= 4.5 * sd + 1).all(), (counts, n * want)
    assert counts[want == 0].sum() == 0  # a filtered-out draft is never taken


def _text(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if not line.startswith("[") and "prefill:" not in line]


def test_paged_run_speculative_prints_the_same_text(artifact_root):
    from click.testing import CliRunner

    from paged_decode.cli import run_cmd

    runner = CliRunner()
    args = ["--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
            str(artifact_root), "--prompt", "hello hello hello hello", "--max-new-tokens", "40"]
    plain = runner.invoke(run_cmd, args)
    spec = runner.invoke(run_cmd, args + ["--speculative", "ngram", "--draft-tokens", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert _text(spec.output) == _text(plain.output) and _text(plain.output)
    accepted, drafted = map(int, re.search(r"speculative: (\d+) of (\d+) drafted",
                                           spec.output).groups())
    assert 0 < drafted and accepted <= drafted
    none = runner.invoke(run_cmd, args + ["--batch-buckets", "none", "--speculative", "ngram"])
    assert none.exit_code == 1 and "--batch-buckets" in none.output.splitlines()[-1]


def test_metrics_count_drafted_and_accepted_tokens(build):
    from paged_decode.runtime.batch_engine import BatchEngine
    from paged_decode.serve.metrics import Metrics

    prepared = build("tiny", **OPTS)
    with BatchEngine.load(prepared.artifact_dir, prepared.weights_dir,
                          speculative=SPEC) as engine:
        # three streams: a 4-row call with a row to spare for a drafted token
        engine.generate_many(["hello hello hello hello"] * 3, max_new_tokens=30)
        stats, text = engine.stats(), Metrics(engine).render().decode()
    assert stats["drafted_tokens"] >= stats["accepted_tokens"] > 0
    for key in ("drafted", "accepted"):
        want = f"paged_decode_speculative_{key}_tokens_total {float(stats[key + '_tokens'])}"
        assert want in text


def test_the_benchmarks_ceiling_counts_the_steps_of_whole_verified_proposals():
    """With free verification: a text copied from the prompt takes one step for the token no
    n-gram predicts and one for the rest; text the prompt never holds takes a step a token."""
    from paged_decode.bench.speculative import ceiling

    config = SpeculativeConfig()
    assert ceiling([1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5], config) == 5 / 2
    assert ceiling([1, 2, 3], [7, 8, 9], config) == 1.0
    # a proposal is cut at draft_tokens: 12 copied tokens take 1 + ceil(11 / 8) steps
    prompt = list(range(100, 112)) + [5]
    assert ceiling(prompt, list(range(100, 112)), config) == 12 / 3
