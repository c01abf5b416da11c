"""State-transition tests of the paged KV pool on 4–8 blocks, plus a stateful hypothesis model."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_decode.runtime.errors import (
    CapacityError, ConfigError, HandleError, InputError, OutOfBlocksError,
)
from paged_decode.runtime.kv_pool import BlockAllocator, PagedKVCache, PoolConfigError, k_rows

BS = 4  # block_size of the small pools


def small_pool(num_blocks=6, block_size=BS, cache_dtype="float32", n_layers=2):
    return PagedKVCache(n_layers, 1, 2, block_size, cache_dtype, num_blocks=num_blocks)


def views(pool):
    return [np.from_dlpack(t) for t in pool.pools]


def at(view, off):
    """The (Hkv, D) row of flattened offset ``off`` in a (blocks, Hkv, block_size, D) pool."""
    return view[off // view.shape[2], :, off % view.shape[2]]


def snapshot(pool, *handles):
    """Everything a failed call must leave unchanged."""
    return (pool.alloc_id, pool.allocator.state(), pool.owned_blocks(),
            [(h.blocks, h.length) for h in handles], [v.tobytes() for v in views(pool)])


def append(pool, handle, values):
    """Write one value per token into every layer's K (value) and V (-value), then advance."""
    handle.reserve(len(values))
    for k, value in enumerate(values):
        off = handle.write_offset(handle.length + k)
        for i, view in enumerate(views(pool)):
            at(view, off)[...] = value if i % 2 == 0 else -value
    handle.advance(len(values))


def read(pool, handle, pos):
    block = handle.blocks[pos // pool.block_size]
    return [float(v[block, 0, pos % pool.block_size, 0]) for v in views(pool)]


def assert_tokens(pool, handle, values):
    assert handle.length == len(values)
    for pos, value in enumerate(values):
        assert read(pool, handle, pos) == [value, -value] * pool.n_layers


# -- BlockAllocator ------------------------------------------------------------------------------

def test_allocator_lifecycle():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1] and a.num_free == 2
    a.incref([1])
    assert [a.refcount(b) for b in range(4)] == [1, 2, 0, 0]
    a.decref([0, 1])
    assert a.refcount(0) == 0 and a.refcount(1) == 1 and a.num_free == 3
    assert a.allocate(1) == [0]  # LIFO: the block freed last comes back first
    a.check_invariants()


def test_allocator_all_or_nothing():
    a = BlockAllocator(4)
    a.allocate(3)
    before = a.state()
    with pytest.raises(OutOfBlocksError) as e:
        a.allocate(2)
    assert (e.value.requested, e.value.free, e.value.total) == (2, 1, 4)
    assert "requested 2, free 1 of 4" in str(e.value)
    assert a.state() == before


def test_allocator_decref_of_free_block_is_internal_error():
    a = BlockAllocator(4)
    a.allocate(1)
    with pytest.raises(AssertionError):
        a.decref([2])
    with pytest.raises(AssertionError):
        a.decref([0, 0])
    a.check_invariants()


# -- PagedKVCache construction -------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_pool_tensors(cache_dtype):
    pool = small_pool(num_blocks=5, cache_dtype=cache_dtype)
    pools = pool.pools
    assert isinstance(pools, tuple) and len(pools) == 2 * pool.n_layers
    for t in pools:
        assert tuple(t.shape) == (5, 1, BS, 2) and str(t.dtype) == cache_dtype
        assert not np.from_dlpack(t).any()
    itemsize = 4 if cache_dtype == "float32" else 2
    assert pool.bytes_per_block == 2 * 2 * BS * 1 * 2 * itemsize
    assert pool.nbytes == 5 * pool.bytes_per_block
    assert pool.topology() == (2, BS, cache_dtype, pool.alloc_id)
    pool.clear()
    assert pool.pools is pools and all(a is b for a, b in zip(pool.pools, pools))


