"""Continuous batching over one pool: requests join and leave at any step.

Each :meth:`Scheduler.step`:

1. admits waiting requests, first come first served, while fewer than ``max_running`` run and
   the pool has blocks for the next one's tokens;
2. prefills admitted prompts in chunks, at most ``prefill_budget`` prompt tokens per step in
   all, every prefilling request's chunk in one step of the runner (:mod:`.runner`), so a long
   prompt does not stall the sequences already decoding;
3. runs one step of the runner over every decoding sequence, ``max_rows`` at a time: one
   token each, or with speculative decoding on (:mod:`.speculative`) the drafted tokens too,
   verified in the same call;
4. samples each row with its request's own parameters (greedy rows with one ``argmax``), and
   ends a request at a stop id or stop string, at its ``max_tokens`` (:meth:`Scheduler._ends`,
   the one place) or when cancelled.

With the prefix cache on, every full block a request writes is cached by its tokens
(:mod:`.prefix_cache`) as soon as it is full, and kept after the request ends: a request that
begins with cached blocks prefills only the rest, looked up when its prefill starts, so requests
sharing a system prompt share its blocks even while they run together.  Cached blocks nothing
else holds are evicted, least recently used, before anything is preempted.
When a step needs a block the pool does not have, the newest running request is preempted: its
blocks are freed, its tokens kept, and it waits at the head of the queue to be prefilled again
(recomputed) once blocks free up.  No other sequence is touched.  A request that could never fit
the artifact or the pool is refused when it is added.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .checks import check_stop_ids, is_int
from .errors import CapacityError, InputError, NonFiniteLogitsError, OutOfBlocksError
from .kv_pool import PagedKVCache
from .prefix_cache import PrefixCache
from .request import MAX_TOP_LOGPROBS, Request, TokenLogprob, token_logprob  # noqa: F401
from .runner import Row, StepRunner
from .sampling import Sampler, SamplingParams, sample_rows
from .session import check_prompt
from .speculative import SpeculativeConfig, SpeculativeSteps


class Scheduler(SpeculativeSteps):
    """Admits, steps and retires requests over one (artifact, weights, pool).

    Single-threaded: one caller drives :meth:`step` (the batching engine runs it on its own
    thread and hands requests over through a queue).
    """

    def __init__(self, artifact, weights, pool: PagedKVCache, *, max_running: int | None = None,
                 prefill_budget: int = 512, prefix_cache: bool = True,
                 speculative: SpeculativeConfig | None = None):
        self.runner = StepRunner(artifact, weights, pool)
        self.cache = PrefixCache(pool) if prefix_cache else None
        self.artifact, self.pool = artifact, pool
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise InputError(f"speculative={speculative!r}: pass a SpeculativeConfig or None")
        if speculative is not None and not self.runner.buckets:
            raise InputError(f"speculative decoding verifies drafted tokens in the batched plans; "
                             f"artifact {artifact.path.name} has none: compile it with "
                             "--batch-buckets (the default on CPU and CUDA targets)")
        if speculative is not None and speculative.method == "draft":
            speculative.draft_model.check_pairs_with(artifact)
        self.speculative = speculative
        self.drafted_tokens = self.accepted_tokens = 0
        rows = self.runner.max_rows
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
        self.failed: list[Request] = []  # the requests the last step ended as "error"

    # -- requests -----------------------------------------------------------------------------
    def add(self, prompt_ids, max_tokens: int = 64, sampling: SamplingParams | None = None,
            stop_ids=(), **extras) -> Request:
        """Queue a request (:meth:`make_request`)."""
        req = self.make_request(prompt_ids, max_tokens, sampling, stop_ids, **extras)
        self.waiting.append(req)
        return req

    def add_forks(self, prompt_ids, n: int, max_tokens: int = 64,
                  sampling: SamplingParams | None = None, stop_ids=(), **extras
                  ) -> list[Request]:
        """Queue ``n`` continuations of one prompt (:meth:`make_forks`)."""
        group = self.make_forks(prompt_ids, n, max_tokens, sampling, stop_ids, **extras)
        self.waiting.extend(group)
        return group

    def make_forks(self, prompt_ids, n: int, max_tokens: int = 64,
                   sampling: SamplingParams | None = None, stop_ids=(), **extras
                   ) -> list[Request]:
        """``n`` requests over one prompt, prefilled once: the first prefills it, the others
        fork its sequence then (sharing the prompt's blocks; the partly filled last block is
        copied when a continuation first writes it).  Continuation ``i`` samples with seed
        ``seed + i`` (fresh entropy each without a seed) and follows its own copy of the
        constraint."""
        if not is_int(n) or n < 1:
            raise InputError(f"n={n!r}: must be a positive integer (continuations)")
        params = sampling or SamplingParams()
        head = self.make_request(prompt_ids, max_tokens, params, stop_ids, **extras)
        group = [head]
        for i in range(1, int(n)):
            seeded = (params if params.seed is None
                      else dataclasses.replace(params, seed=params.seed + i))
            sampler = Sampler(seeded, prompt=head.prompt, stop_ids=head.stop_ids)
            child = Request(head.prompt, head.max_tokens, sampler, head.stop_ids,
                            fork_of=head, top_logprobs=head.top_logprobs,
                            constraint=None if head.constraint is None
                            else head.constraint.copy())
            head.forks.append(child)
            group.append(child)
        return group

    def make_request(self, prompt_ids, max_tokens: int = 64,
                     sampling: SamplingParams | None = None, stop_ids=(), *,
                     top_logprobs: int | None = None, constraint=None) -> Request:
        """A request checked up front, not queued (bad values: :class:`InputError`; one that
        can never fit: :class:`CapacityError` naming the capacity).  Reads nothing that a step
        changes, so any thread may call it.  ``top_logprobs`` (0 to 20) records each token's
        log-probability and that many alternatives; ``constraint`` (:mod:`.grammar`) masks
        every step's logits to what a grammar admits."""
        ids = [int(t) for t in check_prompt(prompt_ids, self.artifact.manifest.vocab_size)]
        if not is_int(max_tokens) or max_tokens < 1:
            raise InputError(f"max_tokens={max_tokens!r}: must be a positive integer")
        if top_logprobs is not None and not (is_int(top_logprobs)
                                             and 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise InputError(f"top_logprobs={top_logprobs!r}: must be an integer from 0 to "
                             f"{MAX_TOP_LOGPROBS}, or None")
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
        stop = frozenset(check_stop_ids(stop_ids))
        sampler = Sampler(sampling, prompt=ids, stop_ids=stop)
        sampler.params.check_vocab(self.artifact.manifest.vocab_size)
        if sampler.params.min_tokens > max_tokens:
            raise InputError(f"min_tokens={sampler.params.min_tokens} exceeds max_tokens="
                             f"{max_tokens}; lower min_tokens or raise max_tokens")
        req = Request(ids, int(max_tokens), sampler, stop, constraint=constraint,
                      top_logprobs=None if top_logprobs is None else int(top_logprobs))
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
        ``(request, token)`` pairs produced, in order.  A request whose own sampling or
        constraint failed is finished as ``"error"`` and listed in :attr:`failed`."""
        self.failed = []
        self._admit()
        out = self._prefill_chunks()
        decoding = [r for r in self.running if not r.pending and not r.finished]
        for start in range(0, len(decoding), self.runner.max_rows):
            rows = decoding[start:start + self.runner.max_rows]
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
            cached = self.cache.peek(req.pending) if self.cache is not None else 0
            need = self._blocks_for(req) - cached + len(forks)  # + a copy of the last block
            # and a block of headroom per running sequence: admitted into the last free
            # blocks, a request is preempted as soon as one of them grows (its recompute
            # bought one token), and readmitted into the blocks it freed
            need += len(self.running)
            if need > self.pool.num_free:
                self._make_room(need - self.pool.num_free)
            if self.running and (room < 0 or need > self.pool.num_free):
                break  # wait for running requests to finish and free blocks
            self.waiting.pop(0)
            self.running.append(req)
            self._start(req)

    def _start(self, req: Request) -> None:
        req.handle = self.pool.new_sequence()

    def _adopt_cached(self, req: Request) -> None:
        """Before ``req`` prefills anything: its sequence over the cached blocks its tokens
        begin with, if any (looked up now, not at admission, to find the blocks of a request
        with the same prefix that prefilled since)."""
        cached = self.cache.match(req.pending)
        if cached:
            n = len(cached) * self.pool.block_size
            if not req.tokens:  # not a recompute after a preemption
                req.cached_tokens = min(n, len(req.prompt))
            req.handle.release()
            req.handle = self.pool.adopt(cached, n)
            del req.pending[:n]

    def _cache_written(self, req: Request, new_only: bool = False) -> None:
        """Cache the full blocks ``req``'s sequence has written (``new_only``: only if it
        filled one since the last call)."""
        if self.cache is None or req.handle is None:
            return
        n = req.handle.length
        if new_only and n // self.pool.block_size <= len(req.hashes):
            return
        self.cache.insert((req.prompt + req.tokens)[:n], req.handle.blocks, req.hashes)

    def _make_room(self, n: int) -> bool:
        """Evict up to ``n`` cached blocks nothing else holds; whether any was freed."""
        return self.cache is not None and self.cache.evict(n) > 0

    def _unforked(self, head: Request) -> list[Request]:
        return [r for r in head.forks if r.fork_of is head and r in self.waiting]

    def _prefill_chunks(self) -> list[tuple[Request, int]]:
        """One step over the next chunk of every prefilling request, within
        ``prefill_budget`` tokens in all; the requests that finished their prompt sample."""
        while True:
            chunks = self._chunks()
            if not chunks:
                return []
            try:
                logits = self.runner.run([Row(r.handle, c) for r, c in chunks])
                break
            except NonFiniteLogitsError as e:
                self._fail_rows([r for r, _ in chunks], e)  # the others' chunks again
            except OutOfBlocksError as e:
                if self._make_room(e.requested):
                    continue
                if len(self.running) == 1:  # it alone, and no cached block to evict
                    raise
                self._preempt()  # the newest: another, or one of these back to the queue
        out = []
        for (req, chunk), rows in zip(chunks, logits):
            del req.pending[:len(chunk)]
            self._cache_written(req, new_only=True)
            if not req.pending:
                # a head recomputed after a preemption holds its own tokens past the prompt
                group = [req] + (self._fork_waiting(req) if not req.tokens else [])
                out += self._emit(group, np.repeat(rows, len(group), axis=0))
        return out

    def _chunks(self) -> list[tuple[Request, list[int]]]:
        """``(request, tokens)`` to prefill this step.  A request whose first block is the
        first block of another one's prompt prefilling now waits a step, to find that block
        in the prefix cache then instead of computing it again."""
        chunks, budget, firsts = [], self.prefill_budget, set()
        for req in [r for r in self.running if r.pending and r.handle is not None]:
            if budget == 0:
                break
            if self.cache is not None and req.handle.length == 0:
                self._adopt_cached(req)
                first = tuple(req.pending[:self.pool.block_size])
                if req.handle.length == 0 and len(first) == self.pool.block_size:
                    if first in firsts:
                        continue
                    firsts.add(first)
            chunks.append((req, req.pending[:budget]))
            budget -= len(chunks[-1][1])
        return chunks

    def _fork_waiting(self, head: Request) -> list[Request]:
        """The continuations of ``head`` still waiting, now running on forks of its sequence
        (from here on each is a request like any other), as many as ``max_running`` leaves
        room for: the others wait their turn and prefill the prompt then (from the prefix
        cache, while it holds the prompt's blocks)."""
        forks = self._unforked(head)[:max(self.max_running - len(self.running), 0)]
        for r in forks:
            self.waiting.remove(r)
            r.handle, r.fork_of, r.hashes = head.handle.fork(), None, list(head.hashes)
            self.running.append(r)
        return forks

    def _decode(self, reqs: list[Request]) -> list[tuple[Request, int]]:
        drafts = self._drafts(reqs)
        while reqs:
            rows = [Row(r.handle, [r.tokens[-1], *drafts.get(r, ())], all_logits=r in drafts)
                    for r in reqs]
            try:
                logits = self.runner.run(rows)
            except NonFiniteLogitsError as e:
                failed = self._fail_rows(reqs, e)
                reqs = [r for r in reqs if r not in failed]
                continue
            except OutOfBlocksError as e:
                if drafts:  # the drafts' positions first: a plain step may fit
                    drafts = {}
                    continue
                if self._make_room(e.requested):
                    continue
                victim = self._preempt()
                if victim is None:
                    raise
                reqs = [r for r in reqs if r is not victim]
                continue
            out = self._emit([r for r in reqs if r not in drafts],
                             np.concatenate([x for r, x in zip(reqs, logits) if r not in drafts])
                             if len(drafts) < len(reqs) else None)
            for r, x in zip(reqs, logits):
                if r in drafts:
                    out += self._emit_verified(r, x, drafts[r])
            for r in reqs:
                self._cache_written(r, new_only=True)
            return out
        return []

    def _preempt(self) -> Request | None:
        """Free the newest running request's blocks and queue it first for recompute; None when
        nothing runs."""
        if not self.running:
            return None
        victim = self.running[-1]
        self.running.remove(victim)
        self._cache_written(victim)  # its recompute finds them, unless evicted by then
        victim.handle.release()
        victim.handle = None
        victim.pending = victim.prompt + victim.tokens
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, victim)
        return victim

    def _emit(self, rows: list[Request], logits: np.ndarray | None
              ) -> list[tuple[Request, int]]:
        """Sample, record and check one token per row.  What fails for one row (its sampler,
        its constraint) ends that request alone as ``"error"`` (:attr:`failed`)."""
        if not rows:
            return []
        errors: dict[int, Exception] = {}
        constrained = any(r.constraint is not None for r in rows)
        tokens = self._sample(rows, _masked(rows, logits, errors) if constrained else logits,
                              errors)
        now = time.perf_counter()
        out = []
        for i, (req, token) in enumerate(zip(rows, tokens)):
            try:
                if i in errors:
                    raise errors[i]
                self._take(req, token, logits[i], now)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                self._fail(req, e)
                continue
            out.append((req, token))
            reason = self._ends(req, token)
            if reason:
                self._finish(req, reason)
        return out

    def _take(self, req: Request, token: int, logits: np.ndarray, now: float) -> None:
        """Record ``token`` as ``req``'s next (its log-probability and grammar first)."""
        if req.top_logprobs is not None:
            entry = token_logprob(logits, token, req.top_logprobs)
        if req.constraint is not None:
            req.constraint.accept(token)
        if req.top_logprobs is not None:
            req.logprobs.append(entry)
        req.tokens.append(token)
        req.token_times.append(now)

    @staticmethod
    def _ends(req: Request, token: int) -> str | None:
        """Why ``token`` ends ``req`` (``"stop"``, ``"length"``), or None: the one place a
        request's own limits end it (stop ids, a finished grammar, stop strings, max_tokens)."""
        text_stop = req.text is not None and req.text.push(token)
        if (token in req.stop_ids or (req.constraint is not None and req.constraint.done)
                or text_stop):
            return "stop"
        if len(req.tokens) >= req.max_tokens:
            return "length"
        return None

    @staticmethod
    def _sample(rows: list[Request], logits: np.ndarray, errors: dict) -> list[int]:
        """One token per row (:func:`~.sampling.sample_rows`); a row that cannot be sampled
        goes into ``errors``."""
        live = [i for i in range(len(rows)) if i not in errors]
        tokens = [0] * len(rows)
        got, failed = sample_rows([rows[i].sampler for i in live],
                                  logits if len(live) == len(rows) else logits[live])
        for j, i in enumerate(live):
            tokens[i] = got[j]
            if j in failed:
                errors[i] = failed[j]
        return tokens

    def _fail_rows(self, reqs: list[Request], error: NonFiniteLogitsError) -> list[Request]:
        """End the requests whose rows of a refused step had non-finite logits (the step left
        every sequence as it was: the others step again); those requests.  Re-raises an
        error that names no sequence of ``reqs``."""
        bad = [r for r in reqs if r.handle.seq_id in error.sequences]
        if not bad:
            raise error
        for r in bad:
            self._fail(r, error)
        return bad

    def _fail(self, req: Request, error: Exception) -> None:
        req.error = error
        self.failed.append(req)
        self._finish(req, "error")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.handle is not None:
            self._cache_written(req)
            req.handle.release()
            req.handle = None
        if req.drafter is not None:
            req.drafter.close()


def _masked(rows: list[Request], logits: np.ndarray, errors: dict) -> np.ndarray:
    """A copy of ``logits`` with every token a row's constraint rules out at ``-inf``; a
    constraint that fails goes into ``errors``."""
    out = np.array(logits, dtype=np.float32)
    for i, req in enumerate(rows):
        if req.constraint is not None:
            try:
                out[i, ~req.constraint.allowed()] = -np.inf
            except Exception as e:  # noqa: BLE001 - that request's failure
                errors[i] = e
    return out
