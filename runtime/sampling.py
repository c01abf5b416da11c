"""Next-token sampling: greedy, temperature, min-p, top-k and top-p (nucleus), seeded.

Order: the logit controls of :mod:`.penalties` (``logit_bias``, ``min_tokens``, the repetition,
frequency and presence penalties), then scale by the temperature, keep the tokens at least
``min_p`` times as likely as the most likely one, keep the ``top_k`` most likely tokens, keep
the smallest prefix of those (by probability) whose mass reaches ``top_p``, renormalise, draw.
Ties go to the lowest token id everywhere (argmax, the top-k boundary, the nucleus order).

The weights ``exp((x - max) / temperature)`` are float32 (their exponential is six times faster
than float64's, and float32 is what the model's logits carry); every sum over them is float64.
A batch's rows go through :func:`sample_rows`: greedy rows take one ``argmax`` over the batch,
each other row its own sampler, and no filter passes over the whole vocabulary more than it must
(top-k narrows to the chunks that can hold the k largest before selecting; the nucleus to the
tokens heavy enough to be in it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from paged_decode.runtime.checks import is_int
from paged_decode.runtime.errors import SamplingError
from paged_decode.runtime.penalties import BAN, LogitsProcessor, uses_processor

_NUCLEUS_EPS = 1e-9  # cumulative mass within this of top_p counts as reaching it (float rounding)
_CHUNK = 1024  # entries per first-level bucket of the inverse-CDF draw
_TOP_K_CHUNKS = 4  # chunk maxima per kept token when top-k narrows its search
_NUCLEUS_SORT = 512  # candidates few enough to sort
_BELOW_ONE = float(np.nextafter(1.0, 0.0))
_F32_TINY = np.finfo(np.float32).tiny


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.  ``temperature == 0`` means greedy (the filters unused; the
    logit controls still apply).

    ``top_k == 0`` disables top-k; ``top_p == 1`` disables the nucleus; ``min_p == 0`` disables
    min-p; ``seed=None`` draws fresh OS entropy.  The logit controls (:mod:`.penalties`):
    ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's), ``repetition_penalty``
    > 0 (1 disables it), ``logit_bias`` ``{token id: bias in [-100, 100]}`` (-100 bans; stored as
    sorted ``(id, bias)`` pairs), ``min_tokens`` (stop ids held back until that many tokens are
    out).  ``ignore_eos``: the end-of-sequence ids do not end the output (``stop_token_ids``
    still do).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise SamplingError(f"temperature={t!r}: must be a finite number >= 0 (0 means greedy)")
        if not (is_int(k) and k >= 0):
            raise SamplingError(f"top_k={k!r}: must be an integer >= 0 (0 disables top-k)")
        if not (_is_real(p) and math.isfinite(p) and 0 < p <= 1):
            raise SamplingError(f"top_p={p!r}: must be a finite number in (0, 1] "
                                "(1 disables top-p)")
        if seed is not None and not (is_int(seed) and seed >= 0):
            raise SamplingError(f"seed={seed!r}: must be None or an integer >= 0")
        _check_real("min_p", self.min_p, 0, 1, "0 disables it")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), -2, 2, "0 disables it")
        r = self.repetition_penalty
        if not (_is_real(r) and math.isfinite(r) and r > 0):
            raise SamplingError(f"repetition_penalty={r!r}: must be a finite number > 0 "
                                "(1 disables it)")
        if not (is_int(self.min_tokens) and self.min_tokens >= 0):
            raise SamplingError(f"min_tokens={self.min_tokens!r}: must be an integer >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos={self.ignore_eos!r}: must be True or False")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """:class:`SamplingError` for a ``logit_bias`` id outside ``[0, vocab_size)``."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise SamplingError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                f"[0, {vocab_size})")


def _check_real(name: str, value, low: float, high: float, off: str) -> None:
    if not (_is_real(value) and math.isfinite(value) and low <= value <= high):
        raise SamplingError(f"{name}={value!r}: must be a finite number in [{low:g}, {high:g}] "
                            f"({off})")


