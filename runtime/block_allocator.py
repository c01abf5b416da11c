"""The block allocator of a KV pool: a LIFO free list and per-block ref counts.

Pure bookkeeping over the ids ``0 .. num_blocks - 1`` (no tensors, no locking: the owning
:class:`~paged_decode.runtime.kv_pool.PagedKVCache` serialises calls under its lock).
Invariants, checked by :meth:`BlockAllocator.check_invariants`: no block both free and owned,
owned + free = total, ref counts >= 0, no duplicate in the free list.
"""

from __future__ import annotations

import collections


from paged_decode.runtime.checks import is_int
from paged_decode.runtime.errors import OutOfBlocksError


class BlockAllocator:
    """Free list (LIFO) and ref counts over the block ids ``0 .. num_blocks - 1``.

    Pure Python and not locked: :class:`PagedKVCache` calls it under its own lock.  Misuse by the
    pool itself (decref of a free block, incref of a free block) is an ``AssertionError``.
    """

    def __init__(self, num_blocks: int):
        assert is_int(num_blocks) and num_blocks >= 1, num_blocks
        self._num_blocks = int(num_blocks)
        self._free = list(range(self._num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._ref = [0] * self._num_blocks
        self._generation = [0] * self._num_blocks  # bumped on each allocation of a block

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def generation(self, block: int) -> int:
        """How often ``block`` was allocated: tells a block still held from a reused one."""
        return self._generation[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with ref count 1, or :class:`OutOfBlocksError` and no change."""
        assert is_int(n) and n >= 0, n
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), self._num_blocks)
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
            self._generation[b] += 1
        return blocks

    def incref(self, blocks) -> None:
        for b in blocks:
            assert self._ref[b] > 0, f"incref of free block {b}"
        for b in blocks:
            self._ref[b] += 1

    def decref(self, blocks) -> None:
        """Drop one reference per listed block; a block whose count reaches 0 is free again."""
        for b, n in collections.Counter(blocks).items():
            assert self._ref[b] >= n, f"decref of block {b} below 0 (ref count {self._ref[b]})"
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def state(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(free list, ref counts)`` as tuples, to compare before/after in tests."""
        return tuple(self._free), tuple(self._ref)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"duplicate block in the free list {self._free}"
        assert all(0 <= b < self._num_blocks for b in free), f"bad block id in {self._free}"
        for b, ref in enumerate(self._ref):
            assert ref >= 0, f"block {b}: negative ref count {ref}"
            assert (ref == 0) == (b in free), f"block {b}: ref count {ref}, free={b in free}"
        owned = sum(1 for ref in self._ref if ref > 0)
        assert owned + len(free) == self._num_blocks, (owned, len(free), self._num_blocks)
