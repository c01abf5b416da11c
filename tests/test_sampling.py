"""Sampling: greedy ties, filters that collapse to greedy, seeding, empirical distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paged_decode.runtime.errors import InputError
from paged_decode.runtime.sampling import Sampler, SamplingParams, filtered_probs

LOGITS = np.array([1.0, 2.5, 0.3, 2.5, -1.0, 0.0, 1.7, 3.0], dtype=np.float32)
DRAWS = 20_000


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def counts(params, logits=LOGITS, draws=DRAWS):
    sampler = Sampler(params)
    return np.bincount([sampler.sample(logits) for _ in range(draws)], minlength=len(logits))


def chi_square(observed, probs):
    """Pearson's statistic over the tokens with non-zero expected count."""
    expected = probs * observed.sum()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token of probability 0"
    return float((((observed - expected) ** 2)[keep] / expected[keep]).sum())


# 99.9 % quantiles of chi-square with k - 1 degrees of freedom (fixed seeds: deterministic anyway)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def test_greedy_is_argmax_with_ties_to_lowest_id():
    sampler = Sampler(SamplingParams())
    assert sampler.sample(LOGITS) == 7
    assert sampler.sample(np.array([0.5, 2.0, 2.0, 1.0], np.float32)) == 1
    assert sampler.sample(np.array([-np.inf, 3.0, -np.inf, 3.0], np.float32)) == 1
    assert sampler.sample(np.zeros(5, np.float32)) == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.5, top_k=1, seed=0),
    SamplingParams(temperature=1.5, top_p=1e-6, seed=0),
    SamplingParams(temperature=1.5, top_k=3, top_p=1e-6, seed=0),
])
def test_collapsing_filters_equal_greedy(params):
    rng = np.random.default_rng(1)
    sampler, greedy = Sampler(params), Sampler(SamplingParams())
    for _ in range(200):
        logits = rng.integers(-3, 4, size=11).astype(np.float32)  # plenty of ties
        assert sampler.sample(logits) == greedy.sample(logits)


def test_same_seed_same_sequence():
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1234)
    first = [Sampler(params).sample(LOGITS) for _ in range(3)]
    a, b = Sampler(params), Sampler(params)
    seq_a = [a.sample(LOGITS) for _ in range(300)]
    assert seq_a == [b.sample(LOGITS) for _ in range(300)]
    assert len(set(seq_a)) > 1 and first == [seq_a[0]] * 3
    other = Sampler(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1235))
    assert [other.sample(LOGITS) for _ in range(300)] != seq_a


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature):
    observed = counts(SamplingParams(temperature=temperature, seed=7))
    probs = softmax(LOGITS.astype(np.float64) / temperature)
    assert chi_square(observed, probs) < CHI2_999[len(LOGITS) - 1]


def test_top_k_restricts_and_renormalises():
    observed = counts(SamplingParams(temperature=1.0, top_k=3, seed=11))
    probs = np.zeros(len(LOGITS))
    probs[[1, 3, 7]] = softmax(LOGITS[[1, 3, 7]].astype(np.float64))
    assert chi_square(observed, probs) < CHI2_999[2]


def test_top_k_boundary_tie_goes_to_lowest_id():
    ids, probs = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert ids.tolist() == [1, 7]  # 2.5 at ids 1 and 3: id 1 kept
    np.testing.assert_allclose(probs, softmax(np.array([2.5, 3.0])))


def test_top_p_keeps_smallest_nucleus():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3])).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=3)
    ids, probs = filtered_probs(logits, params)
    order = np.argsort(ids)
    assert ids[order].tolist() == [1, 3]  # 0.4 + 0.3 reaches 0.7
    np.testing.assert_allclose(probs[order], [4 / 7, 3 / 7], rtol=1e-6)
    observed = counts(params, logits)
    expected = np.array([0.0, 4 / 7, 0.0, 3 / 7])
    assert chi_square(observed, expected) < CHI2_999[1]


def test_minus_inf_logits_are_never_drawn():
    logits = np.array([0.0, -np.inf, 0.0, -np.inf], np.float32)
    observed = counts(SamplingParams(temperature=1.0, top_p=0.99, seed=5), logits, 2000)
    assert observed[1] == observed[3] == 0 and observed[0] > 0 and observed[2] > 0


@pytest.mark.filterwarnings("error")  # no division by zero, no NaN weights on the way
@pytest.mark.parametrize("temperature", [1e-30, 1e-46, 1e-300])  # 1e-46: 0 as a float32
def test_tiny_temperature_does_not_overflow(temperature):
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
    assert all(sampler.sample(LOGITS) == 7 for _ in range(20))


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", True),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan), ("top_p", math.inf),
    ("seed", -1), ("seed", 1.5),
])
def test_bad_params_raise(field, value):
    with pytest.raises(InputError) as e:
        SamplingParams(**{field: value})
    assert f"{field}={value!r}" in str(e.value)