def _bias_pairs(bias) -> tuple:
    """``{id: bias}`` or ``(id, bias)`` pairs as sorted pairs of an int id >= 0 and a float in
    [-100, 100]; :class:`SamplingError` otherwise."""
    try:
        pairs = list(bias.items() if isinstance(bias, dict) else bias or ())
        if not all(len(pair) == 2 for pair in pairs):
            raise TypeError("not (id, bias) pairs")
    except TypeError as e:
        raise SamplingError(f"logit_bias={bias!r}: must be a dict {{token id: bias}} "
                            f"({e})") from None
    for t, v in pairs:
        if not (is_int(t) and t >= 0):
            raise SamplingError(f"logit_bias: key {t!r} must be a token id (an integer >= 0)")
        if not (_is_real(v) and math.isfinite(v) and BAN <= v <= -BAN):
            raise SamplingError(f"logit_bias[{t}]={v!r}: must be a finite number in [-100, 100] "
                                "(-100 bans the token)")
    if len({int(t) for t, _ in pairs}) < len(pairs):
        raise SamplingError("logit_bias: a token id appears twice")
    return tuple(sorted((int(t), float(v)) for t, v in pairs))


class Sampler:
    """Draws token ids from logits with its own ``np.random.Generator(params.seed)``.

    The same params (with a seed) and the same logits give the same sequence of ids.  Not safe
    to share between threads (the generator's state advances with each draw): one per stream.
    """

    def __init__(self, params: SamplingParams | None = None, *, prompt=(), stop_ids=()):
        """``prompt`` (token ids, for ``repetition_penalty``) and ``stop_ids`` (what
        ``min_tokens`` holds back) matter only when ``params`` uses those controls."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be SamplingParams, got {type(params).__name__}; "
                                "pass SamplingParams(temperature=..., top_k=..., top_p=...)")
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._work = np.empty(0, np.float32)  # [vocab_size], reused: fresh arrays page-fault
        self.processor = (LogitsProcessor(params, prompt, stop_ids) if uses_processor(params)
                          else None)

    def sample(self, logits: np.ndarray) -> int:
        """One token id from ``logits``: a 1-D float vector ``[vocab_size]`` (float32 usually).
        With logit controls, the token is recorded as this sampler's output (penalties count
        it from the next call on)."""
        x, top = self._controlled(logits)
        token = self._pick(x, top)
        if self.processor is not None:
            self.processor.record(token)
        return token

    def _controlled(self, logits: np.ndarray) -> tuple[np.ndarray, float]:
        """The checked logits with the logit controls applied, and their maximum."""
        x, top = _checked_logits(logits)
        if self.processor is not None:
            x = self.processor.apply(x)
            top = float(np.max(x))
            if top == -np.inf:
                raise SamplingError("logit_bias / min_tokens ban every token this step allows; "
                                    "ban fewer tokens")
        return x, top

    def _weights(self, x: np.ndarray, top: float):
        """``_candidates`` over this sampler's reused work array."""
        if len(self._work) != len(x):
            self._work = np.empty(len(x), np.float32)
        return _candidates(x, self.params, top, self._work)

    def sample_draft(self, logits: np.ndarray, draft: int) -> int:
        """One token from ``logits`` given a token a drafter proposed for this position: with
        sampling, the draft with its probability under this sampler's distribution, else a
        draw from the others renormalised (speculative sampling with a draft proposed with
        certainty), so the token is distributed exactly as :meth:`sample` draws it; greedy
        takes the same ``argmax`` whatever was drafted."""
        if self.params.greedy:
            return self.sample(logits)
        ids, weights = self._weights(*self._controlled(logits))
        at = (np.array([draft]) if ids is None else np.flatnonzero(ids == draft))
        mass = float(weights[at[0]]) if at.size else 0.0
        total = float(weights.sum(dtype=np.float64))
        if self._rng.random() * total < mass:
            token = int(draft)
        else:
            if at.size:
                weights[at[0]] = 0.0  # the rest renormalised: _draw scales by their sum
            i = _draw(weights, self._rng.random())
            token = i if ids is None else int(ids[i])
        if self.processor is not None:
            self.processor.record(token)
        return token

    def _pick(self, x: np.ndarray, top: float) -> int:
        if self.params.greedy:
            return int(np.argmax(x))  # first maximum = lowest id
        ids, weights = self._weights(x, top)
        i = _draw(weights, self._rng.random())
        return i if ids is None else int(ids[i])


