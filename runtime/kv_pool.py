"""The paged KV pool: pool tensors, a block allocator with ref counts, and per-sequence handles.

Layout: ``2 * n_layers`` tensors of shape ``(num_blocks, n_kv_heads, block_size, head_dim)`` and
dtype ``cache_dtype``, ordered ``(k0, v0, k1, v1, ...)``, allocated once per pool.  A sequence
(:class:`SessionHandle`) owns a list of physical block ids; its logical position ``pos`` lives in
block ``blocks[pos // block_size]`` at slot ``pos % block_size``, i.e. at the flattened row
``write_offset(pos) = physical_block * block_size + slot``.  Inside a V block a kv head's rows
are ``[slot, dim]``; a K block is stored as the artifact's manifest says (``k_block_layout``:
the CPU kernels store ``[dim, slot]``, the GPU kernels ``[slot, dim]``); :func:`k_rows` reads
either as rows.

Write protocol (the session layer must follow it):

1. ``h.reserve(n)`` before writing positions ``[h.length, h.length + n)``.  It allocates the
   missing blocks and copies-on-write every block in that range that is shared through
   :meth:`SessionHandle.fork`, all or nothing.
2. Hand ``h.fill_block_table(out)`` / ``h.write_offset(pos)`` to the compiled function.
3. ``h.advance(n)`` once the write has happened; if the write failed instead,
   ``h.restore(snap)`` with ``snap = h.snapshot()`` taken before step 1 undoes step 1.

A write anywhere else (below ``h.length``) needs ``h.prepare_write(pos)`` first.

Thread safety: each pool has one lock around its allocator, its handle registry and its
``alloc_id``; handle methods take it.  Separate pools are independent.  A single handle is not safe
to use from two threads at once (its length and write protocol are one caller's state).
Handles are not released by garbage collection: call :meth:`SessionHandle.release`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import NamedTuple

import numpy as np
from paged_decode.runtime._tvm import tvm

from paged_decode.runtime.block_allocator import BlockAllocator
from paged_decode.runtime.checks import check_array, check_int, is_int
from paged_decode.runtime.errors import (CapacityError, ConfigError, HandleError, InputError,
                                         OwnershipError)
from paged_decode.runtime.host_memory import HostArena, on_host, to_tvm

log = logging.getLogger(__name__)

CACHE_DTYPES = {"float32": 4, "float16": 2}  # cache_dtype -> bytes per element


def block_bytes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                cache_dtype: str) -> int:
    """Bytes of one KV block across K and V of all layers."""
    return 2 * n_layers * block_size * n_kv_heads * head_dim * CACHE_DTYPES[cache_dtype]

_ALLOC_IDS = itertools.count(1)  # process-unique pool allocation ids
_SEQ_IDS = itertools.count(1)  # process-unique sequence ids
_ID_LOCK = threading.Lock()


def _mint(counter: itertools.count) -> int:
    with _ID_LOCK:
        return next(counter)


K_BLOCK_LAYOUTS = ("slot-major", "dim-major")


def k_rows(k: np.ndarray, layout: str) -> np.ndarray:
    """A K pool tensor's contents (``(num_blocks, n_kv_heads, block_size, head_dim)``, as
    allocated) viewed as ``[block, kv_head, slot, dim]`` rows, for the K block layout ``layout``
    (an artifact's ``manifest["k_block_layout"]``)."""
    if layout == "slot-major":
        return k
    if layout == "dim-major":
        blocks, heads, bs, dim = k.shape
        return k.reshape(blocks, heads, dim, bs).swapaxes(2, 3)
    raise ConfigError(f"k_block_layout={layout!r}: known layouts are {list(K_BLOCK_LAYOUTS)}")


class Snapshot(NamedTuple):
    """A handle's state before a step (:meth:`SessionHandle.snapshot`)."""

    blocks: tuple  # ((block, allocation generation), ...)
    length: int
    seq_id: int


class PoolConfigError(ConfigError, InputError):
    """A pool argument (shape, dtype, size or memory budget) is invalid.

    Both a :class:`ConfigError` and an :class:`InputError`, so either catch works.
    """


class PagedKVCache:
    """The KV pool of one model: ``2 * n_layers`` tensors and the allocator over their blocks.

    Give exactly one of ``num_blocks`` or ``memory_budget_bytes`` (the budget covers K and V of
    all layers; ``num_blocks = budget // bytes_per_block``).  ``device`` defaults to
    ``tvm.cpu()``.  The tensors are zero-filled once; :attr:`pools` is the same tuple for the
    pool's whole life, so it can be passed to the VM as built.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                 cache_dtype: str, *, num_blocks: int | None = None,
                 memory_budget_bytes: int | None = None, device=None):
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("block_size", block_size)):
            if not is_int(value) or value <= 0:
                raise PoolConfigError(f"{name}={value!r}: must be a positive integer")
        if cache_dtype not in CACHE_DTYPES:
            raise PoolConfigError(f"cache_dtype={cache_dtype!r}: supported are {list(CACHE_DTYPES)}")
        self.n_layers, self.n_kv_heads = int(n_layers), int(n_kv_heads)
        self.head_dim, self.block_size, self.cache_dtype = int(head_dim), int(block_size), cache_dtype
        self.num_blocks = self._resolve_num_blocks(num_blocks, memory_budget_bytes)
        self.device = tvm.cpu() if device is None else device
        self._lock = threading.RLock()
        self._pools = self._new_tensors()
        self._host_views = self._make_host_views()
        self._allocator = BlockAllocator(self.num_blocks)
        self._handles: dict[int, SessionHandle] = {}
        self._alloc_id = _mint(_ALLOC_IDS)
        log.debug("KV pool %d: %d blocks, %d bytes on %s", self._alloc_id, self.num_blocks,
                  self.nbytes, self.device)

    @classmethod
    def for_artifact(cls, artifact, *, num_blocks: int | None = None,
                     memory_budget_bytes: int | None = None) -> "PagedKVCache":
        """The pool an artifact's compiled functions take: its layers, kv heads, head_dim,
        block size and cache dtype, on its device.  Size it with ``num_blocks`` or
        ``memory_budget_bytes``; with neither, room for one sequence of the artifact's full
        context (``max_blocks_cap`` blocks)."""
        m = artifact.manifest
        if num_blocks is None and memory_budget_bytes is None:
            num_blocks = m.max_blocks_cap
        return cls(m.n_layers, m.n_kv_heads, m.head_dim, m.block_size, m.cache_dtype,
                   num_blocks=num_blocks, memory_budget_bytes=memory_budget_bytes,
                   device=artifact.device)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across K and V of all layers."""
        return block_bytes(self.n_layers, self.n_kv_heads, self.head_dim, self.block_size,
                           self.cache_dtype)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def pools(self) -> tuple:
        """``(k0, v0, k1, v1, ...)``, each ``(num_blocks, n_kv_heads, block_size, head_dim)``."""
        return self._pools

    @property
    def alloc_id(self) -> int:
        """Process-unique id of the current allocation; changes only on :meth:`clear`."""
        return self._alloc_id

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator, for inspection (tests, soak); mutate it only through handles."""
        return self._allocator

    @property
    def num_free(self) -> int:
        return self._allocator.num_free

    def topology(self) -> tuple[int, int, str, int]:
        """``(n_layers, block_size, cache_dtype, alloc_id)``: what a live session depends on."""
        return self.n_layers, self.block_size, self.cache_dtype, self._alloc_id

    def new_sequence(self) -> SessionHandle:
        """An empty sequence (no blocks, length 0) owned by this pool."""
        with self._lock:
            return self._register([], 0)

    def check_handle(self, handle: SessionHandle) -> None:
        """Raise :class:`HandleError` unless ``handle`` is a live handle of this pool."""
        if not isinstance(handle, SessionHandle):
            raise HandleError(f"expected a SessionHandle, got {type(handle).__name__}; pass a "
                              "handle from pool.new_sequence()")
        with self._lock:
            if handle._pool is not self:
                raise HandleError(
                    f"sequence {handle.seq_id} belongs to another KV pool (allocation "
                    f"{handle._alloc_id}), not to this one (allocation {self._alloc_id}); "
                    "create sequences with this pool's new_sequence()")
            handle._check("check_handle")

    def owned_blocks(self) -> dict[int, list[int]]:
        """``seq_id -> blocks`` of every live handle (for tests and debugging)."""
        with self._lock:
            return {sid: list(h._blocks) for sid, h in self._handles.items()}

    def retain(self, blocks) -> None:
        """One more reference on each of ``blocks`` (allocated ones) for a holder other than a
        sequence (the prefix cache): they stay allocated until :meth:`unretain`."""
        with self._lock:
            self._allocator.incref(list(blocks))

    def unretain(self, blocks) -> None:
        """Drop a :meth:`retain` reference; a block nothing else holds is free again."""
        with self._lock:
            self._allocator.decref(list(blocks))

    def adopt(self, blocks, length: int) -> SessionHandle:
        """A new sequence of ``length`` tokens over ``blocks`` (allocated, full ones: a cached
        prefix), each shared: the sequence takes a reference of its own and writes only past
        them."""
        blocks = list(blocks)
        if length != len(blocks) * self.block_size:
            raise InputError(f"adopt({blocks}, {length}): a prefix of {len(blocks)} full blocks "
                             f"holds {len(blocks) * self.block_size} tokens")
        with self._lock:
            self._allocator.incref(blocks)
            return self._register(blocks, length)

    def check_raw_write(self, used: list[int], write_index: int) -> None:
        """A caller-managed table ``used`` (the block ids up to the written position) may write
        ``used[write_index]`` only if that hurts no other sequence: the block is held by one
        sequence whose blocks the table lists (a prefix of them), or by none and then the table
        holds no sequence's block.  Else :class:`OwnershipError`."""
        with self._lock:
            block, refs = used[write_index], self._allocator.refcount(used[write_index])
            where = f"block_table[0, {write_index}] = {block}"
            if refs > 1:
                raise OwnershipError(
                    f"{where} (the block written) is shared by {refs} sequences after fork(): "
                    "writing it would change the others' cache; call reserve() or "
                    "prepare_write(pos) on the writing handle first (copy on write) and pass "
                    "its new table")
            holder = next((h for h in self._handles.values() if block in h._blocks), None)
            if holder is not None and holder._blocks[:len(used)] != used:
                raise OwnershipError(
                    f"{where} (the block written) belongs to sequence {holder.seq_id}, whose "
                    f"blocks are {holder._blocks}, not the table's {used}; pass the writing "
                    "sequence's own table (handle.block_table)")
            taken = [b for b in used if self._allocator.refcount(b) > 0]
            if holder is None and taken:
                raise OwnershipError(
                    f"{where} (the block written) is held by no sequence, but the table also "
                    f"lists block {taken[0]} of a live sequence; a caller-managed table uses "
                    "one sequence's blocks, or only blocks no sequence holds")

    def clear(self) -> None:
        """Free every block, invalidate every live handle and mint a new ``alloc_id``.

        The tensors are kept (not zeroed): their old contents are unreachable without a handle.
        """
        with self._lock:
            self._handles.clear()
            self._allocator = BlockAllocator(self.num_blocks)
            self._alloc_id = _mint(_ALLOC_IDS)

    def __repr__(self) -> str:
        return (f"PagedKVCache(n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, "
                f"cache_dtype={self.cache_dtype!r}, num_blocks={self.num_blocks}, "
                f"free={self.num_free}, alloc_id={self._alloc_id})")

    # -- internals (called with self._lock held) ------------------------------------------------

    def _resolve_num_blocks(self, num_blocks, budget) -> int:
        if (num_blocks is None) == (budget is None):
            raise PoolConfigError(
                f"give exactly one of num_blocks ({num_blocks!r}) and memory_budget_bytes ({budget!r})")
        if num_blocks is not None:
            if not is_int(num_blocks) or num_blocks < 1:
                raise PoolConfigError(f"num_blocks={num_blocks!r}: must be a positive integer")
            return int(num_blocks)
        if not is_int(budget) or budget < 0:
            raise PoolConfigError(f"memory_budget_bytes={budget!r}: must be a non-negative integer")
        if budget < self.bytes_per_block:
            raise PoolConfigError(
                f"memory_budget_bytes={budget} holds fewer than 1 block of {self.bytes_per_block} "
                f"bytes (2 * n_layers={self.n_layers} * block_size={self.block_size} * "
                f"n_kv_heads={self.n_kv_heads} * head_dim={self.head_dim} * {self.cache_dtype}); "
                "raise the budget or shrink block_size")
        return int(budget) // self.bytes_per_block

    def _new_tensors(self) -> tuple:
        """The 2 * n_layers zeroed pool tensors: slices of one host arena on the CPU (huge
        pages, see :mod:`.host_memory`), device allocations elsewhere."""
        shape = (self.num_blocks, self.n_kv_heads, self.block_size, self.head_dim)
        n = 2 * self.n_layers
        try:
            if on_host(self.device):
                arena = HostArena.for_arrays([(shape, self.cache_dtype)] * n)
                hosts = [arena.take(shape, self.cache_dtype) for _ in range(n)]
                # the mapping is zero already and left untouched: a page becomes resident when
                # a block on it is first written, so a pool sized for many long sequences
                # costs memory only as it fills (one huge-page fault per 2 MiB)
                return tuple(to_tvm(host) for host in hosts)
            tensors = tuple(tvm.runtime.empty(shape, self.cache_dtype, self.device)
                            for _ in range(n))
        except Exception as e:  # mmap and TVM raise their own error types for out-of-memory
            raise PoolConfigError(
                f"could not allocate {n} KV pool tensors {shape} {self.cache_dtype} on "
                f"{self.device} ({self.nbytes} bytes in all: {e}); lower num_blocks or the "
                "memory budget") from e
        for tensor in tensors:
            tensor.copyfrom(np.zeros(shape, dtype=self.cache_dtype))
        return tensors

    def _make_host_views(self):
        if not on_host(self.device):
            return None
        return tuple(np.from_dlpack(t) for t in self._pools)

    def _register(self, blocks: list[int], length: int) -> SessionHandle:
        handle = SessionHandle(self, _mint(_SEQ_IDS), blocks, length)
        self._handles[handle.seq_id] = handle
        return handle

    def _unregister(self, handle: SessionHandle) -> None:
        del self._handles[handle.seq_id]

    def _shared(self, blocks: list[int], indices) -> list[int]:
        """The indices (into ``blocks``) whose block has another owner."""
        return [i for i in indices if self._allocator.refcount(blocks[i]) > 1]

    def _copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s K and V in every layer copied over block ``dst``'s: through the host
        views on the CPU; elsewhere a device-to-device copy between two one-block views of each
        pool tensor (a block is one contiguous slab of its tensor), so no data crosses to the
        host and no kernel is compiled."""
        if self._host_views is not None:
            for view in self._host_views:
                view[dst] = view[src]
            return
        shape = (1, *self._pools[0].shape[1:])
        slab = self.bytes_per_block // len(self._pools)  # one block of one pool tensor
        for t in self._pools:
            t._create_view(shape, relative_byte_offset=dst * slab).copyfrom(
                t._create_view(shape, relative_byte_offset=src * slab))

    def _cow_and_grow(self, handle: SessionHandle, shared: list[int], n_new: int) -> None:
        """Replace ``handle``'s shared blocks at ``shared`` by private copies, append ``n_new``."""
        fresh = self._allocator.allocate(len(shared) + n_new)
        old = [handle._blocks[i] for i in shared]
        try:
            for src, dst in zip(old, fresh):
                self._copy_block(src, dst)
        except BaseException:  # a failed device copy: the handle keeps its shared blocks,
            self._allocator.decref(fresh[::-1])  # the free list its order (allocate pops)
            raise
        for i, dst in zip(shared, fresh):
            handle._blocks[i] = dst
        self._allocator.decref(old)  # each stays owned by its other holders (ref count was > 1)
        handle._blocks.extend(fresh[len(shared):])
        handle.version += 1


class SessionHandle:
    """One sequence in a :class:`PagedKVCache`: its physical blocks and its length in tokens.

    Create it with ``pool.new_sequence()`` or ``handle.fork()``.  Every method raises
    :class:`HandleError` once the handle is released or its pool was cleared.  Not safe to use
    from two threads at once.
    """

    __slots__ = ("_pool", "_alloc_id", "seq_id", "_blocks", "_length", "_released", "version")

    def __init__(self, pool: PagedKVCache, seq_id: int, blocks: list[int], length: int):
        self._pool, self._alloc_id, self.seq_id = pool, pool.alloc_id, seq_id
        self._blocks, self._length, self._released = blocks, length, False
        self.version = 0  # bumped whenever the block list changes (callers cache block tables)

    @property
    def blocks(self) -> tuple[int, ...]:
        """Physical block ids in logical order (a read-only copy)."""
        with self._pool._lock:
            self._check("blocks")
            return tuple(self._blocks)

    @property
    def length(self) -> int:
        """Tokens written and advanced over so far."""
        with self._pool._lock:
            self._check("length")
            return self._length

    @property
    def capacity(self) -> int:
        """Positions covered by the blocks held: ``len(blocks) * block_size``."""
        with self._pool._lock:
            self._check("capacity")
            return len(self._blocks) * self._pool.block_size

    @property
    def is_live(self) -> bool:
        """False once released or once the pool was cleared (never raises)."""
        return not self._released and self._alloc_id == self._pool.alloc_id

    def reserve(self, n_tokens: int, max_tokens: int | None = None) -> None:
        """Make positions ``[length, length + n_tokens)`` writable, all or nothing.

        Allocates missing blocks and copies-on-write each block of that range shared with a fork.
        ``max_tokens`` is the artifact's ``max_blocks_cap * block_size``.  Raises
        :class:`CapacityError` past it, :class:`OutOfBlocksError` when the pool runs out; either
        way nothing changed.
        """
        with self._pool._lock:
            self._check("reserve")
            if not is_int(n_tokens) or n_tokens < 0:
                raise InputError(f"n_tokens={n_tokens!r}: must be a non-negative integer; pass "
                                 "the number of positions to make writable")
            target = self._length + n_tokens
            if max_tokens is not None and target > max_tokens:
                raise CapacityError(
                    f"sequence {self.seq_id}: {self._length} + {n_tokens} = {target} tokens exceed "
                    f"max_tokens={max_tokens}, the artifact's max_blocks_cap * block_size; truncate "
                    "the sequence or compile with a larger max_blocks_cap (paged-compile "
                    "--max-context)")
            if n_tokens == 0:
                return
            bs, held = self._pool.block_size, len(self._blocks)
            needed = -(-target // bs)
            shared = self._pool._shared(self._blocks, range(self._length // bs, min(needed, held)))
            self._pool._cow_and_grow(self, shared, max(needed - held, 0))

    def prepare_write(self, pos: int) -> None:
        """Copy-on-write the block holding ``pos`` (< capacity) if it is shared; else nothing.

        Needed only before writing a position that :meth:`reserve` did not cover (``pos <
        length``).  Raises :class:`OutOfBlocksError` (nothing changed) when no block is free.
        """
        with self._pool._lock:
            self._check("prepare_write")
            self._check_pos(pos)
            shared = self._pool._shared(self._blocks, [pos // self._pool.block_size])
            self._pool._cow_and_grow(self, shared, 0)

    def advance(self, n: int) -> None:
        """Count ``n`` more tokens as written; they must lie in the reserved capacity."""
        with self._pool._lock:
            self._check("advance")
            if not is_int(n) or n < 0:
                raise InputError(f"sequence {self.seq_id}: advance({n!r}): n must be a "
                                 "non-negative integer (the tokens just written)")
            if self._length + n > len(self._blocks) * self._pool.block_size:
                raise CapacityError(
                    f"sequence {self.seq_id}: advance({n}) from length {self._length} goes past "
                    f"the {len(self._blocks)} reserved blocks of {self._pool.block_size}; call "
                    f"reserve({n}) before writing")
            self._length += int(n)

    def write_offset(self, pos: int) -> int:
        """``physical_block * block_size + slot`` of logical position ``pos``.

        ``pos`` must be below the reserved capacity and its block must not be shared (call
        :meth:`reserve` or :meth:`prepare_write` first); otherwise :class:`InputError`.
        """
        with self._pool._lock:
            self._check("write_offset")
            self._check_pos(pos)
            bs = self._pool.block_size
            block = self._blocks[pos // bs]
            owners = self._pool._allocator.refcount(block)
            if owners > 1:
                raise InputError(
                    f"sequence {self.seq_id}: position {pos} is in block {block}, shared with "
                    f"{owners - 1} other sequence(s); call reserve() or prepare_write({pos}) first")
            return block * bs + pos % bs

    def block_table(self, cap: int) -> np.ndarray:
        """``int32 [cap]``: the block ids, then 0 padding.  :class:`CapacityError` if they don't fit."""
        out = np.zeros((1, check_int(cap, "cap", 0)), dtype=np.int32)
        self.fill_block_table(out)
        return out[0]

    def fill_block_table(self, out: np.ndarray) -> None:
        """Write the block ids into the caller's ``int32 (1, cap)`` array in place, 0 after them."""
        check_array(out, "block table", np.int32, (1, None))
        with self._pool._lock:
            self._check("fill_block_table")
            n, cap = len(self._blocks), out.shape[1]
            if n > cap:
                raise CapacityError(
                    f"sequence {self.seq_id}: {n} blocks do not fit a block table of {cap} entries "
                    "(the artifact's max_blocks_cap); truncate the sequence or compile with a "
                    "larger max_blocks_cap (paged-compile --max-context)")
            out[0, :n] = self._blocks
            out[0, n:] = 0

    def snapshot(self) -> Snapshot:
        """The handle's blocks (with their allocation generations) and length before a step,
        for :meth:`restore` if the step fails."""
        with self._pool._lock:
            self._check("snapshot")
            alloc = self._pool._allocator
            return Snapshot(tuple((b, alloc.generation(b)) for b in self._blocks), self._length,
                            self.seq_id)

    def next_write_offset(self) -> int | None:
        """Offset of position ``length`` when writing it needs no new block and no copy (the
        common decode step), else None (then :meth:`reserve` has work to do).  Changes nothing."""
        with self._pool._lock:
            self._check("next_write_offset")
            pos, bs = self._length, self._pool.block_size
            if pos >= len(self._blocks) * bs:
                return None
            block = self._blocks[pos // bs]
            if self._pool._allocator.refcount(block) != 1:
                return None
            return block * bs + pos % bs

    def restore(self, snap: tuple) -> None:
        """Undo :meth:`reserve` / :meth:`prepare_write` since ``snap`` (nothing advanced since).

        Blocks allocated since are freed; a shared block that copy-on-write replaced is taken
        back (and its private copy freed) while another sequence still holds it.  One that its
        other owners released meanwhile (free, or allocated again: its generation changed) is
        not taken back: the private copy (same contents up to ``length``) stays.  A released or
        cleared handle is left alone.
        """
        with self._pool._lock:
            if not self.is_live:
                return
            blocks, length = self._check_snapshot(snap)
            alloc = self._pool._allocator
            give_back = self._blocks[len(blocks):]
            for i, (old, generation) in enumerate(blocks):
                held = alloc.refcount(old) > 0 and alloc.generation(old) == generation
                if self._blocks[i] != old and held:
                    alloc.incref([old])
                    give_back.append(self._blocks[i])
                    self._blocks[i] = old
            alloc.decref(give_back)
            del self._blocks[len(blocks):]
            self.version += 1

    def _check_snapshot(self, snap) -> tuple:
        """``(blocks, length)`` of ``snap`` if :meth:`snapshot` made it for this handle at its
        current length, else :class:`InputError` (restoring another handle's or a stale snapshot
        would free blocks that hold live tokens)."""
        if not isinstance(snap, Snapshot) or snap.seq_id != self.seq_id:
            owner = f"sequence {snap.seq_id}'s" if isinstance(snap, Snapshot) else repr(snap)
            raise InputError(f"sequence {self.seq_id}: restore() got {owner} snapshot; pass what "
                             "this handle's snapshot() returned before reserve()")
        if snap.length != self._length or len(snap.blocks) > len(self._blocks):
            raise InputError(f"sequence {self.seq_id}: the snapshot is at length {snap.length}, "
                             f"the handle at {self._length}: restore() undoes reserve() / "
                             "prepare_write() only, not advance(); use truncate_to() to drop "
                             "written tokens")
        return snap.blocks, snap.length

    def truncate_to(self, n: int) -> None:
        """Shorten to ``n`` tokens (``0 <= n <= length``); blocks no longer needed are freed."""
        with self._pool._lock:
            self._check("truncate_to")
            if not is_int(n) or not 0 <= n <= self._length:
                raise InputError(f"sequence {self.seq_id}: truncate_to({n!r}) needs 0 <= n <= "
                                 f"length {self._length}; pass a length the sequence has")
            keep = -(-n // self._pool.block_size)
            self._pool._allocator.decref(self._blocks[keep:])
            del self._blocks[keep:]
            self.version += 1
            self._length = n

    def fork(self) -> SessionHandle:
        """A new sequence sharing all of this one's blocks (copy-on-write) and its length."""
        with self._pool._lock:
            self._check("fork")
            self._pool._allocator.incref(self._blocks)
            return self._pool._register(list(self._blocks), self._length)

    def release(self) -> None:
        """Give the blocks back.  A second release is a :class:`HandleError`."""
        with self._pool._lock:
            self._check("release")
            self._pool._allocator.decref(self._blocks)
            self._pool._unregister(self)
            self._released = True

    def __repr__(self) -> str:
        state = "live" if self.is_live else "released" if self._released else "cleared"
        return (f"SessionHandle(seq_id={self.seq_id}, {state}, length={self._length}, "
                f"blocks={self._blocks})")

    def _check(self, op: str) -> None:
        if self._released:
            raise HandleError(f"sequence {self.seq_id}: {op}() on a released handle; start a new "
                              "sequence with pool.new_sequence()")
        if self._alloc_id != self._pool.alloc_id:
            raise HandleError(
                f"sequence {self.seq_id}: {op}() on a handle of pool allocation {self._alloc_id}, "
                f"but the pool was cleared (now allocation {self._pool.alloc_id}); start a new "
                "sequence with pool.new_sequence()")

    def _check_pos(self, pos: int) -> None:
        cap = len(self._blocks) * self._pool.block_size
        if not is_int(pos) or not 0 <= pos < cap:
            raise InputError(f"sequence {self.seq_id}: position {pos!r} is outside the reserved "
                             f"capacity [0, {cap}); call reserve() first")