def test_memory_budget_gives_num_blocks():
    per_block = small_pool().bytes_per_block
    pool = PagedKVCache(2, 1, 2, BS, "float32", memory_budget_bytes=7 * per_block + per_block - 1)
    assert pool.num_blocks == 7 and pool.nbytes == 7 * per_block


def test_memory_budget_below_one_block():
    with pytest.raises(PoolConfigError) as e:
        PagedKVCache(2, 1, 2, BS, "float32", memory_budget_bytes=100)
    assert isinstance(e.value, InputError) and isinstance(e.value, ConfigError)
    assert "100" in str(e.value) and "128" in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=4, memory_budget_bytes=4096), dict(), dict(num_blocks=0),
    dict(num_blocks=2.0), dict(memory_budget_bytes=-1),
])
def test_pool_size_arguments(kwargs):
    with pytest.raises(PoolConfigError):
        PagedKVCache(2, 1, 2, BS, "float32", **kwargs)


@pytest.mark.parametrize("args", [
    (0, 1, 2, 4, "float32"), (2, -1, 2, 4, "float32"), (2, 1, 2, 0, "float32"),
    (2, 1, 2, 4, "bfloat16"), (True, 1, 2, 4, "float32"),
])
def test_pool_shape_arguments(args):
    with pytest.raises(PoolConfigError):
        PagedKVCache(*args, num_blocks=4)


def test_alloc_ids_unique():
    ids = [small_pool().alloc_id for _ in range(3)]
    assert len(set(ids)) == 3


# -- growth, exhaustion, truncation --------------------------------------------------------------

