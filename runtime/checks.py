"""Type checks shared by the user-facing validators of the runtime."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from .errors import InputError


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python, never a count
    or a token id here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(value, name: str, lo: int, hi: int | None = None, error=InputError) -> int:
    """``value`` as an int in ``[lo, hi]`` (no upper bound where ``hi`` is None), else ``error``
    naming ``name`` and the range."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        rule = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise error(f"{name}={value!r}: must be an integer {rule}")
    return int(value)


def check_array(value, name: str, dtype, shape: tuple, error=InputError) -> np.ndarray:
    """``value`` if it is a plain ``numpy.ndarray`` of ``dtype`` and ``shape`` (``None`` in
    ``shape``: any length on that axis), else ``error`` naming ``name``, what it got and the
    fix.  Subclasses (``np.matrix``, masked arrays) are refused: their indexing keeps two
    dimensions or hides entries, so a check made on them does not hold for what is read."""
    dtype = np.dtype(dtype)
    want = "(" + ", ".join("n" if d is None else str(d) for d in shape) + ("," if len(shape) == 1
                                                                          else "") + ")"
    fix = f"pass np.ascontiguousarray(..., dtype=np.{dtype.name}) of shape {want}"
    if type(value) is not np.ndarray:
        raise error(f"{name} must be a numpy.ndarray, got {type(value).__name__}; {fix}")
    if value.dtype != dtype:
        raise error(f"{name} has dtype {value.dtype}, expected {dtype.name}; {fix}")
    if value.ndim != len(shape) or any(d is not None and g != d
                                       for g, d in zip(value.shape, shape)):
        raise error(f"{name} has shape {value.shape}, expected {want}; {fix}")
    return value


def check_stop_ids(stop_ids, name: str = "stop_ids") -> set[int]:
    """Stop ids as a set of ints (ids the model never samples are allowed: they never match);
    ``name``: the argument as the caller knows it."""
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
        raise InputError(f"{name}={stop_ids!r}: must be an iterable of token ids; pass () "
                         "for none")
    stop = list(stop_ids)
    bad = [t for t in stop if not is_int(t)]
    if bad:
        raise InputError(f"{name}: {bad[0]!r} is a {type(bad[0]).__name__}, not an integer; "
                         "pass int token ids")
    return {int(t) for t in stop}
