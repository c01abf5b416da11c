"""Random soak of the paged KV pool: new/append/reserve/fork/truncate/release/clear, with the
allocator and ref-count invariants checked after every operation.  Not part of CI.

    python scripts/soak_allocator.py [--ops 100000] [--num-blocks 32] [--block-size 4] [--seed 0]
                                     [--no-check]
"""

from __future__ import annotations

import argparse
import collections
import random
import time

from paged_decode.runtime.errors import CapacityError, OutOfBlocksError
from paged_decode.runtime.kv_pool import PagedKVCache

OPS = ["new", "append", "reserve", "fork", "truncate", "release", "clear"]
WEIGHTS = [10, 40, 8, 10, 12, 18, 1]


def check(pool: PagedKVCache, handles: dict) -> None:
    pool.allocator.check_invariants()
    owned = pool.owned_blocks()
    assert owned.keys() == handles.keys()
    owners = collections.Counter(b for blocks in owned.values() for b in blocks)
    for b in range(pool.num_blocks):
        assert pool.allocator.refcount(b) == owners.get(b, 0), b
    assert len(owners) + pool.num_free == pool.num_blocks
    for h in handles.values():
        assert len(h.blocks) * pool.block_size >= h.length


def step(pool, handles, op, rng, max_tokens, tally):
    if op == "clear":
        pool.clear()
        handles.clear()
        return
    if op == "new" or not handles:
        h = pool.new_sequence()
        handles[h.seq_id] = h
        return
    h = handles[rng.choice(list(handles))]
    if op in ("append", "reserve"):
        n, before = rng.randint(1, 2 * pool.block_size), h.blocks
        try:
            h.reserve(n, max_tokens=max_tokens)
        except (OutOfBlocksError, CapacityError) as e:
            assert h.blocks == before
            tally[type(e).__name__] += 1
            return
        tally["cow_copies"] += sum(a != b for a, b in zip(before, h.blocks))
        if op == "append":
            h.write_offset(h.length + n - 1)  # must be writable after reserve (COW done)
            h.advance(n)
    elif op == "fork":
        child = h.fork()
        handles[child.seq_id] = child
    elif op == "truncate":
        h.truncate_to(rng.randint(0, h.length))
    elif op == "release":
        h.release()
        del handles[h.seq_id]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--num-blocks", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="time the operations alone")
    args = parser.parse_args()

    pool = PagedKVCache(2, 1, 4, args.block_size, "float32", num_blocks=args.num_blocks)
    max_tokens = args.num_blocks // 2 * args.block_size
    rng, handles, tally = random.Random(args.seed), {}, collections.Counter()
    start = time.perf_counter()
    for _ in range(args.ops):
        op = rng.choices(OPS, WEIGHTS)[0]
        tally[op] += 1
        step(pool, handles, op, rng, max_tokens, tally)
        if not args.no_check:
            check(pool, handles)
    elapsed = time.perf_counter() - start

    print(f"{args.ops} ops in {elapsed:.2f} s: {args.ops / elapsed:,.0f} ops/s "
          f"({'no checks' if args.no_check else 'invariants checked every op'})")
    print("ops:", dict(sorted(tally.items())))
    print(f"final: {len(handles)} live sequences, {pool.num_free} free of {pool.num_blocks} blocks, "
          f"alloc_id {pool.alloc_id}")


if __name__ == "__main__":
    main()
