"""The logit controls and min-p (runtime/penalties.py, runtime/sampling.py) against numpy
references of their definitions (OpenAI's penalties and logit_bias, vLLM / HF's multiplicative
repetition penalty, vLLM's min_p and min_tokens), alone and per row in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.runtime.errors import SamplingError
from paged_decode.runtime.sampling import Sampler, SamplingParams, filtered_probs, sample_rows

V = 64


def _logits(seed: int = 0, rows: int | None = None) -> np.ndarray:
    shape = (V,) if rows is None else (rows, V)
    return (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)


def _reference(x, params, prompt, output, stop_ids) -> np.ndarray:
    """The controls written out from their definitions, in float64."""
    y = x.astype(np.float64)
    for t, b in params.logit_bias:
        y[t] = -np.inf if b <= -100 else y[t] + b
    if len(output) < params.min_tokens:
        y[list(stop_ids)] = -np.inf
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        y[t] = y[t] / r if y[t] > 0 else y[t] * r
    for t in set(output):
        c = output.count(t)
        y[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    return y


@pytest.mark.parametrize("params", [
    SamplingParams(logit_bias={3: 5.0, 7: -100, 9: -2.5}),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.4),
    SamplingParams(min_tokens=4),
    SamplingParams(frequency_penalty=1.1, repetition_penalty=1.3, logit_bias={1: 2.0},
                   min_tokens=2),
], ids=["bias", "repetition", "repetition<1", "frequency+presence", "min_tokens", "all"])
def test_each_control_equals_its_definition(params):
    prompt, stop = [1, 5, 5, 9], {0, 2}
    sampler = Sampler(params, prompt=prompt, stop_ids=stop)
    output: list[int] = []
    for step in range(6):
        x = _logits(step)
        want = _reference(x, params, prompt, output, stop)
        got = sampler.processor.apply(x)
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, atol=1e-5)
        token = sampler.sample(x)
        assert token == int(np.argmax(want))  # greedy: the controlled logits' maximum
        output.append(token)


def test_logit_bias_minus_100_removes_the_greedy_token():
    x = _logits(1)
    best = int(np.argmax(x))
    banned = Sampler(SamplingParams(logit_bias={best: -100}))
    assert banned.sample(x) == int(np.argsort(-x, kind="stable")[1])
    forced = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={5: 100}))
    assert {forced.sample(x) for _ in range(20)} == {5}


def test_repetition_penalty_lowers_a_repeated_tokens_logit_by_the_factor():
    x = _logits(2)
    x[11], x[12] = 4.0, -3.0
    got = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[11, 12]).processor.apply(x)
    assert got[11] == pytest.approx(2.0) and got[12] == pytest.approx(-6.0)
    untouched = np.setdiff1d(np.arange(V), [11, 12])
    assert np.array_equal(got[untouched], x[untouched])


def test_min_tokens_holds_back_the_stop_ids_then_lets_them_end():
    x = np.zeros(V, np.float32)
    x[0] = 10.0  # the end-of-sequence id is the greedy choice
    sampler = Sampler(SamplingParams(min_tokens=3), stop_ids={0})
    assert [sampler.sample(x) for _ in range(4)] == [1, 1, 1, 0]


def test_min_p_keeps_tokens_at_least_that_share_of_the_top():
    x = _logits(3)
    for min_p, temperature in ((0.1, 1.0), (0.3, 0.7), (1.0, 1.0)):
        ids, probs = filtered_probs(x, SamplingParams(temperature=temperature, min_p=min_p))
        p = np.exp((x - x.max()) / temperature)
        keep = np.flatnonzero(p >= min_p * p.max())
        assert sorted(ids.tolist()) == keep.tolist()
        want = p[ids] / p[keep].sum()
        np.testing.assert_allclose(probs, want, rtol=1e-5)


def test_min_p_with_top_k_and_top_p_keeps_the_intersection():
    x = _logits(4)
    params = SamplingParams(temperature=1.0, min_p=0.05, top_k=10, top_p=0.9)
    ids, _ = filtered_probs(x, params)
    p = np.exp(x - x.max())
    order = np.argsort(-p, kind="stable")
    kept = [t for t in order[:10] if p[t] >= 0.05]
    mass = np.cumsum(p[kept]) / p[kept].sum()
    n = int(np.searchsorted(mass, 0.9 - 1e-9)) + 1
    assert sorted(ids.tolist()) == sorted(kept[:n])


def test_rows_in_a_batch_each_follow_their_own_controls():
    """A batch mixing plain greedy, sampled and controlled rows: every row's tokens over several
    steps are what its sampler alone draws from the same logits."""
    mk = [lambda: SamplingParams(),
          lambda: SamplingParams(logit_bias={0: -100}, repetition_penalty=1.5),
          lambda: SamplingParams(temperature=0.8, seed=3),
          lambda: SamplingParams(temperature=0.9, seed=4, min_p=0.2, frequency_penalty=1.0),
          lambda: SamplingParams(min_tokens=2, presence_penalty=0.5)]
    batch = [Sampler(f(), prompt=[1, 2], stop_ids={4}) for f in mk]
    alone = [Sampler(f(), prompt=[1, 2], stop_ids={4}) for f in mk]
    for step in range(5):
        logits = _logits(10 + step, rows=len(mk))
        got, errors = sample_rows(batch, logits)
        assert not errors
        assert got == [s.sample(logits[i]) for i, s in enumerate(alone)]
    assert batch[0].processor is None and batch[2].processor is None  # the plain path


def test_a_row_whose_bias_bans_everything_fails_alone():
    ban_all = Sampler(SamplingParams(logit_bias={t: -100 for t in range(V)}))
    tokens, errors = sample_rows([Sampler(), ban_all], _logits(5, rows=2))
    assert list(errors) == [1] and isinstance(errors[1], SamplingError)
    assert "ban" in str(errors[1]) and tokens[0] == int(np.argmax(_logits(5, rows=2)[0]))


@pytest.mark.parametrize("kwargs,name", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=2.0), "min_tokens"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias=[5, 6]), "logit_bias"),
    (dict(logit_bias=5), "logit_bias"),
])
def test_bad_control_values_are_typed_errors_naming_them(kwargs, name):
    with pytest.raises(SamplingError, match=name):
        SamplingParams(**kwargs)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={V: 1.0})
    with pytest.raises(SamplingError, match=f"token id {V} is outside the vocabulary"):
        params.check_vocab(V)
    params.check_vocab(V + 1)
    assert SamplingParams(logit_bias={3: 1, 1: -2}).logit_bias == ((1, -2.0), (3, 1.0))
    hash(params)  # frozen and hashable, as before the dict field
