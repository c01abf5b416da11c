"""Prefix caching: full KV blocks kept after their sequence ends, found again by their tokens.

A full block is named by a hash chain over the tokens up to its end (``h_i = sha256(h_{i-1} ||
tokens of block i)``), as vLLM and mlc-llm do, so a block matches only with the same tokens
before it too.  The cache holds one reference of its own on each cached block (the allocator's
ref count), so the block outlives its sequence; a request whose prompt begins with cached blocks
starts a sequence holding them (:meth:`PagedKVCache.adopt`) and prefills only the rest.
Cached blocks that nothing else references are evicted least recently used when the pool needs
room; a block some sequence still holds is never freed by the cache (dropping the cache's
reference leaves the sequence's).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from .kv_pool import PagedKVCache


def block_hashes(tokens, block_size: int, n_blocks: int, known=()) -> list[bytes]:
    """The chain hashes of the first ``n_blocks`` full blocks of ``tokens``; ``known``: those
    of its leading blocks already computed (not recomputed)."""
    out = list(known[:n_blocks])
    h = out[-1] if out else b""
    ids = np.asarray(tokens[len(out) * block_size:n_blocks * block_size], np.int64)
    for i in range(n_blocks - len(out)):
        h = hashlib.sha256(h + ids[i * block_size:(i + 1) * block_size].tobytes()).digest()
        out.append(h)
    return out


class PrefixCache:
    """Full blocks by chain hash over one pool, LRU among the ones only the cache holds."""

    def __init__(self, pool: PagedKVCache):
        self.pool = pool
        self._alloc_id = pool.alloc_id
        self._by_hash: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._cached: set[int] = set()  # the blocks in _by_hash
        self.lookups = self.hits = self.hit_blocks = self.tokens_saved = self.evictions = 0

    def __len__(self) -> int:
        self._check_allocation()
        return len(self._by_hash)

    def _check_allocation(self) -> None:
        """A cleared pool took every block back: forget them (holding no references)."""
        if self.pool.alloc_id != self._alloc_id:
            self._by_hash.clear()
            self._cached.clear()
            self._alloc_id = self.pool.alloc_id

    def match(self, tokens) -> list[int]:
        """The cached blocks that begin ``tokens`` (longest prefix), at most all but the block
        holding the last token (its logits must be computed).  Marks them recently used and
        counts the lookup."""
        blocks = self._lookup(tokens)
        self.lookups += 1
        if blocks:
            self.hits += 1
            self.hit_blocks += len(blocks)
            self.tokens_saved += len(blocks) * self.pool.block_size
        return blocks

    def peek(self, tokens) -> int:
        """How many blocks :meth:`match` would find now; marks them recently used (so making
        room for the request that asks does not evict them first), counts nothing."""
        return len(self._lookup(tokens))

    def _lookup(self, tokens) -> list[int]:
        self._check_allocation()
        bs = self.pool.block_size
        blocks = []
        for h in block_hashes(tokens, bs, (len(tokens) - 1) // bs):
            block = self._by_hash.get(h)
            if block is None:
                break
            self._by_hash.move_to_end(h)
            blocks.append(block)
        return blocks

    def insert(self, tokens, blocks, known: list | None = None) -> int:
        """Cache the full blocks among ``blocks`` (a sequence's, holding ``tokens``) that are
        not cached yet; returns how many were added.  ``known``: the chain hashes of the
        sequence's leading blocks computed by an earlier call, extended here in place (a
        sequence cached block by block as it fills them hashes each block once)."""
        self._check_allocation()
        n = min(len(tokens) // self.pool.block_size, len(blocks))
        hashes = block_hashes(tokens, self.pool.block_size, n, known or ())
        if known is not None:
            known[len(known):] = hashes[len(known):]
        added = []
        for h, block in zip(hashes, blocks[:n]):
            if h in self._by_hash:
                self._by_hash.move_to_end(h)
            elif block not in self._cached:
                self._by_hash[h] = block
                self._cached.add(block)
                added.append(block)
        self.pool.retain(added)
        return len(added)

    @property
    def evictable(self) -> int:
        """Cached blocks that only the cache holds (what :meth:`evict` can free)."""
        self._check_allocation()
        return sum(1 for b in self._by_hash.values() if self.pool.allocator.refcount(b) == 1)

    def evict(self, n: int) -> int:
        """Free up to ``n`` blocks that only the cache holds, least recently used first;
        returns how many were freed."""
        self._check_allocation()
        gone = [h for h, b in self._by_hash.items() if self.pool.allocator.refcount(b) == 1][:n]
        blocks = [self._by_hash.pop(h) for h in gone]
        self._cached.difference_update(blocks)
        self.pool.unretain(blocks)
        self.evictions += len(blocks)
        return len(blocks)

    def stats(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "hit_blocks": self.hit_blocks,
                "tokens_saved": self.tokens_saved, "cached_blocks": len(self),
                "evictions": self.evictions}
