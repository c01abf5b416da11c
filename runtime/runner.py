"""One step runner over a pool: a step is a ragged batch of rows, each a sequence and its new
tokens (1 to decode, k + 1 to verify k drafted tokens, a chunk of a prompt to prefill).

The runner picks the compiled functions a step runs:

- one row of one token: the B = 1 ``decode`` (fused GEMV kernels, the fastest single stream);
- otherwise every new token of every row is a row of ``batch_decode_<B>`` (``calls_for``: the
  smallest bucket ``B`` that holds them, or on the CPU past its weight-streaming buckets calls
  that fill theirs; ``max_rows`` tokens per call at most): each token row carries its sequence's
  block table, its position + 1 as context length and its own write offset, so tokens of one
  sequence in one call attend causally to each other (every row's K/V is written before any
  row's attention reads) and every token's logits come back;
- a row of more than ``max_rows`` tokens that needs only its last logits (a prompt chunk)
  runs the compiled ``prefill`` (matrix kernels over float32 activations).

A step is all or nothing: every row's positions are reserved first, the calls run, and only
then does every handle advance; if anything fails every handle (length and blocks) and the
allocator are as they were.  Plans are held per bucket (``plan_builds`` stays 1 each);
``realize_counts`` counts the calls each ran; ``seconds`` keeps a running mean of each plan's
call time, which a drafter weighs a verification's cost by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence

import numpy as np
from paged_decode.runtime._tvm import tvm

from .artifact import Artifact, WeightPack
from .errors import HandleError, InputError, NonFiniteLogitsError
from .host_memory import on_host
from .kv_pool import PagedKVCache, SessionHandle
from .session import (PagedDecodeSession, ValidityKey, check_compatible, check_prompt,
                      check_token_id, host_rows, validity_key_for)

_EMA = 0.2  # weight of the newest call in a plan's mean call time
# a plan's mean counts as unknown once this many calls of other plans ran since its last one:
# a mean measured in a slow moment (another process on the cores) would otherwise keep a
# drafter from ever calling that plan again to measure it anew
STALE_CALLS = 64
# Per target kind: the buckets up to this many rows stream the weights once per call, like
# decode (the CPU's small-batch GEMVs, compile/kernels/cpu/batch.py SMALL_ROWS), so padding
# them costs little; the larger ones are matrix products whose time grows with their rows,
# padding included.  Token rows past it go in calls that fill their buckets (the largest bucket
# the rows fill, then the rest) rather than one padded call: on SmolLM2 Q4_1 (2 cores) 10 rows
# as 8 + 2 take 0.85x the time of one 16-row call (docs/benchmarks.md).
STREAM_ROWS = {"llvm": 8}


@dataclasses.dataclass(frozen=True)
class Row:
    """A sequence's new tokens for one step, written at positions ``handle.length ..``;
    ``all_logits``: return the logits of every new token (verification), not just the last."""

    handle: SessionHandle
    tokens: Sequence[int]
    all_logits: bool = False


@dataclasses.dataclass
class _Plan:
    """One bucket's held inputs: device tensors and the host arrays a call fills."""

    rows: int
    fn: object
    tensors: tuple  # token_ids (B,) int32, block_tables (B, cap) int32, context_lens, write_offs
    hosts: tuple  # the same four as numpy arrays (views of the tensors on the CPU)

    def upload(self) -> None:
        for tensor, host in zip(self.tensors, self.hosts):
            if not on_host(tensor.device):
                tensor.copyfrom(host)


@contextlib.contextmanager
def _naming(seq_id: int):
    """A NonFiniteLogitsError of a one-sequence call names that sequence."""
    try:
        yield
    except NonFiniteLogitsError as e:
        e.sequences = (seq_id,)
        raise


