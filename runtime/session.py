"""``PagedDecodeSession``: plan once, reuse every token.

A session binds one artifact's ``decode`` function, the weight tuple and the pool tuple once.
Per token only the token id and the block table (both preallocated tensors updated in place
through DLPack views), the context length and the flattened write offset cross into the VM.

Validity key (the seed's): ``(max_blocks_cap, n_layers, block_size, cache_dtype, shape_key,
alloc_id)``.  Any mismatch means the session must be dropped and rebuilt; a sequence growing into
new blocks does not change it (the block table is per-token data).

Thread safety: a session is not safe to use from two threads at once; sessions over separate pools
are independent and may run concurrently (the pool's own state is locked).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import tvm

from .artifact import Artifact, WeightPack
from .errors import InputError, OffsetRebindError, TopologyChanged, ValidityError
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
    """The pool's geometry must be the artifact's."""
    m = artifact.manifest
    want = (m["n_layers"], m["block_size"], m["cache_dtype"], m["n_kv_heads"], m["head_dim"])
    got = (pool.n_layers, pool.block_size, pool.cache_dtype, pool.n_kv_heads, pool.head_dim)
    if want != got:
        raise ValidityError(
            f"pool (n_layers, block_size, cache_dtype, n_kv_heads, head_dim)={got} does not fit "
            f"artifact {artifact.path.name} {want}; allocate the pool with the artifact's values")


class PagedDecodeSession:
    """Decode plan bound to one (artifact, weights, pool allocation)."""

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        check_compatible(artifact, weights, pool)
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.key = validity_key_for(artifact, weights, pool)
        self.max_tokens = artifact.max_blocks_cap * artifact.block_size
        self.vocab_size = artifact.manifest["vocab_size"]
        self._decode = artifact.vm["decode"]
        self._prefill = artifact.vm["prefill"]
        self._pools, self._params = pool.pools, weights.params
        dev = artifact.device
        self._token = tvm.runtime.empty((1,), "int32", dev)
        self._table = tvm.runtime.empty((1, artifact.max_blocks_cap), "int32", dev)
        self._token_host, self._table_host = self._host_views(dev)
        self._bound_offset: int | None = None
        self.realize_count = 0

    def _host_views(self, dev):
        if dev.dlpack_device_type() == 1:  # CPU: write straight into the VM's input tensors
            return np.from_dlpack(self._token), np.from_dlpack(self._table)
        return np.zeros((1,), np.int32), np.zeros((1, self.artifact.max_blocks_cap), np.int32)

    def _upload(self):
        if self._token.device.dlpack_device_type() != 1:
            self._token.copyfrom(self._token_host)
            self._table.copyfrom(self._table_host)

    # -- validity ---------------------------------------------------------------------------
    def is_valid_for(self, max_blocks_cap: int, n_layers: int, block_size: int, cache_dtype: str,
                     shape_key: str, alloc_id: int) -> bool:
        """True iff every field equals the key this session was built for."""
        return self.key == ValidityKey(max_blocks_cap, n_layers, block_size, cache_dtype,
                                       shape_key, alloc_id)

    def check_topology(self, handle: SessionHandle) -> None:
        """``TopologyChanged`` if the pool was cleared since the build; ``HandleError`` if the
        handle is released or belongs to another pool."""
        if self.pool.alloc_id != self.key.alloc_id:
            raise TopologyChanged(
                f"pool allocation changed from {self.key.alloc_id} to {self.pool.alloc_id} "
                "(pool cleared); drop this session and build a new one")
        self.pool.check_handle(handle)

    # -- the per-token write offset -----------------------------------------------------------
    def bind_offset(self, write_off: int) -> None:
        """Bind this step's flattened write offset; a different value before the step runs is
        an ``OffsetRebindError`` (the step keeps its first binding)."""
        if self._bound_offset is not None and self._bound_offset != write_off:
            raise OffsetRebindError(
                f"write offset already bound to {self._bound_offset} for this step, got "
                f"{write_off}; run or cancel the step (unbind_offset) before rebinding")
        self._bound_offset = write_off

    def unbind_offset(self) -> None:
        self._bound_offset = None

    # -- steps --------------------------------------------------------------------------------
    def _check_token(self, token_id) -> int:
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise InputError(f"token id {token_id!r}: must be an integer")
        if not 0 <= int(token_id) < self.vocab_size:
            raise InputError(f"token id {int(token_id)} outside the vocabulary "
                             f"[0, {self.vocab_size}); check the tokenizer matches the model")
        return int(token_id)

    def realize_token(self, handle: SessionHandle, token_id: int) -> np.ndarray:
        """Decode one token of ``handle``'s sequence; returns logits ``(vocab,) float32``.

        Writes K/V of position ``handle.length`` into the pool, then advances the handle.  On any
        error the handle and the pool are as they were.
        """
        self.check_topology(handle)
        token_id = self._check_token(token_id)
        pos = handle.length
        before = len(handle.blocks)
        handle.reserve(1, self.max_tokens)
        try:
            off = handle.write_offset(pos)
            self.bind_offset(off)
            handle.fill_block_table(self._table_host)
            self._token_host[0] = token_id
            self._upload()
            logits = self._decode(self._token, self._table, pos + 1, off, self._pools,
                                  self._params)
        except BaseException:
            self._rollback(handle, pos, before)
            raise
        finally:
            self._bound_offset = None
        handle.advance(1)
        self.realize_count += 1
        return logits.numpy()[0]

    def prefill(self, handle: SessionHandle, token_ids) -> np.ndarray:
        """Run the compiled prefill over ``token_ids`` appended to the sequence; returns the
        last position's logits.  Does not count in ``realize_count`` (no decode plan reuse)."""
        self.check_topology(handle)
        ids = self._check_prompt(token_ids)
        start, before = handle.length, len(handle.blocks)
        handle.reserve(len(ids), self.max_tokens)
        try:
            handle.fill_block_table(self._table_host)
            self._upload()
            ids_t = tvm.runtime.tensor(ids, self.artifact.device)
            logits = self._prefill(ids_t, self._table, start, self._pools, self._params)
        except BaseException:
            self._rollback(handle, start, before)
            raise
        handle.advance(len(ids))
        return logits.numpy()[0]

    def _check_prompt(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise InputError(f"prompt must be a non-empty 1-D sequence of token ids, got shape "
                             f"{ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"prompt token ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise InputError(f"prompt token id {int(bad[0])} outside the vocabulary "
                             f"[0, {self.vocab_size}); check the tokenizer matches the model")
        return ids.astype(np.int32)

    def _rollback(self, handle: SessionHandle, length: int, blocks_before: int) -> None:
        """Give back blocks reserved for a step that did not run."""
        if handle.is_live and len(handle.blocks) > blocks_before:
            handle.truncate_to(length)
