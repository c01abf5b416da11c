"""Speculative decoding: a drafter proposes the next tokens of a sequence, one step computes
the logits of every proposed position (a verification row of the step runner), and the
sampler keeps the longest prefix it agrees with plus one token of its own.

The drafter here is prompt lookup (llama.cpp's lookup decoding, vLLM's ``ngram``): the
continuation of the most recent earlier occurrence of the sequence's last ``n`` tokens,
longest ``n`` first.  It needs no second model and pays off where the output repeats the
input (summaries, rewrites, code edits).

How many tokens to draft is chosen per step from what a verification costs and what it is
likely to earn: with per-token acceptance ``a`` (estimated per match length from what was
accepted so far) ``k`` drafted tokens yield ``(1 - a^(k+1)) / (1 - a)`` tokens on average, for
the call time of ``k + 1`` token rows (the runner's measured mean per plan, a prior until a
plan ran).  Drafting stops by itself where acceptance is low: ``k = 0`` (a plain decode) wins.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .checks import is_int
from .errors import InputError

if TYPE_CHECKING:
    from .request import Request

METHODS = ("ngram", "draft")
MAX_DRAFT_TOKENS = 31  # one verification row per token of the largest default bucket (32)
# call time of a plan of B token rows over the B = 1 decode's, until the runner measured it
# (SmolLM2 Q4_1 on a 2-core x86: 1.2x for 2 rows, 1.6x for 4, 2.4x for 8)
PRIOR_COST = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 3.6, 32: 6.0}
_DECAY = 0.9  # weight of earlier verifications in the acceptance estimate
# a longer draft must promise this much more per unit of time: the host's work per drafted
# token (lookup, sampling each verified position) is not in the measured call times
_MARGIN = 1.1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (prompt lookup) or ``"draft"`` (a smaller model with the same
    tokenizer, ``draft_model``: a :class:`~.draft_model.DraftModel`); ``draft_tokens``: the most
    tokens drafted per step; ``ngram_max`` / ``ngram_min``: the match lengths tried, longest
    first; ``adaptive``: size each draft by cost and acceptance (False: always as many as
    ``draft_tokens``, the room and the proposal allow)."""

    method: str = "ngram"
    draft_tokens: int = 7
    ngram_max: int = 4
    ngram_min: int = 1
    draft_model: object | None = None
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise InputError(f"speculative method {self.method!r}: known methods are "
                             f"{', '.join(METHODS)}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise InputError(f"speculative method {self.method!r} with draft_model="
                             f"{self.draft_model!r}: the draft method takes a DraftModel "
                             "(DraftModel.load(artifact_dir, weights_dir)), ngram none")
        if not is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise InputError(f"draft_tokens={self.draft_tokens!r}: must be an integer from 1 to "
                             f"{MAX_DRAFT_TOKENS}")
        if not (is_int(self.ngram_min) and is_int(self.ngram_max)
                and 1 <= self.ngram_min <= self.ngram_max <= 16):
            raise InputError(f"ngram_min={self.ngram_min!r}, ngram_max={self.ngram_max!r}: need "
                             "1 <= ngram_min <= ngram_max <= 16")


