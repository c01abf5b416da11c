"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), seeded.

Order of the filters: scale by the temperature, keep the ``top_k`` most likely tokens, keep the
smallest prefix of those (by probability) whose mass reaches ``top_p``, renormalise, draw.  Ties
go to the lowest token id everywhere (argmax, the top-k boundary, the nucleus order).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from paged_decode.runtime.checks import is_int
from paged_decode.runtime.errors import SamplingError

_NUCLEUS_EPS = 1e-9  # cumulative mass within this of top_p counts as reaching it (float rounding)
_CHUNK = 1024  # entries per first-level bucket of the inverse-CDF draw
_BELOW_ONE = float(np.nextafter(1.0, 0.0))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.  ``temperature == 0`` means greedy (the other fields unused).

    ``top_k == 0`` disables top-k; ``top_p == 1`` disables the nucleus; ``seed=None`` draws fresh
    OS entropy.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws token ids from logits with its own ``np.random.Generator(params.seed)``.

    The same params (with a seed) and the same logits give the same sequence of ids.  Not safe
    to share between threads (the generator's state advances with each draw): one per stream.
    """

    def __init__(self, params: SamplingParams | None = None):
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be SamplingParams, got {type(params).__name__}; "
                                "pass SamplingParams(temperature=..., top_k=..., top_p=...)")
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._work = np.empty(0)  # float64 [vocab_size], reused: fresh large arrays page-fault

    def sample(self, logits: np.ndarray) -> int:
        """One token id from ``logits``: a 1-D float vector ``[vocab_size]`` (float32 usually)."""
        x, top = _checked_logits(logits)
        if self.params.greedy:
            return int(np.argmax(x))  # first maximum = lowest id
        if len(self._work) != len(x):
            self._work = np.empty(len(x))
        ids, weights = _candidates(x, self.params, top, self._work)
        i = _draw(weights, self._rng.random())
        return i if ids is None else int(ids[i])


def filtered_probs(logits: np.ndarray, params: SamplingParams):
    """``(ids int64 [m], probs float64 [m])``: the candidates the filters leave, renormalised.

    The order of ``ids`` is unspecified.
    """
    x, top = _checked_logits(logits)
    ids, weights = _candidates(x, params, top, np.empty(len(x)))
    return (np.arange(len(x)) if ids is None else ids), weights / weights.sum()


def _candidates(x: np.ndarray, params: SamplingParams, top: float, work: np.ndarray):
    """``(ids, or None for the whole vocabulary; unnormalised float64 weights, max 1)``.

    ``work`` (float64, ``len(x)``) receives the weights when no top-k applies.
    """
    ids = _top_k_ids(x, params.top_k) if 0 < params.top_k < len(x) else None
    weights = work if ids is None else np.empty(len(ids))
    np.subtract(x if ids is None else x[ids], top, out=weights)
    weights /= params.temperature  # exponent <= 0: no overflow at a tiny temperature
    np.exp(weights, out=weights)
    if params.top_p < 1:
        keep = _nucleus(weights, params.top_p)
        ids, weights = (keep if ids is None else ids[keep]), weights[keep]
    return ids, weights


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the ``k`` largest entries; ties at the boundary go to the lowest ids."""
    threshold = np.partition(x, len(x) - k)[len(x) - k]
    above = np.flatnonzero(x > threshold)
    ties = np.flatnonzero(x == threshold)[: k - len(above)]
    return np.sort(np.concatenate([above, ties]))


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of highest weights (ties: lowest index) holding ``top_p`` of
    the mass.  Lowers a cut by factors of 4: every band above the last one is wholly inside, so
    only the last band is sorted."""
    target = (top_p - _NUCLEUS_EPS) * weights.sum()
    inside, inside_mass, upper, cut = [], 0.0, np.inf, float(weights.max())
    while True:
        band = np.flatnonzero((weights >= cut) & (weights < upper))
        band_mass = float(weights[band].sum())
        if cut == 0 or inside_mass + band_mass >= target:
            break
        inside.append(band)
        inside_mass, upper = inside_mass + band_mass, cut
        cut = cut / 4 if cut > 1e-300 else 0.0
    order = band[np.argsort(-weights[band], kind="stable")]  # band ascends: ties keep low ids
    cum = inside_mass + np.cumsum(weights[order])
    n = min(int(np.searchsorted(cum, target)) + 1, len(order))
    return np.concatenate(inside + [order[:n]])


def _draw(weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to ``weights`` (>= 0, some > 0), from ``u`` in
    [0, 1).  Two levels (chunk sums, then one chunk) because a long ``np.cumsum`` is slow."""
    if len(weights) <= _CHUNK:
        return _pick(weights, u)[0]
    n_full = len(weights) // _CHUNK * _CHUNK
    sums = weights[:n_full].reshape(-1, _CHUNK).sum(axis=1)
    if n_full < len(weights):
        sums = np.append(sums, weights[n_full:].sum())
    j, u_inner = _pick(sums, u)
    return j * _CHUNK + _pick(weights[j * _CHUNK:(j + 1) * _CHUNK], u_inner)[0]


def _pick(weights: np.ndarray, u: float) -> tuple[int, float]:
    """``(i, v)``: inverse CDF of ``weights`` at ``u``; ``v`` in [0, 1) is where ``u`` fell inside
    entry ``i`` (uniform again, for a second-level draw).  Never returns a zero-weight entry."""
    cdf = np.cumsum(weights)
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