@pytest.mark.parametrize("logits", [
    np.array([0.0, np.nan, 1.0], np.float32),
    np.array([0.0, np.inf], np.float32),
    np.array([-np.inf, -np.inf], np.float32),
    np.zeros((2, 3), np.float32),
    np.zeros(0, np.float32),
    np.arange(3),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_logits_raise(logits, temperature):
    with pytest.raises(InputError):
        Sampler(SamplingParams(temperature=temperature, seed=0)).sample(logits)


def test_sampler_needs_params():
    with pytest.raises(InputError):
        Sampler({"temperature": 1.0})
    assert Sampler().params.greedy


def reference_candidates(logits, params):
    """The filters by the book: full stable sort, then top-k, then the nucleus."""
    p = softmax(logits.astype(np.float64) / params.temperature)
    order = np.argsort(-logits, kind="stable")  # descending, ties to the lowest id
    if params.top_k:
        order = order[: params.top_k]
    q = p[order] / p[order].sum()
    n = min(int(np.searchsorted(np.cumsum(q), params.top_p - 1e-9)) + 1, len(q))
    return set(order[:n].tolist())


@pytest.mark.parametrize("seed", [2, 3])
def test_filters_match_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        vocab = int(rng.integers(1, 40))
        logits = rng.integers(-4, 5, size=vocab).astype(np.float32) * np.float32(0.7)
        logits[rng.random(vocab) < 0.1] = -np.inf
        if np.isneginf(logits).all():
            logits[0] = 0.0
        params = SamplingParams(temperature=float(rng.choice([0.3, 1.0, 3.0])),
                                top_k=int(rng.integers(0, 6)), top_p=float(rng.choice([0.2, 0.6, 0.95, 1.0])))
        ids, probs = filtered_probs(logits, params)
        if params.top_p < 1:  # the nucleus is exact; without it, zero-probability ids may stay listed
            assert set(ids.tolist()) == reference_candidates(logits, params), (logits, params)
        else:
            assert reference_candidates(logits, params) <= set(ids.tolist())
        assert math.isclose(probs.sum(), 1.0)


def test_large_vocab_draw_across_chunks():
    logits = np.full(5000, -np.inf, np.float32)  # 4 full chunks of 1024 and a tail of 904
    logits[[3, 1500, 4999]] = [0.0, 1.0, 2.0]
    observed = counts(SamplingParams(temperature=1.0, seed=9), logits, 6000)
    probs = np.zeros(5000)
    probs[[3, 1500, 4999]] = softmax(np.array([0.0, 1.0, 2.0]))
    assert chi_square(observed, probs) < CHI2_999[2]


def test_nucleus_over_a_flat_large_vocab():
    logits = np.zeros(3000, np.float32)
    logits[:10] = 8.0  # 10 tokens hold ~91 % of the mass; the nucleus search must go past them
    ids, probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4, 5] and math.isclose(probs.sum(), 1.0)
    params = SamplingParams(temperature=1.0, top_p=0.99)
    ids, _ = filtered_probs(logits, params)
    assert sorted(ids.tolist()) == list(range(len(ids))) and len(ids) > 10
    assert set(ids.tolist()) == reference_candidates(logits, params)


@pytest.mark.parametrize("seed", [4, 5])
def test_top_k_over_a_large_vocab_matches_reference(seed):
    """Vocabularies large enough that top-k first narrows to the chunks holding the largest:
    heavy ties at the boundary (coarse logits), masked tokens, k from 1 to a sixteenth."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        vocab = int(rng.integers(2000, 60000))
        logits = rng.integers(-30, 31, size=vocab).astype(np.float32) * np.float32(0.25)
        logits[rng.random(vocab) < rng.choice([0.0, 0.5, 0.99])] = -np.inf
        logits[int(rng.integers(vocab))] = 1.0
        params = SamplingParams(temperature=1.0, top_k=int(rng.choice([1, 7, 40, vocab // 16])))
        ids, probs = filtered_probs(logits, params)
        finite = int(np.isfinite(logits).sum())
        assert len(ids) == params.top_k
        if finite >= params.top_k:
            assert set(ids.tolist()) == reference_candidates(logits, params), (vocab, params)
        assert math.isclose(probs.sum(), 1.0)


def test_a_batch_draws_what_each_sampler_draws_alone():
    """``sample_rows`` (the scheduler's step) gives each row the token its own sampler would
    draw from that row alone, greedy and sampled rows mixed; a NaN row fails alone."""
    from paged_decode.runtime.sampling import sample_rows

    rng = np.random.default_rng(6)
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
             SamplingParams(temperature=1.0, top_k=40, seed=2),
             SamplingParams(temperature=0.7, top_p=0.9, seed=3),
             SamplingParams(temperature=1.2, top_k=100, top_p=0.8, seed=4)]
    params = [kinds[i % len(kinds)] for i in range(13)]
    batch, alone = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for step in range(20):
        logits = (rng.standard_normal((13, 5000)) * 2).astype(np.float32)
        if step == 7:
            logits[3, 17] = np.nan
        tokens, errors = sample_rows(batch, logits)
        for i, sampler in enumerate(alone):
            if step == 7 and i == 3:
                assert set(errors) == {3} and "NaN" in str(errors[3])
                continue
            assert tokens[i] == sampler.sample(logits[i]), (step, i)


@pytest.mark.parametrize("seed", [7, 8])
def test_nucleus_over_a_large_vocab_matches_reference(seed):
    """Vocabularies large enough for the nucleus to narrow by weight buckets before sorting:
    flat and peaked rows, exact ties (coarse logits), masked tokens."""
    rng = np.random.default_rng(seed)
    for _ in range(30):
        vocab = int(rng.integers(2000, 60000))
        spread = float(rng.choice([0.05, 0.3, 2.0, 6.0]))
        logits = (rng.standard_normal(vocab) * spread).astype(np.float32)
        if rng.random() < 0.5:
            logits = np.round(logits * 4) / 4  # many exact ties
        logits[rng.random(vocab) < rng.choice([0.0, 0.3])] = -np.inf
        logits[int(rng.integers(vocab))] = 1.0
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.5])),
                                top_p=float(rng.choice([0.3, 0.9, 0.99])))
        ids, probs = filtered_probs(logits, params)
        assert set(ids.tolist()) == reference_candidates(logits, params), (vocab, spread, params)
        assert math.isclose(probs.sum(), 1.0)
