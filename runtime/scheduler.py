"""Continuous batching over one pool: requests join and leave at any step.

Each :meth:`Scheduler.step`:

1. admits waiting requests, first come first served, while fewer than ``max_running`` run and
   the pool has blocks for the next one's tokens;
2. prefills admitted prompts in chunks, at most ``prefill_budget`` prompt tokens per step in
   all, so a long prompt does not stall the sequences already decoding;
3. runs one batched decode step (:class:`~paged_decode.runtime.step.BatchDecodeSession`) over
   every decoding sequence, ``max_rows`` at a time;
4. samples each row with its request's own parameters (greedy rows with one ``argmax``), and
   finishes a request at a stop id, at its ``max_tokens`` or when cancelled.

With the prefix cache on, a finished request's full blocks stay cached by their tokens
(:mod:`.prefix_cache`) and a new request that begins with them prefills only the rest; cached
blocks nothing else holds are evicted, least recently used, before anything is preempted.
When a step needs a block the pool does not have, the newest running request is preempted: its
blocks are freed, its tokens kept, and it waits at the head of the queue to be prefilled again
(recomputed) once blocks free up.  No other sequence is touched.  A request that could never fit
the artifact or the pool is refused when it is added.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from .checks import is_int
from .errors import CapacityError, InputError, OutOfBlocksError
from .kv_pool import PagedKVCache, SessionHandle
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .session import check_prompt
from .step import BatchDecodeSession

_IDS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation: its prompt, limits and sampler, and what it produced so far.

    ``tokens``: generated ids; ``finish_reason``: None while it runs, then ``"stop"`` (a stop
    id), ``"length"`` (``max_tokens``) or ``"cancelled"``.  ``first_token_s`` / ``token_times``:
    ``time.perf_counter()`` at its first and every token (time to first token, inter-token
    latency)."""

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first_token_s(self) -> float | None:
        return self.token_times[0] - self.submitted_s if self.token_times else None


