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