def sample_rows(samplers: list, logits: np.ndarray) -> tuple[list[int], dict]:
    """One token per row of ``logits`` ``[rows, vocab_size]``, row ``i`` drawn by
    ``samplers[i]`` (each row's tokens are what that sampler alone would draw); returns the
    tokens and ``{row: exception}`` for the rows that could not be sampled (their token is 0).
    Every greedy row without logit controls comes from one ``argmax`` over the batch."""
    tokens, errors = [0] * len(samplers), {}
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy and s.processor is None]
    # a row's maximum is NaN or infinite where the row is unusable; masked -inf entries below
    # a finite maximum are fine for argmax
    rows = logits if len(greedy) == len(samplers) else logits[greedy]  # a copy: only if mixed
    if greedy and np.isfinite(rows.max(axis=1)).all():
        for i, t in zip(greedy, np.argmax(rows, axis=1).tolist()):
            tokens[i] = t
    else:
        greedy = []  # non-finite logits: each sampler says which row (SamplingError)
    done = set(greedy)
    for i, sampler in enumerate(samplers):
        if i not in done:
            try:
                tokens[i] = sampler.sample(logits[i])
            except Exception as e:  # noqa: BLE001 - that row's failure (NaN logits...)
                errors[i] = e
    return tokens, errors


def filtered_probs(logits: np.ndarray, params: SamplingParams):
    """``(ids int64 [m], probs float64 [m])``: the candidates the filters leave, renormalised.

    The order of ``ids`` is unspecified.
    """
    x, top = _checked_logits(logits)
    ids, weights = _candidates(x, params, top, np.empty(len(x), np.float32))
    return ((np.arange(len(x)) if ids is None else ids),
            weights.astype(np.float64) / weights.sum(dtype=np.float64))


def _candidates(x: np.ndarray, params: SamplingParams, top: float, work: np.ndarray):
    """``(ids, or None for the whole vocabulary; unnormalised float32 weights, max 1)``.

    ``work`` (float32, ``len(x)``) receives the weights when no top-k applies.
    """
    ids = _top_k_ids(x, params.top_k) if 0 < params.top_k < len(x) else None
    weights = work if ids is None else np.empty(len(ids), np.float32)
    np.subtract(x if ids is None else x[ids], top, out=weights, casting="unsafe")
    # exponents <= 0: a tiny temperature sends them to -inf (weight 0), never to +inf; one
    # below float32's range divides as its smallest normal (not by 0: the maximum's 0 / 0)
    with np.errstate(over="ignore"):
        weights /= max(np.float32(params.temperature), _F32_TINY)
    np.exp(weights, out=weights)
    if params.min_p > 0:  # the weights are probabilities over the most likely one's (1)
        keep = np.flatnonzero(weights >= np.float32(params.min_p))
        ids, weights = (keep if ids is None else ids[keep]), weights[keep]
    if params.top_p < 1:
        keep = _nucleus(weights, params.top_p)
        ids, weights = (keep if ids is None else ids[keep]), weights[keep]
    return ids, weights


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the ``k`` largest entries; ties at the boundary go to the lowest ids.

    A large vocabulary is first narrowed to the entries at least the k-th largest of its chunk
    maxima (k distinct entries reach that value, so it bounds the k-th largest from below): a
    partition of the whole vocabulary costs ten times the two passes this takes."""
    chunk = len(x) // (_TOP_K_CHUNKS * k)
    if chunk >= 8:
        maxima = np.maximum.reduceat(x, np.arange(0, len(x), chunk))
        bound = np.partition(maxima, len(maxima) - k)[len(maxima) - k]
        near = np.flatnonzero(x >= bound)  # ascending: ties keep their order
        return near[_top_k_ids(x[near], k)] if len(near) < len(x) else _select(x, k)
    return _select(x, k)


def _select(x: np.ndarray, k: int) -> np.ndarray:
    threshold = np.partition(x, len(x) - k)[len(x) - k]
    above = np.flatnonzero(x > threshold)
    ties = np.flatnonzero(x == threshold)[: k - len(above)]
    return np.sort(np.concatenate([above, ties]))


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of highest weights (ties: lowest index) holding ``top_p`` of
    the mass.

    Only weights of at least half ``(1 - top_p) * total / len`` can be in it (all lighter ones
    together hold under ``1 - top_p`` of the mass), usually a small part of the vocabulary."""
    total = float(weights.sum(dtype=np.float64))
    target = (top_p - _NUCLEUS_EPS) * total
    heavy = np.flatnonzero(weights >= 0.5 * (1 - top_p) * total / len(weights))
    if len(heavy) < len(weights):
        return heavy[_nucleus_among(weights[heavy], target)]
    return _nucleus_among(weights, target)


