"""Type checks shared by the user-facing validators of the runtime."""

from __future__ import annotations

import numbers

import numpy as np


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python, never a count
    or a token id here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