class Scheduler:
    """Admits, steps and retires requests over one (artifact, weights, pool).

    Single-threaded: one caller drives :meth:`step` (the batching engine runs it on its own
    thread and hands requests over through a queue).
    """

    def __init__(self, artifact, weights, pool: PagedKVCache, *, max_running: int | None = None,
                 prefill_budget: int = 512, prefix_cache: bool = True):
        self.session = BatchDecodeSession(artifact, weights, pool)
        self.cache = PrefixCache(pool) if prefix_cache else None
        self.artifact, self.pool = artifact, pool
        rows = self.session.max_rows
        self.max_running = rows if max_running is None else max_running
        if not is_int(self.max_running) or self.max_running < 1:
            raise InputError(f"max_running={max_running!r}: must be a positive integer")
        if not is_int(prefill_budget) or prefill_budget < 1:
            raise InputError(f"prefill_budget={prefill_budget!r}: must be a positive integer "
                             "(prompt tokens prefilled per step)")
        self.prefill_budget = int(prefill_budget)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.steps = 0
        self.preemptions = 0

    # -- requests -----------------------------------------------------------------------------
    def add(self, prompt_ids, max_tokens: int = 64, sampling: SamplingParams | None = None,
            stop_ids=()) -> Request:
        """Queue a request (:meth:`make_request`)."""
        req = self.make_request(prompt_ids, max_tokens, sampling, stop_ids)
        self.waiting.append(req)
        return req

    def add_forks(self, prompt_ids, n: int, max_tokens: int = 64,
                  sampling: SamplingParams | None = None, stop_ids=()) -> list[Request]:
        """Queue ``n`` continuations of one prompt (:meth:`make_forks`)."""
        group = self.make_forks(prompt_ids, n, max_tokens, sampling, stop_ids)
        self.waiting.extend(group)
        return group

    def make_forks(self, prompt_ids, n: int, max_tokens: int = 64,
                   sampling: SamplingParams | None = None, stop_ids=()) -> list[Request]:
        """``n`` requests over one prompt, prefilled once: the first prefills it, the others
        fork its sequence then (sharing the prompt's blocks; the partly filled last block is
        copied when a continuation first writes it).  Continuation ``i`` samples with seed
        ``seed + i`` (fresh entropy each without a seed)."""
        if not is_int(n) or n < 1:
            raise InputError(f"n={n!r}: must be a positive integer (continuations)")
        params = sampling or SamplingParams()
        head = self.make_request(prompt_ids, max_tokens, params, stop_ids)
        group = [head]
        for i in range(1, int(n)):
            seeded = (params if params.seed is None
                      else dataclasses.replace(params, seed=params.seed + i))
            child = Request(head.prompt, head.max_tokens, Sampler(seeded), head.stop_ids,
                            fork_of=head)
            head.forks.append(child)
            group.append(child)
        return group

    def make_request(self, prompt_ids, max_tokens: int = 64,
                     sampling: SamplingParams | None = None, stop_ids=()) -> Request:
        """A request checked up front, not queued (bad values: :class:`InputError`; one that
        can never fit: :class:`CapacityError` naming the capacity).  Reads nothing that a step
        changes, so any thread may call it."""
        ids = [int(t) for t in check_prompt(prompt_ids, self.artifact.manifest.vocab_size)]
        if not is_int(max_tokens) or max_tokens < 1:
            raise InputError(f"max_tokens={max_tokens!r}: must be a positive integer")
        need = len(ids) + int(max_tokens) - 1  # the last token is never written
        cap = self.artifact.max_tokens
        if need > cap:
            raise CapacityError(f"the prompt ({len(ids)} tokens) and max_tokens {max_tokens} "
                                f"need {need} KV slots, a sequence of this artifact holds {cap}; "
                                "shorten the prompt or lower max_tokens")
        blocks = -(-need // self.pool.block_size)
        if blocks > self.pool.num_blocks:
            raise CapacityError(f"the request needs {blocks} KV blocks, the pool has "
                                f"{self.pool.num_blocks}; allocate a larger pool")
        stop = frozenset(int(t) for t in stop_ids)
        req = Request(ids, int(max_tokens), Sampler(sampling), stop)
        req.pending = list(ids)
        return req

    def cancel(self, req: Request) -> None:
        """Finish ``req`` as ``"cancelled"`` at once, freeing its blocks (a finished request is
        left as it is)."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int]]:
        """Admit, prefill a chunk, decode one token of every decoding request; returns the
        ``(request, token)`` pairs produced, in order."""
        self._admit()
        out = self._prefill_chunks()
        decoding = [r for r in self.running if not r.pending and not r.finished]
        for start in range(0, len(decoding), self.session.max_rows):
            rows = decoding[start:start + self.session.max_rows]
            out += self._decode([r for r in rows if r.handle is not None])  # not preempted
        self.steps += 1
        return out

    def _blocks_for(self, req: Request) -> int:
        return -(-(len(req.pending) + 1) // self.pool.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if req.fork_of is not None:
                if req.fork_of.pending and req.fork_of.handle is not None:
                    break  # forked from its prompt's sequence once that is prefilled
                # that sequence is gone or past its prompt: prefill the prompt itself
                req.fork_of, req.pending = None, list(req.prompt)
            forks = self._unforked(req)
            room = self.max_running - len(self.running) - 1 - len(forks)
            need = self._blocks_for(req) + len(forks)  # + a copy of the last block per fork
            if need > self.pool.num_free:
                self._make_room(need - self.pool.num_free)
            if self.running and (room < 0 or need > self.pool.num_free):
                break  # wait for running requests to finish and free blocks
            self.waiting.pop(0)
            self.running.append(req)
            self._start(req)

    def _start(self, req: Request) -> None:
        """A sequence for ``req``: over the cached blocks its tokens begin with, if any."""
        cached = self.cache.match(req.pending) if self.cache is not None else []
        if cached:
            n = len(cached) * self.pool.block_size
            req.handle = self.pool.adopt(cached, n)
            del req.pending[:n]
        else:
            req.handle = self.pool.new_sequence()

    def _make_room(self, n: int) -> bool:
        """Evict up to ``n`` cached blocks nothing else holds; whether any was freed."""
        return self.cache is not None and self.cache.evict(n) > 0

    def _unforked(self, head: Request) -> list[Request]:
        return [r for r in head.forks if r.fork_of is head and r in self.waiting]

    def _prefill_chunks(self) -> list[tuple[Request, int]]:
        out, budget = [], self.prefill_budget
        for req in [r for r in self.running if r.pending]:
            if budget == 0:
                break
            if req.handle is None:  # preempted by an earlier chunk of this step
                continue
            chunk = req.pending[:budget]
            try:
                logits = self.session._single.prefill(req.handle, chunk)
            except OutOfBlocksError as e:
                if not (self._make_room(e.requested) or self._preempt(keep=req)):
                    raise
                continue
            del req.pending[:len(chunk)]
            budget -= len(chunk)
            if not req.pending:
                group = [req] + self._fork_waiting(req)
                out += self._emit(group, np.repeat(logits[None], len(group), axis=0))
        return out

    def _fork_waiting(self, head: Request) -> list[Request]:
        """The continuations of ``head`` still waiting, now running on forks of its sequence
        (from here on each is a request like any other)."""
        forks = self._unforked(head)
        for r in forks:
            self.waiting.remove(r)
            r.handle, r.fork_of = head.handle.fork(), None
            self.running.append(r)
        return forks

    def _decode(self, rows: list[Request]) -> list[tuple[Request, int]]:
        while rows:
            try:
                logits = self.session.step([r.handle for r in rows], [r.tokens[-1] for r in rows])
            except OutOfBlocksError as e:
                if self._make_room(e.requested):
                    continue
                victim = self._preempt()
                if victim is None:
                    raise
                rows = [r for r in rows if r is not victim]
                continue
            return self._emit(rows, logits)
        return []

    def _preempt(self, keep: Request | None = None) -> Request | None:
        """Free the newest running request's blocks and queue it first for recompute; None when
        no other request runs (``keep`` is the one that needs the blocks)."""
        victims = [r for r in self.running if r is not keep]
        if not victims:
            return None
        victim = victims[-1]
        self.running.remove(victim)
        victim.handle.release()
        victim.handle = None
        victim.pending = victim.prompt + victim.tokens
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, victim)
        return victim

    def _emit(self, rows: list[Request], logits: np.ndarray) -> list[tuple[Request, int]]:
        tokens = self._sample(rows, logits)
        now = time.perf_counter()
        out = []
        for req, token in zip(rows, tokens):
            req.tokens.append(token)
            req.token_times.append(now)
            out.append((req, token))
            if token in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.tokens) >= req.max_tokens:
                self._finish(req, "length")
        return out

    @staticmethod
    def _sample(rows: list[Request], logits: np.ndarray) -> list[int]:
        """One token per row: every greedy row from one ``argmax`` over the batch, the others
        through their own seeded sampler."""
        greedy = [i for i, r in enumerate(rows) if r.sampler.params.greedy]
        tokens = [0] * len(rows)
        if greedy and np.isfinite(logits[greedy]).all():
            for i, t in zip(greedy, np.argmax(logits[greedy], axis=1)):
                tokens[i] = int(t)
        else:
            greedy = []  # non-finite logits: each sampler says which row (SamplingError)
        for i, r in enumerate(rows):
            if i not in greedy:
                tokens[i] = r.sampler.sample(logits[i])
        return tokens

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.handle is not None:
            if self.cache is not None:  # the tokens whose K/V the sequence holds
                written = (req.prompt + req.tokens)[:req.handle.length]
                self.cache.insert(written, req.handle.blocks)
            req.handle.release()
            req.handle = None
