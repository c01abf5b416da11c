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
    text: "StopStrings | None" = None  # its decoded text, when it has stop strings or a reader

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] - self.submitted_s if self.token_times else None


class StopStrings:
    """A request's decoded text, ended at the first of its stop strings.

    :meth:`push` takes every token the scheduler records, in order, and says whether the text
    now holds a stop string; the scheduler ends the request at that token (``Scheduler._ends``),
    so a stop string ends a request where a stop id does: its tokens stop there, also when
    verification accepted drafted tokens past it.  A reader of the text (the batching engine's
    streams) takes ``text[:ready(n)]`` after the ``n``-th token: what no later token can still
    turn into the start of a stop string."""

    def __init__(self, decoder, stops: tuple[str, ...], stop_ids: frozenset):
        self._decoder, self.stops, self._stop_ids = decoder, tuple(stops), stop_ids
        self._hold = max((len(s) - 1 for s in self.stops), default=0)
        self.text = ""
        self.cut = False  # a stop string ended the text
        self._after: list[int] = []  # the text's length after each token

    def push(self, token: int) -> bool:
        if not self.cut and token not in self._stop_ids:  # a stop id has no text
            self.text += self._decoder.push(token)
            at = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
            if at >= 0:
                self.text, self.cut = self.text[:at], True
        self._after.append(len(self.text))
        return self.cut

    def ready(self, n: int) -> int:
        """How much of the text is final once ``n`` tokens are in."""
        upto = self._after[n - 1] if n else 0
        return upto if self.cut and n == len(self._after) else max(upto - self._hold, 0)

    def flush(self) -> None:
        """The end of the request: the decoder's held bytes become text (unless a stop ended
        it)."""
        if not self.cut:
            self.text += self._decoder.flush()
            if self._after:
                self._after[-1] = len(self.text)


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