def _nucleus_among(weights: np.ndarray, target: float) -> np.ndarray:
    """Indices of the fewest highest float32 ``weights`` (ties: lowest index) reaching
    ``target``.

    A non-negative float32's bits, read as an integer, grow with its value: the top 16 bits
    (exponent and 7 bits of mantissa) bucket the candidates by weight, 1 % apart.  The bucket
    where the mass, heaviest first, crosses ``target`` is kept (all heavier ones are inside),
    then split again by its low 16 bits, and what is left sorted: a flat distribution (most of
    the vocabulary in the nucleus) costs a few passes, not a sort of the vocabulary."""
    cand, w = np.arange(len(weights)), np.ascontiguousarray(weights, np.float32)
    bits = w.view(np.int32)
    inside, inside_mass = [], 0.0
    for shift in (16, 0):
        if len(cand) <= _NUCLEUS_SORT:
            break
        key = bits >> shift
        key -= key.min()
        # float64 weights: bincount converts float32 ones on a path five times slower
        mass = np.bincount(key, weights=w.astype(np.float64))
        cum = inside_mass + np.cumsum(mass[::-1])  # heaviest first
        j = min(int(np.searchsorted(cum, target)), len(cum) - 1)
        bucket = len(cum) - 1 - j
        inside.append(cand[key > bucket])
        inside_mass = float(cum[j - 1]) if j else inside_mass
        keep = key == bucket
        cand, w, bits = cand[keep], w[keep], bits[keep]
    order = np.argsort(-w, kind="stable")  # cand ascends: ties keep low ids
    cum = inside_mass + np.cumsum(w[order], dtype=np.float64)
    n = min(int(np.searchsorted(cum, target)) + 1, len(order))
    return np.concatenate(inside + [cand[order[:n]]])


def _draw(weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to ``weights`` (>= 0, some > 0), from ``u`` in
    [0, 1).  Two levels (chunk sums, then one chunk) because a long ``np.cumsum`` is slow."""
    if len(weights) <= _CHUNK:
        return _pick(weights, u)[0]
    n_full = len(weights) // _CHUNK * _CHUNK
    sums = weights[:n_full].reshape(-1, _CHUNK).sum(axis=1, dtype=np.float64)
    if n_full < len(weights):
        sums = np.append(sums, weights[n_full:].sum(dtype=np.float64))
    j, u_inner = _pick(sums, u)
    return j * _CHUNK + _pick(weights[j * _CHUNK:(j + 1) * _CHUNK], u_inner)[0]


def _pick(weights: np.ndarray, u: float) -> tuple[int, float]:
    """``(i, v)``: inverse CDF of ``weights`` at ``u``; ``v`` in [0, 1) is where ``u`` fell inside
    entry ``i`` (uniform again, for a second-level draw).  Never returns a zero-weight entry."""
    cdf = np.cumsum(weights, dtype=np.float64)
    target = u * cdf[-1]
    i = int(np.searchsorted(cdf, target, side="right"))
    if i >= len(weights):  # u * total rounded up to the total
        i = int(np.flatnonzero(weights)[-1])
    low = cdf[i - 1] if i else 0.0
    return i, min(max((target - low) / weights[i], 0.0), _BELOW_ONE)


def _checked_logits(logits) -> tuple[np.ndarray, float]:
    """The logits as an array and their maximum; :class:`SamplingError` for anything unusable."""
    try:
        x = np.asarray(logits)
    except (TypeError, ValueError) as e:  # ragged nesting
        raise SamplingError(f"logits must be a 1-D float vector [vocab_size], got "
                            f"{type(logits).__name__} ({e})") from e
    if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.floating):
        raise SamplingError(f"logits must be a non-empty 1-D float vector [vocab_size], got "
                            f"{x.dtype} of shape {x.shape}; pass one row of the model's logits")
    top = float(np.max(x))  # NaN propagates through max
    if math.isnan(top):
        first = int(np.flatnonzero(np.isnan(x))[0])
        raise SamplingError(f"logits contain NaN (first at token {first}); the model produced "
                            "invalid values: check the weights and cache_dtype")
    if math.isinf(top):
        what = "+inf" if top > 0 else "only -inf"
        raise SamplingError(f"logits contain {what}; cannot form a distribution over the "
                            "vocabulary: pass finite logits (check the weights and cache_dtype)")
    return x, top