class NgramDrafter:
    """One sequence's prompt lookup: an index from every n-gram of its tokens to where its
    latest occurrence ended, extended as tokens arrive, and its acceptance per match length."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._index: dict[tuple, int] = {}
        self._seen = 0  # tokens indexed: every n-gram followed by one of them is in the index
        self._stats = {n: [1.0, 1.0] for n in range(config.ngram_min, config.ngram_max + 1)}
        self.match = 0  # the match length of the last proposal (0: none)

    def _extend(self, tokens: Sequence[int]) -> None:
        lo, hi = self.config.ngram_min, self.config.ngram_max
        for end in range(max(self._seen, 1), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                self._index[tuple(tokens[end - n:end])] = end
        self._seen = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (the whole sequence so far)."""
        self._extend(tokens)
        self.match = 0
        for n in range(min(self.config.ngram_max, len(tokens) - 1), self.config.ngram_min - 1,
                       -1):
            end = self._index.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                self.match = n
                return list(tokens[end:end + k])
        return []

    def plan(self, tokens: Sequence[int], room: int, verify_cost, decode_s=None) -> list[int]:
        """The tokens to verify this step: the proposal, cut where more would not pay for
        their verification (``verify_cost(rows)``: a call's time relative to one decode)."""
        proposal = self.propose(tokens, room)
        if verify_cost is None:  # not adaptive
            return proposal
        return proposal[:best_length(self.acceptance(), len(proposal), verify_cost)]

    def close(self) -> None:
        """The request ended (nothing held)."""

    def acceptance(self) -> float:
        """Estimated chance that a drafted token is accepted, for the last proposal's match."""
        if not self.match:
            return 0.0
        accepted, rejected = self._stats[self.match]
        return accepted / (accepted + rejected)

    def record(self, drafted: int, accepted: int) -> None:
        """What verification made of the last proposal's first ``drafted`` tokens."""
        stats = self._stats[self.match]
        stats[0] = _DECAY * stats[0] + accepted
        stats[1] = _DECAY * stats[1] + (accepted < drafted)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification of ``k`` drafted tokens yields on average (the accepted
    prefix and the sampler's own next token)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_length(acceptance: float, available: int, cost) -> int:
    """The number of drafted tokens (0 to ``available``) with the most tokens per unit of
    time; ``cost(rows)`` is a call's time over ``rows`` token rows relative to one row."""
    best, best_rate = 0, 1.0
    for k in range(1, available + 1):
        rate = expected_tokens(acceptance, k) / cost(k + 1)
        if rate > best_rate * _MARGIN:
            best, best_rate = k, rate
    return best


class SpeculativeSteps:
    """The scheduler's part in speculative decoding: what each decoding request drafts for a
    step, and what its verification row yields (``Scheduler`` mixes it in; it uses the
    scheduler's ``runner``, ``speculative`` and its ``_take`` / ``_ends`` / ``_fail`` /
    ``_finish``)."""

    def _drafts(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """Tokens to verify per request this step.  One stream drafts as many as pay for their
        verification; several fill only the rows their call's bucket would pad."""
        if self.speculative is None or not reqs:
            return {}
        spare = (self.runner.max_rows - 1 if len(reqs) == 1
                 else sum(self.runner.calls_for(len(reqs))) - len(reqs))
        out = {}
        # several streams: the spare rows cost nothing more
        cost = self._cost if len(reqs) == 1 else (lambda _rows: 1.0)
        if not self.speculative.adaptive:
            cost = None
        elif len(reqs) == 1 and self.runner.seconds.get(1) is None:
            return {}  # a plain step first: the decode every cost is weighed against
        for req in reqs:
            room = min(spare, self.speculative.draft_tokens,
                       req.max_tokens - len(req.tokens) - 1)
            if room <= 0:
                continue
            if req.drafter is None:
                req.drafter = self._new_drafter()
            draft = req.drafter.plan(req.prompt + req.tokens, room, cost,
                                     self.runner.seconds.get(1))
            if draft:
                out[req] = draft
                spare -= len(draft)
        return out

    def _new_drafter(self):
        config = self.speculative
        if config.method == "draft":
            return config.draft_model.drafter(self.max_running)
        return NgramDrafter(config)

    def _cost(self, rows: int) -> float:
        """A call over ``rows`` token rows, relative to one decode (measured once both ran)."""
        one, many = self.runner.seconds.get(1), self.runner.cost(rows)
        if one and many:
            return many / one
        return sum(PRIOR_COST.get(b, float(b)) for b in self.runner.calls_for(rows))

    def _emit_verified(self, req: Request, logits: np.ndarray, draft: list[int]
                       ) -> list[tuple[Request, int]]:
        """The tokens of a verification row: position ``i``'s token is sampled as without
        speculation (given drafted token ``i``, :meth:`Sampler.sample_draft`), and the row
        goes on while it equals the draft; the sequence then drops what the rejected drafts
        wrote, before anything can end the request."""
        out, reason, now = [], None, time.perf_counter()
        try:
            for i, row in enumerate(logits):
                if req.constraint is not None:
                    row = np.where(req.constraint.allowed(), row, np.float32(-np.inf))
                token = (req.sampler.sample_draft(row, draft[i]) if i < len(draft)
                         else req.sampler.sample(row))
                self._take(req, token, logits[i], now)
                out.append((req, token))
                reason = self._ends(req, token)
                if reason or i == len(draft) or token != draft[i]:
                    break
        except Exception as e:  # noqa: BLE001 - that request's failure
            self._verified(req, draft, len(out))
            self._fail(req, e)
            return out
        self._verified(req, draft, len(out))
        if reason:
            self._finish(req, reason)
        return out

    def _verified(self, req: Request, draft: list[int], taken: int) -> None:
        accepted = sum(1 for t, d in zip(req.tokens[len(req.tokens) - taken:], draft) if t == d)
        req.handle.truncate_to(len(req.prompt) + len(req.tokens) - 1)
        req.drafter.record(len(draft), accepted)
        req.drafted += len(draft)
        req.accepted += accepted
        self.drafted_tokens += len(draft)
        self.accepted_tokens += accepted
