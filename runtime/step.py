"""Batched decode steps: one new token for each of many sequences of one pool, per call.

``BatchDecodeSession`` is the step runner (:mod:`.runner`) with the one-token-per-sequence
call of earlier releases: ``step(handles, token_ids)`` is ``run([Row(h, [t]), ...])``.  A step
over ``n`` sequences runs the smallest bucket ``B >= n`` (``n == 1`` runs the B = 1
``decode``); each bucket's plan is built the first time it runs and held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import InputError
from .kv_pool import SessionHandle
from .runner import Row, StepRunner


class BatchDecodeSession(StepRunner):
    """The step runner, stepping one token per sequence (see :class:`StepRunner`)."""

    def step(self, handles: Sequence[SessionHandle], token_ids: Sequence[int]) -> np.ndarray:
        """Decode ``token_ids[i]`` as the next token of ``handles[i]`` for every i, in one
        compiled call; returns logits ``(n, vocab) float32``.  On any error every handle
        (length and blocks) and the allocator are as they were."""
        if len(handles) != len(token_ids) or not handles:
            raise InputError(f"{len(handles)} handles and {len(token_ids)} token ids: a step "
                             "takes one token per sequence, at least one")
        if len(handles) > self.max_rows:
            self.bucket_for(len(handles))  # the error naming the buckets
        rows = [Row(h, [t]) for h, t in zip(handles, token_ids)]
        return np.concatenate(self.run(rows))
