"""A request of the scheduler: its prompt, limits and sampler, and what it produced so far."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import NamedTuple

import numpy as np

from .kv_pool import SessionHandle
from .sampling import Sampler

_IDS = itertools.count(1)
MAX_TOP_LOGPROBS = 20  # as the OpenAI API allows


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model's own distribution (the logits as
    computed: before temperature, top-k / top-p and any grammar mask), with the ``top`` most
    likely ``(token, logprob)`` pairs, most likely first."""

    token: int
    logprob: float
    top: tuple


@dataclasses.dataclass(eq=False)
class Request:
    """One generation: its prompt, limits and sampler, and what it produced so far.

    ``tokens``: generated ids; ``finish_reason``: None while it runs, then ``"stop"`` (a stop
    id), ``"length"`` (``max_tokens``), ``"cancelled"`` or ``"error"``.  ``first_token_s`` /
    ``token_times``: ``time.perf_counter()`` at its first and every token (time to first
    token, inter-token latency).  ``top_logprobs``: None, or how many alternatives each
    :class:`TokenLogprob` in ``logprobs`` lists; ``constraint``: a grammar the tokens must
    follow (:mod:`.grammar`)."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset
    id: int = dataclasses.field(default_factory=lambda: next(_IDS))
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    submitted_s: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    handle: SessionHandle | None = None
    pending: list[int] = dataclasses.field(default_factory=list)  # still to prefill
    # a continuation of another request's prompt (``add(..., n=K)``): it shares that request's
    # prompt blocks (forked when the prompt is prefilled) instead of prefilling its own
    fork_of: "Request | None" = None
    forks: list = dataclasses.field(default_factory=list)
    top_logprobs: int | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    constraint: object | None = None
    error: Exception | None = None  # why it finished as "error"
    hashes: list = dataclasses.field(default_factory=list)  # of its full blocks (prefix cache)
    cached_tokens: int = 0  # prompt tokens its first prefill found in the prefix cache
    drafter: object | None = None  # with speculative decoding on (.speculative's drafters)
    drafted: int = 0  # tokens drafted for it, and how many of them verification accepted
    accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] - self.submitted_s if self.token_times else None


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-softmax in ``row`` (float32 logits ``[vocab_size]``) and the ``top``
    most likely tokens (ties: lowest id first)."""
    x = row.astype(np.float64)
    high = x.max()
    lse = high + np.log(np.exp(x - high).sum())
    ids = np.argpartition(-x, top)[:top] if 0 < top < len(x) else np.arange(len(x))[:top]
    ids = sorted(ids.tolist(), key=lambda t: (-x[t], t))
    return TokenLogprob(int(token), float(x[token] - lse),
                        tuple((t, float(x[t] - lse)) for t in ids))