class StepRunner:
    """Every compiled step over one (artifact, weights, pool allocation).

    Not safe to use from two threads at once (the plans' inputs are one step's state).
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        check_compatible(artifact, weights, pool)
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.key: ValidityKey = validity_key_for(artifact, weights, pool)
        self.buckets = tuple(artifact.manifest.batch_buckets)
        self.single = PagedDecodeSession(artifact, weights, pool)  # the B = 1 plan
        self._plans: dict[int, _Plan] = {}
        self.plan_builds = {b: 0 for b in (1, *self.buckets)}
        self.plan_builds[1] = 1
        self._counts = {b: 0 for b in self.buckets}
        self.prefill_calls = 0
        self.seconds: dict[int, float] = {}  # mean call time per plan (1: decode)
        self._calls = 0  # timed calls so far
        self._stamp: dict[int, int] = {}  # per plan: ``_calls`` at its last call

    @property
    def _single(self) -> PagedDecodeSession:  # the name earlier releases used
        return self.single

    @property
    def max_rows(self) -> int:
        """Most token rows one batched call takes: the largest bucket (1 without buckets)."""
        return max(self.buckets, default=1)

    @property
    def realize_counts(self) -> dict[int, int]:
        """Calls run per plan (``1``: the B = 1 decode plan)."""
        return {1: self.single.realize_count, **self._counts}

    def is_valid_for(self, *key) -> bool:
        """True iff the six fields equal the key this runner was built for."""
        return self.key == ValidityKey(*key)

    def bucket_for(self, n: int) -> int:
        """The rows of the plan a call over ``n`` token rows runs."""
        if n == 1:
            return 1
        fits = [b for b in self.buckets if b >= n]
        if not fits:
            raise InputError(f"a step over {n} sequences: the artifact's largest batch bucket is "
                             f"{self.max_rows} (buckets {list(self.buckets)}); step at most "
                             f"{self.max_rows} sequences at once, or compile with a larger "
                             "--batch-buckets")
        return fits[0]

    def calls_for(self, n: int) -> list[int]:
        """The plans (rows each: a bucket, 1 for the B = 1 decode) ``n`` token rows run in,
        in order; every call full but the last (``STREAM_ROWS``)."""
        stream = STREAM_ROWS.get(self.artifact.manifest.target_kind)
        out = []
        while n > 0:
            if stream in self.buckets and n > stream:
                take = max(b for b in self.buckets if b <= n)
            else:
                take = min(n, self.max_rows)
            out.append(self.bucket_for(take))
            n -= take
        return out

    def cost(self, rows: int) -> float | None:
        """Mean seconds of the calls over ``rows`` token rows, once their plans ran past
        their first call and while their means are fresh (``STALE_CALLS``); else None."""
        times = [self.seconds.get(b) if self._calls - self._stamp.get(b, -STALE_CALLS)
                 < STALE_CALLS else None for b in self.calls_for(rows)]
        return None if None in times else sum(times)

    # -- a step -------------------------------------------------------------------------------
    def prefill(self, handle: SessionHandle, token_ids) -> np.ndarray:
        """Append ``token_ids`` to one sequence; its last position's logits ``(vocab,)``."""
        return self.run([Row(handle, token_ids)])[0][-1]

    def run(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Run one step; per row, its logits: ``(n, vocab)`` with ``all_logits``, else the
        last token's ``(1, vocab)``.  Every handle advances by its row's tokens."""
        self.single.check_pool()
        ids = self._check(rows)
        if len(rows) == 1 and len(ids[0]) == 1:
            t0 = time.perf_counter()
            with _naming(rows[0].handle.seq_id):
                out = self.single.realize_token(rows[0].handle, int(ids[0][0]))[None]
            self._timed(1, t0)
            return [out]
        snaps = []
        try:
            for row, toks in zip(rows, ids):
                snaps.append((row.handle, row.handle.snapshot()))
                row.handle.reserve(len(toks), self.artifact.max_tokens)
            out = self._execute(rows, ids)
        except BaseException:
            for h, snap in reversed(snaps):
                h.restore(snap)
            raise
        for row, toks in zip(rows, ids):
            row.handle.advance(len(toks))
        return out

    def _check(self, rows: Sequence[Row]) -> list[np.ndarray]:
        if not rows:
            raise InputError("a step needs at least one row (a sequence and its new tokens)")
        seen, vocab = set(), self.artifact.manifest.vocab_size
        ids = []
        for row in rows:
            if not isinstance(row, Row):
                raise InputError(f"step rows must be runner.Row(handle, tokens), got "
                                 f"{type(row).__name__}")
            self.pool.check_handle(row.handle)
            if row.handle.seq_id in seen:
                raise HandleError(f"sequence {row.handle.seq_id} appears twice in one step; "
                                  "give it one row with all of its new tokens")
            seen.add(row.handle.seq_id)
            toks = row.tokens
            if isinstance(toks, (list, tuple)) and len(toks) == 1:  # a decode token's message
                ids.append(np.array([check_token_id(toks[0], vocab)], np.int32))
            else:
                ids.append(check_prompt(toks, vocab))
            if row.all_logits and not self.buckets and len(ids[-1]) > 1:
                raise InputError(f"every position's logits of sequence {row.handle.seq_id}: "
                                 f"artifact {self.artifact.path.name} has no batch buckets; "
                                 "compile it with --batch-buckets")
        return ids

    def _execute(self, rows, ids) -> list[np.ndarray]:
        out: list[list[np.ndarray]] = [[] for _ in rows]
        flat = []  # (row index, position) of every token the batched plans take
        for i, (row, toks) in enumerate(zip(rows, ids)):
            start = row.handle.length
            if not row.all_logits and (len(toks) > self.max_rows or not self.buckets):
                out[i].append(self._prefill_call(row.handle, toks, start)[None])
            else:
                flat += [(i, start + j) for j in range(len(toks))]
        lo = 0
        for bucket in self.calls_for(len(flat)):
            part = flat[lo:lo + bucket]
            lo += len(part)
            logits = self._batch_call(part, rows, ids)
            for r, (i, _) in enumerate(part):
                out[i].append(logits[r:r + 1])
        return [np.concatenate(o) if rows[i].all_logits else o[-1] for i, o in enumerate(out)]

    def _prefill_call(self, handle, toks, start) -> np.ndarray:
        t0 = time.perf_counter()
        with _naming(handle.seq_id):
            row = self.single.prefill_reserved(handle, toks, start)
        self.prefill_calls += 1
        self._timed(-1, t0)
        return row

    def _batch_call(self, part, rows, ids) -> np.ndarray:
        """One call over ``part``'s token rows: the B = 1 decode for one, else a bucket."""
        B = self.bucket_for(len(part))
        t0 = time.perf_counter()
        if B == 1:
            (i, pos), = part
            h = rows[i].handle
            with _naming(h.seq_id):
                logits = self.single.decode_at(h, int(ids[i][pos - h.length]), pos)[None]
        else:
            plan = self._plan(B)
            self._fill(plan, part, rows, ids)
            plan.upload()
            res = self.single._call(f"batch_decode_{B}", plan.fn, *plan.tensors,
                                    self.single._pools_arg, self.single._params_arg)
            try:
                logits = host_rows(res, len(part), lambda r: self._where(r, part[r], rows))
            except NonFiniteLogitsError as e:
                e.sequences = tuple(sorted({rows[part[r][0]].handle.seq_id for r in e.rows}))
                raise
            self._counts[B] += 1
        self._timed(B, t0)
        return logits

    @staticmethod
    def _where(r: int, item, rows) -> str:
        """What token row ``r`` of a call was, for an error naming it."""
        i, pos = item
        seq, n = rows[i].handle.seq_id, len(rows[i].tokens)
        if n == 1:
            return f"batched decode row {r} (sequence {seq} at position {pos})"
        what = "verification" if rows[i].all_logits else "prefill"
        return f"{what} of sequence {seq} at position {pos} (batched row {r})"

    def _timed(self, plan: int, t0: float) -> None:
        """Fold a call's time into its plan's mean; a plan's first call (its inputs made,
        the function's memory first touched) is not timed."""
        took = time.perf_counter() - t0
        self._calls += 1
        first = plan not in self._stamp
        self._stamp[plan] = self._calls
        if first:
            return
        was = self.seconds.get(plan)
        self.seconds[plan] = took if was is None else was + _EMA * (took - was)

    def _plan(self, rows: int) -> _Plan:
        plan = self._plans.get(rows)
        if plan is None:
            dev, cap = self.artifact.device, self.artifact.max_blocks_cap
            tensors = (tvm.runtime.empty((rows,), "int32", dev),
                       tvm.runtime.empty((rows, cap), "int32", dev),
                       tvm.runtime.empty((rows,), "int64", dev),
                       tvm.runtime.empty((rows,), "int64", dev))
            hosts = (tuple(np.from_dlpack(t) for t in tensors) if on_host(dev) else
                     tuple(np.zeros(t.shape, t.dtype) for t in tensors))
            plan = self._plans[rows] = _Plan(rows, self.single._vm[f"batch_decode_{rows}"],
                                             tensors, hosts)
            self.plan_builds[rows] += 1
        return plan

    @staticmethod
    def _fill(plan: _Plan, part, rows, ids) -> None:
        tokens, tables, ctx, offs = plan.hosts
        n, last = len(part), None
        for r, (i, pos) in enumerate(part):
            h = rows[i].handle
            tokens[r] = ids[i][pos - h.length]
            if i == last:
                tables[r] = tables[r - 1]
            else:
                h.fill_block_table(tables[r:r + 1])
            last = i
            ctx[r] = pos + 1
            offs[r] = h.write_offset(pos)
        tokens[n:], tables[n:], ctx[n:], offs[n:] = 0, 0, 0, 0  # padding rows write nothing
