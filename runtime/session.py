"""``PagedDecodeSession``: plan once, reuse every token.

A session binds one artifact's ``decode`` function, the weight tuple and the pool tuple once.
Per token only the token id and the block table (both preallocated tensors updated in place
through DLPack views), the context length and the flattened write offset cross into the VM.

Validity key (the seed's): ``(max_blocks_cap, n_layers, block_size, cache_dtype, shape_key,
alloc_id)``.  Any mismatch means the session must be dropped and rebuilt; a sequence growing into
new blocks does not change it (the block table is per-token data).

Every step checks its inputs in Python before the VM runs and raises a typed error (see
:mod:`paged_decode.runtime.errors`) with the pool and the sequence as they were; the kernels assert
the same bounds as a second line of defence, and any failure inside the VM surfaces as an
:class:`ExecutionError` chained to the TVM error.

Thread safety: a session is not safe to use from two threads at once.  Each session has its own
VirtualMachine instance (the weight tensors are shared read-only), so sessions over separate pools
may run concurrently from different threads; the pool's own state is locked.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np
from paged_decode.runtime._tvm import tvm

from .artifact import Artifact, WeightPack
from .checks import check_array, is_int
from .errors import (BlockTableError, ExecutionError, NonFiniteLogitsError, OffsetRebindError,
                     TokenIdError, TopologyChanged, ValidityError, WriteOffsetError)
from .host_memory import on_host
from .kv_pool import PagedKVCache, SessionHandle

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ValidityKey:
    max_blocks_cap: int
    n_layers: int
    block_size: int
    cache_dtype: str
    shape_key: str
    alloc_id: int


def validity_key_for(artifact: Artifact, weights: WeightPack, pool: PagedKVCache) -> ValidityKey:
    """The key a session over these three would have (the pool's *current* allocation)."""
    return ValidityKey(artifact.max_blocks_cap, pool.n_layers, pool.block_size, pool.cache_dtype,
                       weights.shape_key, pool.alloc_id)


def check_compatible(artifact: Artifact, weights: WeightPack, pool: PagedKVCache) -> None:
    """The pool's geometry and device and the weights' layout must be the artifact's."""
    m = artifact.manifest
    want = (m.n_layers, m.block_size, m.cache_dtype, m.n_kv_heads, m.head_dim)
    got = (pool.n_layers, pool.block_size, pool.cache_dtype, pool.n_kv_heads, pool.head_dim)
    if want != got:
        raise ValidityError(
            f"pool (n_layers, block_size, cache_dtype, n_kv_heads, head_dim)={got} does not fit "
            f"artifact {artifact.path.name} {want}; allocate the pool with the artifact's values "
            "(PagedKVCache.for_artifact(artifact, ...))")
    if str(pool.device) != str(artifact.device):
        raise ValidityError(f"pool is on {pool.device}, artifact {artifact.path.name} runs on "
                            f"{artifact.device}; allocate the pool on the artifact's device")
    if weights.meta.get("params") != m.param_layout:
        raise ValidityError(f"weight pack {weights.path} has another parameter layout than "
                            f"artifact {artifact.path.name}; load the pack built with it through "
                            "load_weights(path, artifact)")


def check_token_id(token_id, vocab_size: int) -> int:
    """``token_id`` as an int, or :class:`TokenIdError` (not an integer, or outside the vocab)."""
    if not is_int(token_id):
        raise TokenIdError(f"token id {token_id!r} is a {type(token_id).__name__}, not an "
                           f"integer; pass an int in [0, {vocab_size})")
    if not 0 <= int(token_id) < vocab_size:
        raise TokenIdError(f"token id {int(token_id)} outside the vocabulary [0, {vocab_size}); "
                           "check the tokenizer matches the model")
    return int(token_id)


def check_prompt(token_ids, vocab_size: int) -> np.ndarray:
    """``token_ids`` as ``int32 [n]`` (n >= 1), or :class:`TokenIdError`."""
    if isinstance(token_ids, (str, bytes)):
        raise TokenIdError(f"prompt {token_ids[:20]!r} is text, not token ids; encode it with the "
                           "model's tokenizer first")
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nesting
        raise TokenIdError(f"prompt {str(token_ids)[:40]} is not a 1-D sequence of token ids "
                           f"({e}); pass a flat list of ints") from e
    if ids.ndim != 1 or ids.size == 0:
        raise TokenIdError(f"prompt must be a non-empty 1-D sequence of token ids, got shape "
                           f"{ids.shape}; pass a flat list of ints such as [1, 2, 3]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TokenIdError(f"prompt token ids must be integers, got dtype {ids.dtype} (first "
                           f"value {ids[0]!r}); pass ints, not floats or bools")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise TokenIdError(f"prompt token id {int(bad[0])} outside the vocabulary "
                           f"[0, {vocab_size}); check the tokenizer matches the model")
    return ids.astype(np.int32)


def host_rows(logits, n: int, step: Callable[[int], str]) -> np.ndarray:
    """The first ``n`` rows of the VM's ``(B, vocab)`` output, copied into a fresh host array
    (the VM reuses its memory), every value finite: a row holding NaN or infinity is a
    :class:`NonFiniteLogitsError` naming ``step(row)``, never logits handed on."""
    rows = np.array(np.from_dlpack(logits)[:n]) if on_host(logits.device) else logits.numpy()[:n]
    finite = np.isfinite(rows).all(axis=1)
    if not finite.all():
        bad = tuple(int(i) for i in np.flatnonzero(~finite))
        raise NonFiniteLogitsError(
            f"{', '.join(step(i) for i in bad)}: the logits hold NaN or infinity, so no token "
            "can be chosen; the sequence was not advanced.  The weights or the pool hold "
            "non-finite values (a damaged or edited pack: convert the model again with "
            "--cache redo) or a kernel failed", step=step(bad[0]), rows=bad)
    return rows


def _host_logits(logits, step: Callable[[int], str]) -> np.ndarray:
    """The ``(vocab,)`` logits of a ``(1, vocab)`` output (see :func:`host_rows`)."""
    return host_rows(logits, 1, step)[0]


class PagedDecodeSession:
    """Decode plan bound to one (artifact, weights, pool allocation).

    Not safe to use from two threads at once; sessions over separate pools may run concurrently.
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        check_compatible(artifact, weights, pool)
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.key = validity_key_for(artifact, weights, pool)
        self.max_tokens = artifact.max_tokens
        self.vocab_size = artifact.manifest.vocab_size
        self._vm = artifact.new_vm()  # one VM per session: never shared between threads
        self._decode, self._prefill = self._vm["decode"], self._vm["prefill"]
        self._bound_pool, self._pools, self._params = pool, pool.pools, weights.params
        # the same tensors as TVM containers, built once: a Python tuple is converted into one
        # at every call (docs/design.md)
        self._pools_arg, self._params_arg = (tvm.runtime.convert(self._pools),
                                             tvm.runtime.convert(self._params))
        dev = artifact.device
        self._token = tvm.runtime.empty((1,), "int32", dev)
        self._table = tvm.runtime.empty((1, artifact.max_blocks_cap), "int32", dev)
        self._token_host, self._table_host = self._host_views(dev)
        self._bound_offset: int | None = None
        self._table_of = None  # (seq_id, block-list version) the block table holds now
        self.realize_count = 0

    def _host_views(self, dev):
        if on_host(dev):  # CPU: write straight into the VM's input tensors
            return np.from_dlpack(self._token), np.from_dlpack(self._table)
        return np.zeros((1,), np.int32), np.zeros((1, self.artifact.max_blocks_cap), np.int32)

    def _upload(self):
        if not on_host(self._token.device):
            self._token.copyfrom(self._token_host)
            self._table.copyfrom(self._table_host)

    # -- validity ---------------------------------------------------------------------------
    def is_valid_for(self, max_blocks_cap: int, n_layers: int, block_size: int, cache_dtype: str,
                     shape_key: str, alloc_id: int) -> bool:
        """True iff every field equals the key this session was built for."""
        return self.key == ValidityKey(max_blocks_cap, n_layers, block_size, cache_dtype,
                                       shape_key, alloc_id)

    def check_pool(self) -> None:
        """``TopologyChanged`` if ``self.pool`` was swapped or cleared since the build."""
        if self.pool is not self._bound_pool:
            raise TopologyChanged(
                f"session was built over pool allocation {self.key.alloc_id}, but its pool was "
                f"swapped for another (allocation {getattr(self.pool, 'alloc_id', None)}); build "
                "a new session for the new pool")
        if self.pool.alloc_id != self.key.alloc_id:
            raise TopologyChanged(
                f"pool allocation changed from {self.key.alloc_id} to {self.pool.alloc_id} "
                "(pool cleared); drop this session and build a new one")

    def check_topology(self, handle: SessionHandle) -> None:
        """``TopologyChanged`` if the pool was swapped or cleared since the build;
        ``HandleError`` if the handle is released or belongs to another pool."""
        self.check_pool()
        self.pool.check_handle(handle)

    # -- the per-token write offset -----------------------------------------------------------
    def bind_offset(self, write_off: int) -> None:
        """Bind this step's flattened write offset; a different value before the step runs is
        an ``OffsetRebindError`` (the step does not run and the binding is dropped)."""
        if self._bound_offset is not None and self._bound_offset != write_off:
            raise OffsetRebindError(
                f"write offset already bound to {self._bound_offset} for this step, got "
                f"{write_off}; run or cancel the step (unbind_offset) before rebinding")
        self._bound_offset = write_off

    def unbind_offset(self) -> None:
        self._bound_offset = None

    # -- steps --------------------------------------------------------------------------------
    def realize_token(self, handle: SessionHandle, token_id: int) -> np.ndarray:
        """Decode one token of ``handle``'s sequence; returns logits ``(vocab,) float32``.

        Writes K/V of position ``handle.length`` into the pool, then advances the handle.  On any
        error the handle (length and blocks) and the allocator are as they were.
        """
        self.check_topology(handle)
        token_id = check_token_id(token_id, self.vocab_size)
        pos = handle.length
        off = handle.next_write_offset() if pos < self.max_tokens else None
        snap = None
        if off is None:  # a new block, a copy-on-write, or past the cap: the general path
            snap = handle.snapshot()
            handle.reserve(1, self.max_tokens)
        try:
            if off is None:
                off = handle.write_offset(pos)
            self.bind_offset(off)
            row = self._decode_call(handle, token_id, pos, off)
        except BaseException:
            if snap is not None:
                handle.restore(snap)
            raise
        finally:
            self._bound_offset = None
        handle.advance(1)
        self.realize_count += 1
        return row

    def prefill(self, handle: SessionHandle, token_ids) -> np.ndarray:
        """Run the compiled prefill over ``token_ids`` (``[n]`` ints) appended to the sequence;
        returns the last position's logits ``(vocab,) float32``.  Does not count in
        ``realize_count`` (no decode plan reuse).  On any error nothing changed."""
        self.check_topology(handle)
        ids = check_prompt(token_ids, self.vocab_size)
        start, snap = handle.length, handle.snapshot()
        handle.reserve(len(ids), self.max_tokens)
        try:
            row = self.prefill_reserved(handle, ids, start)
        except BaseException:
            handle.restore(snap)
            raise
        handle.advance(len(ids))
        return row

    def prefill_reserved(self, handle: SessionHandle, ids: np.ndarray, start: int) -> np.ndarray:
        """The compiled prefill of checked ``int32`` ``ids`` at positions ``start ..`` of a
        sequence that reserved them; the last position's logits.  Advances nothing (the step
        runner advances every row of a step together once all of its calls succeeded)."""
        handle.fill_block_table(self._table_host)
        self._table_of = (handle.seq_id, handle.version)
        self._upload()
        ids_t = tvm.runtime.tensor(ids, self.artifact.device)
        logits = self._call("prefill", self._prefill, ids_t, self._table, start,
                            self._pools_arg, self._params_arg)
        return _host_logits(logits, lambda _r: f"prefill of sequence {handle.seq_id} "
                                   f"(positions {start} to {start + len(ids) - 1})")

    def decode_at(self, handle: SessionHandle, token_id: int, pos: int) -> np.ndarray:
        """The compiled decode of a checked ``token_id`` at position ``pos`` of a sequence that
        reserved it; its logits.  Advances nothing (see :meth:`prefill_reserved`)."""
        row = self._decode_call(handle, token_id, pos, handle.write_offset(pos))
        self.realize_count += 1
        return row

    def _decode_call(self, handle: SessionHandle, token_id: int, pos: int, off: int
                     ) -> np.ndarray:
        """``decode`` of ``token_id`` at ``pos`` of ``handle``'s sequence, written at ``off``
        (the block table refilled only when the sequence's blocks changed); its logits."""
        if self._table_of != (handle.seq_id, handle.version):
            handle.fill_block_table(self._table_host)
            self._table_of = (handle.seq_id, handle.version)
        self._token_host[0] = token_id
        self._upload()
        logits = self._call("decode", self._decode, self._token, self._table, pos + 1, off,
                            self._pools_arg, self._params_arg)
        return _host_logits(logits, lambda _r: f"decode of sequence {handle.seq_id} at "
                                               f"position {pos}")

    def decode_raw(self, token_id: int, block_table: np.ndarray, context_len: int,
                   write_off: int) -> np.ndarray:
        """One decode step over a caller-managed block table: no handle, no allocator.

        ``block_table``: ``int32 (1, max_blocks_cap)``; its first ``ceil(context_len /
        block_size)`` entries must lie in ``[0, num_blocks)`` (the rest is padding, ignored).
        ``context_len``: tokens including this one, in ``[1, max_blocks_cap * block_size]``.
        ``write_off``: ``block_table[0, (context_len - 1) // block_size] * block_size +
        (context_len - 1) % block_size``; K/V of this token are written there in every layer,
        so the table must be the writing sequence's own (a prefix of its blocks, the written
        one not shared after ``fork``) or use only blocks no sequence holds
        (:meth:`PagedKVCache.check_raw_write`).  All of it is checked before the VM runs
        (:class:`BlockTableError`, :class:`OwnershipError`, :class:`WriteOffsetError`,
        :class:`TokenIdError`).
        Returns logits ``(vocab,) float32``.
        """
        self.check_pool()
        token_id = check_token_id(token_id, self.vocab_size)
        context_len, write_off = self._check_raw(block_table, context_len, write_off)
        self.bind_offset(write_off)
        try:
            self._table_host[...] = block_table
            self._table_of = None
            self._token_host[0] = token_id
            self._upload()
            logits = self._call("decode", self._decode, self._token, self._table, context_len,
                                write_off, self._pools_arg, self._params_arg)
        finally:
            self._bound_offset = None
        self.realize_count += 1
        return _host_logits(logits, lambda _r: f"decode_raw at context_len {context_len}")

    def _check_raw(self, table, context_len, write_off) -> tuple[int, int]:
        cap, bs, nb = self.artifact.max_blocks_cap, self.pool.block_size, self.pool.num_blocks
        # (1, max_blocks_cap): padded with 0 to the artifact's width
        check_array(table, "block_table", np.int32, (1, cap), BlockTableError)
        if not is_int(context_len) or not 1 <= context_len <= cap * bs:
            raise BlockTableError(
                f"context_len={context_len!r} outside [1, {cap * bs}] (max_blocks_cap * "
                "block_size); pass the sequence length including this token")
        used = table[0, :-(-int(context_len) // bs)]
        bad = np.flatnonzero((used < 0) | (used >= nb))
        if bad.size:
            i = int(bad[0])
            raise BlockTableError(f"block_table[0, {i}] = {int(used[i])} is outside the pool "
                                  f"[0, {nb}); use block ids this pool allocated")
        pos = int(context_len) - 1
        want = int(used[pos // bs]) * bs + pos % bs
        if not is_int(write_off) or write_off != want:
            raise WriteOffsetError(
                f"write_off={write_off!r} does not match the block table at context_len - 1 = "
                f"{pos} (block {int(used[pos // bs])}, slot {pos % bs}); pass {want}")
        self.pool.check_raw_write([int(b) for b in used], pos // bs)
        return int(context_len), int(write_off)

    def _call(self, name: str, fn, *args):
        """Run a compiled function; a TVM failure becomes an :class:`ExecutionError`."""
        try:
            return fn(*args)
        except Exception as e:  # TVM raises plain RuntimeErrors (kernel asserts included)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ExecutionError(
                f"compiled {name} of {self.artifact.path.name} failed: {first}; the sequence was "
                "not advanced; check the step's inputs (token id, block table, context_len, "
                "write_off) or rebuild the artifact if it keeps failing") from e