def test_growth_across_block_boundaries():
    pool = small_pool(num_blocks=4)
    h = pool.new_sequence()
    for n in range(1, 4 * BS + 1):
        append(pool, h, [float(n)])
        assert len(h.blocks) == -(-n // BS) and pool.num_free == 4 - len(h.blocks)
    assert_tokens(pool, h, [float(n) for n in range(1, 4 * BS + 1)])
    pool.allocator.check_invariants()


def test_reserve_is_idempotent_and_advance_stays_inside():
    pool = small_pool()
    h = pool.new_sequence()
    h.reserve(BS + 1)
    h.reserve(BS + 1)
    assert len(h.blocks) == 2 and h.capacity == 2 * BS and h.length == 0
    h.advance(BS + 1)
    with pytest.raises(CapacityError, match=r"advance\(4\) from length 5 goes past the 2 "
                                            r"reserved blocks of 4; call reserve\(4\)"):
        h.advance(BS)
    for bad in (-1, 1.0, True, "1", None):
        with pytest.raises(InputError, match=r"advance\(.*\): n must be a non-negative integer"):
            h.advance(bad)
    assert h.length == BS + 1


def test_restore_refuses_another_handles_or_a_stale_snapshot():
    pool = small_pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    a.reserve(2)
    a.advance(2)
    b.reserve(1)
    snap_a, snap_b = a.snapshot(), b.snapshot()
    before = (a.blocks, b.blocks, pool.num_free)
    with pytest.raises(InputError, match=r"restore\(\) got sequence \d+'s snapshot"):
        b.restore(snap_a)
    for bad in (None, ((0, 1), 2), ((), 0)):
        with pytest.raises(InputError, match=r"restore\(\) got .* snapshot"):
            a.restore(bad)
    a.reserve(1)
    a.advance(1)
    with pytest.raises(InputError, match=r"snapshot is at length 2, the handle at 3"):
        a.restore(snap_a)
    b.restore(snap_b)
    assert (a.blocks, b.blocks) == before[:2] and a.length == 3
    pool.allocator.check_invariants()


def test_exhaustion_changes_nothing():
    pool = small_pool(num_blocks=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    append(pool, a, [1.0] * (3 * BS - 2))
    append(pool, b, [2.0] * 2)
    c = pool.new_sequence()
    assert pool.num_free == 0
    before = snapshot(pool, a, b, c)
    with pytest.raises(OutOfBlocksError) as e:
        b.reserve(3 * BS)  # 14 tokens need 4 blocks, b holds 1
    assert (e.value.requested, e.value.free, e.value.total) == (3, 0, 4)
    with pytest.raises(OutOfBlocksError):
        c.reserve(1)
    assert snapshot(pool, a, b, c) == before
    a.reserve(2)  # fits in a's last block: no allocation needed
    assert pool.num_free == 0


def test_capacity_error_names_the_limit():
    pool = small_pool()
    h = pool.new_sequence()
    append(pool, h, [1.0] * 3)
    before = snapshot(pool, h)
    with pytest.raises(CapacityError, match=r"3 \+ 6 = 9 tokens exceed max_tokens=8.*max_blocks_cap"):
        h.reserve(6, max_tokens=8)
    assert snapshot(pool, h) == before
    h.reserve(5, max_tokens=8)


def test_truncate_frees_blocks_and_keeps_alloc_id():
    pool = small_pool()
    h = pool.new_sequence()
    append(pool, h, [float(i) for i in range(10)])
    alloc_id = pool.alloc_id
    h.truncate_to(5)
    assert len(h.blocks) == 2 and pool.num_free == 4 and pool.alloc_id == alloc_id
    assert_tokens(pool, h, [float(i) for i in range(5)])
    h.truncate_to(0)
    assert h.blocks == () and pool.num_free == 6
    for bad in (-1, 1, 0.5):
        with pytest.raises(InputError):
            h.truncate_to(bad)


def test_truncate_drops_reserved_capacity():
    pool = small_pool()
    h = pool.new_sequence()
    h.reserve(3 * BS)
    h.advance(1)
    h.truncate_to(1)
    assert len(h.blocks) == 1 and pool.num_free == 5


# -- offsets and block tables --------------------------------------------------------------------

def test_write_offset_values():
    pool = small_pool()
    other, h = pool.new_sequence(), pool.new_sequence()
    other.reserve(1)  # takes block 0, so h's blocks are not the identity
    h.reserve(2 * BS + 1)
    blocks = h.blocks
    assert blocks == (1, 2, 3)
    for pos in range(3 * BS):
        assert h.write_offset(pos) == blocks[pos // BS] * BS + pos % BS
    for bad in (-1, 3 * BS, 1.0):
        with pytest.raises(InputError, match="reserve"):
            h.write_offset(bad)


def test_block_table_padding():
    pool = small_pool()
    h = pool.new_sequence()
    h.reserve(2 * BS + 1)
    assert h.block_table(5).tolist() == [0, 1, 2, 0, 0]
    assert h.block_table(5).dtype == np.int32
    out = np.full((1, 6), 77, dtype=np.int32)
    h.fill_block_table(out)
    assert out.tolist() == [[0, 1, 2, 0, 0, 0]]
    h.truncate_to(0)
    h.fill_block_table(out)
    assert out.tolist() == [[0] * 6]


def test_block_table_errors():
    pool = small_pool()
    h = pool.new_sequence()
    h.reserve(3 * BS)
    with pytest.raises(CapacityError, match="3 blocks do not fit a block table of 2"):
        h.block_table(2)
    for bad in (np.zeros((1, 4), np.int64), np.zeros(4, np.int32), np.zeros((2, 4), np.int32)):
        with pytest.raises(InputError):
            h.fill_block_table(bad)


# -- fork and copy-on-write ----------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_fork_shares_then_copies_on_write(cache_dtype):
    pool = small_pool(cache_dtype=cache_dtype)
    parent = pool.new_sequence()
    append(pool, parent, [float(i) for i in range(BS + 2)])  # blocks 0 (full), 1 (2 of 4)
    child = parent.fork()
    assert child.blocks == parent.blocks == (0, 1) and child.length == BS + 2
    assert [pool.allocator.refcount(b) for b in (0, 1)] == [2, 2]
    before = [v.copy() for v in views(pool)]

    child.reserve(1)  # position BS + 2 lies in shared block 1: copied into a fresh block
    assert child.blocks == (0, 2) and parent.blocks == (0, 1)
    assert [pool.allocator.refcount(b) for b in (0, 1, 2)] == [2, 1, 1]
    for old, new in zip(before, views(pool)):
        np.testing.assert_array_equal(new[2], old[1])  # exactly the shared block's data
        np.testing.assert_array_equal(np.delete(new, 2, 0), np.delete(old, 2, 0))

    child.write_offset(BS + 2)
    with pytest.raises(InputError, match="shared"):
        child.write_offset(0)
    append(pool, child, [100.0])
    append(pool, parent, [200.0])  # parent's block 1 is now its own: no copy
    assert parent.blocks == (0, 1) and pool.num_free == 3
    assert_tokens(pool, parent, [float(i) for i in range(BS + 2)] + [200.0])
    assert_tokens(pool, child, [float(i) for i in range(BS + 2)] + [100.0])
    pool.allocator.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    pool = small_pool()
    parent = pool.new_sequence()
    append(pool, parent, [1.0] * BS)
    child = parent.fork()
    child.reserve(1)
    assert child.blocks == (0, 1) and pool.allocator.refcount(0) == 2


def test_prepare_write_copies_an_earlier_block():
    pool = small_pool()
    parent = pool.new_sequence()
    append(pool, parent, [float(i) for i in range(BS + 1)])
    child = parent.fork()
    child.prepare_write(1)
    assert child.blocks == (2, 1) and pool.allocator.refcount(0) == 1
    off = child.write_offset(1)
    at(views(pool)[0], off)[...] = 42.0
    assert read(pool, parent, 1)[0] == 1.0 and read(pool, child, 1)[0] == 42.0
    child.prepare_write(1)  # already private: nothing happens
    assert child.blocks == (2, 1)


def test_failed_copy_on_write_changes_nothing():
    pool = small_pool(num_blocks=4)
    parent = pool.new_sequence()
    append(pool, parent, [float(i) for i in range(BS + 2)])
    child = parent.fork()
    filler = pool.new_sequence()
    filler.reserve(BS + 1)  # takes the 2 free blocks
    before = snapshot(pool, parent, child, filler)
    with pytest.raises(OutOfBlocksError) as e:
        child.reserve(BS)  # copy of block 1 + a new block
    assert (e.value.requested, e.value.free) == (2, 0)
    with pytest.raises(OutOfBlocksError):
        child.prepare_write(0)
    assert snapshot(pool, parent, child, filler) == before


def test_copy_on_write_off_the_host_copies_between_device_views():
    """A pool off the CPU has no host view: copy-on-write copies each layer's block between two
    one-block views of its tensor on the device; forced here on CPU tensors, whose values are
    checked.  A copy that fails leaves the handles, ref counts and free list as they were."""
    pool = small_pool(num_blocks=6, n_layers=3)
    parent = pool.new_sequence()
    append(pool, parent, [float(i) for i in range(BS + 2)])
    child = parent.fork()
    pool._host_views = None  # what a non-CPU pool has
    real_copy = pool._copy_block
    pool._copy_block = lambda src, dst: (_ for _ in ()).throw(RuntimeError("device lost"))
    before = snapshot(pool, parent, child)
    with pytest.raises(RuntimeError, match="device lost"):
        child.reserve(1)
    assert snapshot(pool, parent, child) == before
    pool._copy_block = real_copy
    child.reserve(1)  # copies the shared last block in all six pool tensors
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    assert_tokens(pool, child, [float(i) for i in range(BS + 2)])
    off = child.write_offset(BS + 1)
    for view in views(pool):
        at(view, off)[...] = 42.0
    assert_tokens(pool, parent, [float(i) for i in range(BS + 2)])
    untouched = [v.copy() for v in views(pool)]
    other = set(range(6)) - {*parent.blocks, *child.blocks}
    assert all((v[list(other)] == 0).all() for v in untouched)  # no stray write


def test_release_of_fork_keeps_shared_blocks():
    pool = small_pool()
    parent = pool.new_sequence()
    append(pool, parent, [1.0] * (BS + 1))
    child = parent.fork()
    parent.release()
    assert pool.num_free == 4 and pool.owned_blocks() == {child.seq_id: [0, 1]}
    assert [pool.allocator.refcount(b) for b in (0, 1)] == [1, 1]
    child.release()
    assert pool.num_free == 6 and pool.owned_blocks() == {}


# -- release, clear, foreign handles -------------------------------------------------------------

HANDLE_CALLS = [
    lambda h: h.reserve(1), lambda h: h.advance(0), lambda h: h.write_offset(0),
    lambda h: h.block_table(4), lambda h: h.fill_block_table(np.zeros((1, 4), np.int32)),
    lambda h: h.truncate_to(0), lambda h: h.fork(), lambda h: h.release(),
    lambda h: h.prepare_write(0), lambda h: h.blocks, lambda h: h.length,
]


def test_release_then_every_method_raises():
    pool = small_pool()
    h = pool.new_sequence()
    append(pool, h, [1.0] * 5)
    h.release()
    assert pool.num_free == 6 and not h.is_live
    for call in HANDLE_CALLS:
        with pytest.raises(HandleError, match=f"sequence {h.seq_id}: .*released"):
            call(h)


def test_clear_invalidates_handles_and_mints_alloc_id():
    pool = small_pool()
    a = pool.new_sequence()
    append(pool, a, [1.0] * 5)
    b = a.fork()
    old_id = pool.alloc_id
    pool.clear()
    assert pool.alloc_id != old_id and pool.num_free == 6 and pool.owned_blocks() == {}
    assert pool.topology()[3] == pool.alloc_id
    for h in (a, b):
        assert not h.is_live
        for call in HANDLE_CALLS:
            with pytest.raises(HandleError, match=f"sequence {h.seq_id}: .*cleared"):
                call(h)
    c = pool.new_sequence()
    append(pool, c, [2.0])
    assert c.blocks == (0,)


def test_handle_of_another_pool():
    pool, other = small_pool(), small_pool()
    h = other.new_sequence()
    pool.check_handle(pool.new_sequence())
    with pytest.raises(HandleError, match=f"sequence {h.seq_id} belongs to another KV pool"):
        pool.check_handle(h)
    with pytest.raises(HandleError):
        pool.check_handle("not a handle")


def test_threads_on_separate_handles():
    pool = small_pool(num_blocks=8, block_size=2)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                h = pool.new_sequence()
                try:
                    h.reserve(int(rng.integers(1, 4)))
                    h.advance(1)
                    h.fork().release()
                except OutOfBlocksError:
                    pass
                h.release()
        except Exception as e:  # a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.num_free == 8 and pool.owned_blocks() == {}
    pool.allocator.check_invariants()


# -- stateful model ------------------------------------------------------------------------------

MAX_TOKENS = 12


class PoolMachine(RuleBasedStateMachine):
    """A model of owners and token values checked against the pool after every step."""

    def __init__(self):
        super().__init__()
        self.pool = PagedKVCache(1, 1, 2, 2, "float32", num_blocks=6)
        self.tokens: dict[int, list[float]] = {}  # seq_id -> values written
        self.handles = {}
        self.dead = []
        self.alloc_id = self.pool.alloc_id
        self.next_value = 1.0

    def _pick(self, i):
        seq_ids = sorted(self.handles)
        return self.handles[seq_ids[i % len(seq_ids)]]

    @rule()
    def new_sequence(self):
        h = self.pool.new_sequence()
        self.handles[h.seq_id], self.tokens[h.seq_id] = h, []

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), n=st.integers(0, 5))
    def append(self, i, n):
        h = self._pick(i)
        before = snapshot(self.pool, *self.handles.values())
        values = [self.next_value + k for k in range(n)]
        try:
            h.reserve(n, max_tokens=MAX_TOKENS)
        except (OutOfBlocksError, CapacityError):
            assert snapshot(self.pool, *self.handles.values()) == before
            return
        append(self.pool, h, values)
        self.tokens[h.seq_id] += values
        self.next_value += n

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), n=st.integers(1, 5))
    def reserve_only(self, i, n):
        h = self._pick(i)
        try:
            h.reserve(n, max_tokens=MAX_TOKENS)
        except (OutOfBlocksError, CapacityError):
            pass

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        h = self._pick(i)
        child = h.fork()
        self.handles[child.seq_id], self.tokens[child.seq_id] = child, list(self.tokens[h.seq_id])

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        h = self._pick(i)
        n = int(h.length * frac)
        h.truncate_to(n)
        del self.tokens[h.seq_id][n:]

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        h = self._pick(i)
        h.release()
        del self.handles[h.seq_id], self.tokens[h.seq_id]
        self.dead.append(h)

    @precondition(lambda self: len(self.handles) >= 4 or self.pool.num_free == 0)  # keep it rare
    @rule()
    def clear(self):
        self.pool.clear()
        assert self.pool.alloc_id != self.alloc_id
        self.alloc_id = self.pool.alloc_id
        self.dead += self.handles.values()
        self.handles.clear()
        self.tokens.clear()

    @precondition(lambda self: self.dead)
    @rule(i=st.integers(0, 99), call=st.sampled_from(HANDLE_CALLS))
    def dead_handle_raises(self, i, call):
        h = self.dead[i % len(self.dead)]
        with pytest.raises(HandleError):
            call(h)

    @invariant()
    def allocator_consistent(self):
        self.pool.allocator.check_invariants()
        assert self.pool.alloc_id == self.alloc_id

    @invariant()
    def ref_counts_equal_owners(self):
        owned = self.pool.owned_blocks()
        assert owned.keys() == self.handles.keys()
        owners = collections.Counter(b for blocks in owned.values() for b in blocks)
        for blocks in owned.values():
            assert len(set(blocks)) == len(blocks)
        refs = {b: self.pool.allocator.refcount(b) for b in range(self.pool.num_blocks)}
        assert {b: r for b, r in refs.items() if r} == dict(owners)
        assert len(owners) + self.pool.num_free == self.pool.num_blocks

    @invariant()
    def data_matches_model(self):
        for seq_id, h in self.handles.items():
            assert len(h.blocks) >= -(-h.length // 2)
            values = self.tokens[seq_id]
            assert h.length == len(values)
            for pos, value in enumerate(values):
                assert read(self.pool, h, pos) == [value, -value]


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_k_rows_reads_each_k_block_layout_as_rows():
    """``k_rows`` turns a K pool's contents, stored ``[dim, slot]`` per block ("dim-major", the
    CPU kernels) or ``[slot, dim]`` ("slot-major"), into ``[block, kv_head, slot, dim]`` rows:
    a view (writes go through), and an unknown layout is a ConfigError naming the known ones."""
    blocks, heads, bs, dim = 3, 2, 4, 5
    rows = np.arange(blocks * heads * bs * dim, dtype=np.float32).reshape(blocks, heads, bs, dim)
    stored = np.ascontiguousarray(rows.swapaxes(2, 3)).reshape(rows.shape)  # as the CPU writes
    np.testing.assert_array_equal(k_rows(stored, "dim-major"), rows)
    assert k_rows(rows, "slot-major") is rows
    k_rows(stored, "dim-major")[2, 1, 3] = -1  # block 2, head 1, slot 3
    assert (stored.reshape(blocks, heads, dim, bs)[2, 1, :, 3] == -1).all()
    with pytest.raises(ConfigError, match="slot-major"):
        k_rows(stored, "dim-minor")
