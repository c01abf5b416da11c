"""Batched decode steps: one new token for each of many sequences of one pool, per call.

An artifact compiled with batch buckets has ``batch_decode_<B>`` for each bucket ``B``.  A step
over ``n`` sequences runs the smallest bucket ``B >= n`` (``n == 1`` runs the B = 1 ``decode``);
rows ``n .. B - 1`` are padding (context length 0: they write nothing).  Each bucket's plan (its
VM function and its preallocated ``(B,)`` / ``(B, max_blocks_cap)`` inputs) is built the first
time the bucket runs and held: sequences joining and leaving between steps change data only.
``realize_counts[B]`` counts the steps each plan ran; ``plan_builds[B]`` stays 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from paged_decode.runtime._tvm import tvm

from .artifact import Artifact, WeightPack
from .errors import HandleError, InputError
from .host_memory import on_host
from .kv_pool import PagedKVCache, SessionHandle
from .session import (PagedDecodeSession, ValidityKey, check_compatible, check_token_id,
                      host_rows, validity_key_for)


@dataclasses.dataclass
class _Plan:
    """One bucket's held inputs: device tensors and the host arrays the step fills."""

    rows: int
    fn: object
    tensors: tuple  # token_ids (B,) int32, block_tables (B, cap) int32, context_lens, write_offs
    hosts: tuple  # the same four as numpy arrays (views of the tensors on the CPU)

    def upload(self) -> None:
        for tensor, host in zip(self.tensors, self.hosts):
            if not on_host(tensor.device):
                tensor.copyfrom(host)


class BatchDecodeSession:
    """Decode plans over one (artifact, weights, pool allocation), one per batch bucket.

    Not safe to use from two threads at once (the plans' inputs are one step's state).
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        check_compatible(artifact, weights, pool)
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.key: ValidityKey = validity_key_for(artifact, weights, pool)
        self.buckets = tuple(artifact.manifest.batch_buckets)
        self._single = PagedDecodeSession(artifact, weights, pool)
        self._vm = self._single._vm
        self._plans: dict[int, _Plan] = {}
        self.plan_builds = {b: 0 for b in (1, *self.buckets)}
        self.plan_builds[1] = 1  # the B = 1 session, built above
        self._counts = {b: 0 for b in self.buckets}

    @property
    def max_rows(self) -> int:
        """Most sequences one step takes: the largest bucket (1 without buckets)."""
        return max(self.buckets, default=1)

    @property
    def realize_counts(self) -> dict[int, int]:
        """Steps run per bucket (``1``: the B = 1 decode plan)."""
        return {1: self._single.realize_count, **self._counts}

    def is_valid_for(self, *key) -> bool:
        """True iff the six fields equal the key this session was built for."""
        return self.key == ValidityKey(*key)

    def bucket_for(self, n: int) -> int:
        """The rows of the plan a step over ``n`` sequences runs."""
        if n == 1:
            return 1
        fits = [b for b in self.buckets if b >= n]
        if not fits:
            raise InputError(f"a step over {n} sequences: the artifact's largest batch bucket is "
                             f"{self.max_rows} (buckets {list(self.buckets)}); step at most "
                             f"{self.max_rows} sequences at once, or compile with a larger "
                             "--batch-buckets")
        return fits[0]

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
            plan = self._plans[rows] = _Plan(rows, self._vm[f"batch_decode_{rows}"], tensors,
                                             hosts)
            self.plan_builds[rows] += 1
        return plan

    def _check_rows(self, handles, token_ids) -> list[int]:
        if len(handles) != len(token_ids) or not handles:
            raise InputError(f"{len(handles)} handles and {len(token_ids)} token ids: a step "
                             "takes one token per sequence, at least one")
        seen = set()
        for h in handles:
            self.pool.check_handle(h)
            if h.seq_id in seen:
                raise HandleError(f"sequence {h.seq_id} appears twice in one step; a step adds "
                                  "one token to each sequence once")
            seen.add(h.seq_id)
        vocab = self.artifact.manifest.vocab_size
        return [check_token_id(t, vocab) for t in token_ids]

    def step(self, handles: Sequence[SessionHandle], token_ids: Sequence[int]) -> np.ndarray:
        """Decode ``token_ids[i]`` as the next token of ``handles[i]`` for every i, in one
        compiled call; returns logits ``(n, vocab) float32``.  Writes each token's K/V at its
        sequence's position ``length`` and advances every handle.  On any error every handle
        (length and blocks) and the allocator are as they were."""
        self._single.check_pool()
        tokens = self._check_rows(handles, token_ids)
        rows = self.bucket_for(len(handles))
        if rows == 1:
            return self._single.realize_token(handles[0], tokens[0])[None]
        plan = self._plan(rows)
        snaps = []
        try:
            for h in handles:
                snaps.append((h, h.snapshot()))
                h.reserve(1, self.artifact.max_tokens)
            self._fill(plan, handles, tokens)
            plan.upload()
            logits = self._single._call(f"batch_decode_{rows}", plan.fn, *plan.tensors,
                                        self._single._pools_arg, self._single._params_arg)
            out = host_rows(logits, len(handles), lambda r: f"batched decode row {r} (sequence "
                            f"{handles[r].seq_id} at position {handles[r].length})")
        except BaseException:
            for h, snap in reversed(snaps):
                h.restore(snap)
            raise
        for h in handles:
            h.advance(1)
        self._counts[rows] += 1
        return out

    def _fill(self, plan: _Plan, handles, tokens) -> None:
        ids, tables, ctx, offs = plan.hosts
        n = len(handles)
        for r, (h, token) in enumerate(zip(handles, tokens)):
            ids[r] = token
            h.fill_block_table(tables[r:r + 1])
            ctx[r] = h.length + 1
            offs[r] = h.write_offset(h.length)
        ids[n:], tables[n:], ctx[n:], offs[n:] = 0, 0, 0, 0  # padding rows write nothing
