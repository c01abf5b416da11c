"""Bad-input corpus: every bad request is a typed error that leaves the pool and session usable.

Each case runs against a fresh pool holding a target sequence ``a`` (one full block) and a
bystander ``b`` (two blocks).  After the expected error:

- the error is exactly the case's type (from the project's error family) and its message names
  the offending value and says the fix (the case's regexes);
- every block owned by another sequence, and the target's written positions, are byte-identical;
  the target's length and blocks, the allocator's ref counts and the free count are unchanged;
- a follow-up decode step of ``a`` gives the same logits as an untouched control run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, NamedTuple

import numpy as np
import pytest

from paged_decode.runtime.artifact import WeightPack, load_weights
from paged_decode.runtime.errors import (
    BlockTableError, CapacityError, ExecutionError, HandleError, InputError, OffsetRebindError,
    OutOfBlocksError, OwnershipError, PagedDecodeError, SamplingError, TokenIdError,
    TopologyChanged, ValidityError, WeightsError, WriteOffsetError,
)
from paged_decode.runtime.generate import Generator
from paged_decode.runtime.kv_pool import PagedKVCache
from paged_decode.runtime.sampling import Sampler, SamplingParams
from paged_decode.runtime.session import PagedDecodeSession

from .conftest import make_pool

BS, MAX_CONTEXT = 4, 64  # max_blocks_cap 16
NUM_BLOCKS = 24
PROMPT_A, PROMPT_B = [1, 2, 3, 4], [6, 7, 8, 9, 10]  # a fills one block, b spills into a second
FOLLOW = 11  # the follow-up token of a


@pytest.fixture(scope="module")
def tiny(load):
    return load("tiny", block_size=BS, max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def control_logits(tiny):
    world = World.build(*tiny)
    return world.session.realize_token(world.a, FOLLOW)


@pytest.fixture(scope="module")
def other_weights_dir(llama_ckpt, artifact_root):
    """The weight pack of another model (the random HF Llama), converted but not compiled."""
    from paged_decode.compile.api import ensure_weights
    from paged_decode.compile.weights import resolve_model

    path, _ = ensure_weights(resolve_model(str(llama_ckpt.path)), "float32", artifact_root, "on")
    return path


@dataclasses.dataclass
class World:
    artifact: object
    weights: WeightPack
    pool: PagedKVCache
    session: PagedDecodeSession
    a: object  # the target sequence (a SessionHandle)
    b: object  # a bystander
    target: object = None  # the sequence the bad call is about (default: a)
    extra: list = dataclasses.field(default_factory=list)  # released before the follow-up
    stale: PagedDecodeSession | None = None
    request: object = None

    @classmethod
    def build(cls, artifact, weights, request=None) -> World:
        pool = make_pool(artifact, NUM_BLOCKS)
        session = PagedDecodeSession(artifact, weights, pool)
        a, b = pool.new_sequence(), pool.new_sequence()
        session.prefill(a, PROMPT_A)
        session.prefill(b, PROMPT_B)
        return cls(artifact, weights, pool, session, a, b, a, request=request)

    @property
    def vocab(self) -> int:
        return self.artifact.manifest.vocab_size

    def fill(self, leave_free: int = 0):
        """A filler sequence that holds every free block but ``leave_free``."""
        filler = self.pool.new_sequence()
        filler.reserve((self.pool.num_free - leave_free) * BS)
        self.extra.append(filler)
        return filler

    def raw_args(self):
        """Valid decode_raw arguments: rewrite a's last position (never reached: every raw case
        is rejected before the VM runs, and a changed byte would fail the comparison)."""
        table = np.zeros((1, 16), np.int32)
        table[0, 0] = self.a.blocks[0]
        return table, 4, self.a.blocks[0] * BS + 3

    def raw(self, token=3, table=None, context_len=None, write_off=None, session=None):
        t, c, o = self.raw_args()
        return (session or self.session).decode_raw(
            token, t if table is None else table, c if context_len is None else context_len,
            o if write_off is None else write_off)


class Case(NamedTuple):
    id: str
    action: Callable[[World], object]
    error: type
    match: tuple[str, ...]  # regexes: the offending value, then the fix
    setup: Callable[[World], None] | None = None


def _with_table(w: World, **change):
    table, _, _ = w.raw_args()
    for index, value in change.items():
        table[0, int(index[1:])] = value
    return table


def _free_block(w: World) -> int:
    return next(b for b in range(NUM_BLOCKS) if w.pool.allocator.refcount(b) == 0)


def _clear_and_rebuild(w: World) -> None:
    """Clear the pool under a live session; keep the old session and handle to misuse them."""
    w.stale, w.extra = w.session, []
    old_a = w.a
    w.pool.clear()
    w.session = PagedDecodeSession(w.artifact, w.weights, w.pool)
    w.a, w.b = w.pool.new_sequence(), w.pool.new_sequence()
    w.session.prefill(w.a, PROMPT_A)
    w.session.prefill(w.b, PROMPT_B)
    w.target = w.a
    w.old_a = old_a


def _swap_pool(w: World) -> None:
    w.stale = PagedDecodeSession(w.artifact, w.weights, w.pool)
    w.stale.pool = make_pool(w.artifact, 4)


def _released(w: World) -> None:
    c = w.pool.new_sequence()
    w.session.prefill(c, [1, 2])
    c.release()
    w.released = c


def _foreign(w: World) -> None:
    other = make_pool(w.artifact, 4)
    w.foreign = other.new_sequence()
    PagedDecodeSession(w.artifact, w.weights, other).prefill(w.foreign, [1, 2])


def _full_sequence(w: World) -> None:
    w.target = w.pool.new_sequence()
    w.session.prefill(w.target, list(range(MAX_CONTEXT)))


def _fork_b(w: World) -> None:
    w.target = w.b.fork()  # shares b's half-full second block: the next write copies it
    w.extra.append(w.target)


def _failing_session(w: World) -> None:
    def vm_failure(*args):
        raise RuntimeError("simulated TVM failure\n(with a second line)")

    w.stale = PagedDecodeSession(w.artifact, w.weights, w.pool)
    w.stale._decode = w.stale._prefill = vm_failure


def _unchecked_session(w: World) -> None:
    """A session whose Python checks of decode_raw are bypassed: the kernel asserts remain."""
    w.stale = PagedDecodeSession(w.artifact, w.weights, w.pool)
    w.stale._check_raw = lambda table, context_len, write_off: (context_len, write_off)


def _pool(w: World, **change) -> PagedKVCache:
    """A pool like the artifact's but for the fields in ``change`` (a topology it rejects)."""
    m = dataclasses.replace(w.artifact.manifest, **change)
    return PagedKVCache(m.n_layers, m.n_kv_heads, m.head_dim, m.block_size, m.cache_dtype,
                        num_blocks=4)


def _other_layout(weights: WeightPack) -> WeightPack:
    meta = {**weights.meta, "params": weights.meta["params"][:-1]}
    return dataclasses.replace(weights, meta=meta, params=weights.params[:-1])


def _gen(w: World, prompt=(1, 2, 3), **kwargs):
    return Generator(w.artifact, w.weights, w.pool).generate(list(prompt), **kwargs)


def _stream(w: World, *args, **kwargs):
    """Generator.stream must reject bad arguments when called, before the first next()."""
    return Generator(w.artifact, w.weights, w.pool).stream(*args, **kwargs)


NAN_LOGITS = np.array([0.0, 1.0, np.nan, 2.0], np.float32)
TOKEN_FIX = "check the tokenizer matches the model"
INT_FIX = r"pass an int in \[0, 256\)"
PROMPT_FIX = "pass a flat list of ints"
TABLE_FIX = r"pass np\.ascontiguousarray\(\.\.\., dtype=np\.int32\) of shape \(1, 16\)"
CLEARED = "drop this session and build a new one"

CASES = [
    # -- token ids (realize_token) --------------------------------------------------------------
    Case("token_eq_vocab", lambda w: w.session.realize_token(w.a, w.vocab), TokenIdError,
         (r"token id 256 outside the vocabulary \[0, 256\)", TOKEN_FIX)),
    Case("token_huge", lambda w: w.session.realize_token(w.a, 2**40), TokenIdError,
         (r"token id 1099511627776 outside", TOKEN_FIX)),
    Case("token_negative", lambda w: w.session.realize_token(w.a, -1), TokenIdError,
         (r"token id -1 outside", TOKEN_FIX)),
    Case("token_bool", lambda w: w.session.realize_token(w.a, True), TokenIdError,
         (r"token id True is a bool", INT_FIX)),
    Case("token_numpy_bool", lambda w: w.session.realize_token(w.a, np.bool_(True)),
         TokenIdError, (r"token id (np\.)?True_? is a bool", INT_FIX)),
    Case("token_float", lambda w: w.session.realize_token(w.a, 3.0), TokenIdError,
         (r"token id 3\.0 is a float", INT_FIX)),
    Case("token_numpy_float", lambda w: w.session.realize_token(w.a, np.float32(3)),
         TokenIdError, (r"token id .*3\.0.* is a float32", INT_FIX)),
    Case("token_str", lambda w: w.session.realize_token(w.a, "3"), TokenIdError,
         (r"token id '3' is a str", INT_FIX)),
    Case("token_none", lambda w: w.session.realize_token(w.a, None), TokenIdError,
         (r"token id None is a NoneType", INT_FIX)),
    # -- prompts (prefill) ----------------------------------------------------------------------
    Case("prompt_empty", lambda w: w.session.prefill(w.a, []), TokenIdError,
         (r"shape \(0,\)", PROMPT_FIX)),
    Case("prompt_2d", lambda w: w.session.prefill(w.a, [[1, 2], [3, 4]]), TokenIdError,
         (r"shape \(2, 2\)", PROMPT_FIX)),
    Case("prompt_ragged", lambda w: w.session.prefill(w.a, [[1, 2], [3]]), TokenIdError,
         (r"prompt \[\[1, 2\], \[3\]\] is not a 1-D sequence", PROMPT_FIX)),
    Case("prompt_scalar", lambda w: w.session.prefill(w.a, 5), TokenIdError,
         (r"shape \(\)", PROMPT_FIX)),
    Case("prompt_floats", lambda w: w.session.prefill(w.a, [1.0, 2.0]), TokenIdError,
         (r"dtype float64 \(first value .*1\.0", "pass ints, not floats")),
    Case("prompt_bools", lambda w: w.session.prefill(w.a, [True, False]), TokenIdError,
         (r"dtype bool", "pass ints, not floats or bools")),
    Case("prompt_id_outside_vocab", lambda w: w.session.prefill(w.a, [1, 999]), TokenIdError,
         (r"prompt token id 999 outside the vocabulary", TOKEN_FIX)),
    Case("prompt_negative_id", lambda w: w.session.prefill(w.a, [1, -5]), TokenIdError,
         (r"prompt token id -5 outside", TOKEN_FIX)),
    Case("prompt_text", lambda w: w.session.prefill(w.a, "hello"), TokenIdError,
         (r"prompt 'hello' is text", "encode it with the model's tokenizer")),
    # -- capacity: max_blocks_cap * block_size = 64 tokens --------------------------------------
    Case("prompt_past_cap", lambda w: w.session.prefill(w.a, [1] * 61), CapacityError,
         (r"4 \+ 61 = 65 tokens exceed max_tokens=64", "compile with a larger max_blocks_cap")),
    Case("decode_past_cap", lambda w: w.session.realize_token(w.target, 1), CapacityError,
         (r"64 \+ 1 = 65 tokens exceed max_tokens=64", "truncate the sequence"), _full_sequence),
    Case("generate_past_cap", lambda w: _gen(w, [1] * 60, max_new_tokens=10), CapacityError,
         (r"64 \+ 1 = 65 tokens exceed max_tokens=64", "larger max_blocks_cap")),
    # -- pool exhausted -------------------------------------------------------------------------
    Case("pool_exhausted_mid_prefill", lambda w: w.session.prefill(w.a, [1] * 9),
         OutOfBlocksError, (r"requested 3, free 2 of 24", "release finished sequences"),
         lambda w: w.fill(leave_free=2)),
    Case("pool_exhausted_mid_decode", lambda w: w.session.realize_token(w.a, 3),
         OutOfBlocksError, (r"requested 1, free 0 of 24", "allocate a larger pool"),
         lambda w: w.fill()),
    Case("pool_exhausted_copy_on_write", lambda w: w.session.realize_token(w.target, 3),
         OutOfBlocksError, (r"requested 1, free 0 of 24", "release finished sequences"),
         lambda w: (_fork_b(w), w.fill())),
    Case("pool_exhausted_in_generator", lambda w: _gen(w, [1] * 9, max_new_tokens=2),
         OutOfBlocksError, (r"requested 3, free 2", "release finished sequences"),
         lambda w: w.fill(leave_free=2)),
    # -- caller-managed block tables (decode_raw) -----------------------------------------------
    Case("table_int64", lambda w: w.raw(table=w.raw_args()[0].astype(np.int64)), BlockTableError,
         (r"has dtype int64, expected int32", TABLE_FIX)),
    Case("table_float32", lambda w: w.raw(table=w.raw_args()[0].astype(np.float32)),
         BlockTableError, (r"has dtype float32, expected int32", TABLE_FIX)),
    Case("table_list", lambda w: w.raw(table=w.raw_args()[0].tolist()), BlockTableError,
         (r"got list", TABLE_FIX)),
    Case("table_1d", lambda w: w.raw(table=w.raw_args()[0][0]), BlockTableError,
         (r"shape \(16,\), expected \(1, 16\)", TABLE_FIX)),
    Case("table_short", lambda w: w.raw(table=w.raw_args()[0][:, :15]), BlockTableError,
         (r"shape \(1, 15\), expected \(1, 16\)", TABLE_FIX)),
    Case("table_batch_of_two", lambda w: w.raw(table=np.zeros((2, 16), np.int32)),
         BlockTableError, (r"shape \(2, 16\)", TABLE_FIX)),
    # an ndarray subclass: np.matrix indexes as 2-D, a masked array hides entries
    Case("table_matrix", lambda w: w.raw(table=np.matrix(w.raw_args()[0])), BlockTableError,
         (r"block_table must be a numpy\.ndarray, got matrix", TABLE_FIX)),
    Case("table_masked", lambda w: w.raw(table=np.ma.masked_array(w.raw_args()[0])),
         BlockTableError, (r"got MaskedArray", TABLE_FIX)),
    Case("handle_block_table_negative_cap", lambda w: w.a.block_table(-3), InputError,
         (r"cap=-3: must be an integer >= 0",)),
    Case("handle_block_table_float_cap", lambda w: w.a.block_table(16.0), InputError,
         (r"cap=16\.0: must be an integer >= 0",)),
    Case("handle_fill_block_table_matrix",
         lambda w: w.a.fill_block_table(np.matrix(np.zeros((1, 16), np.int32))), InputError,
         (r"block table must be a numpy\.ndarray, got matrix", r"of shape \(1, n\)")),
    Case("block_id_outside_pool", lambda w: w.raw(table=_with_table(w, i0=NUM_BLOCKS)),
         BlockTableError, (r"block_table\[0, 0\] = 24 is outside the pool \[0, 24\)",
                           "use block ids this pool allocated")),
    Case("block_id_outside_pool_below_the_write",  # the kernels would write layer 0 first
         lambda w: w.raw(table=_with_table(w, i0=99, i1=w.b.blocks[1]), context_len=5,
                         write_off=w.b.blocks[1] * BS),
         BlockTableError, (r"block_table\[0, 0\] = 99 is outside the pool",
                           "use block ids this pool allocated")),
    Case("block_id_negative", lambda w: w.raw(table=_with_table(w, i0=-1)), BlockTableError,
         (r"block_table\[0, 0\] = -1 is outside", "use block ids this pool allocated")),
    # ownership: a raw write may only touch the writing sequence's unshared block
    Case("raw_write_into_another_sequence",
         lambda w: w.raw(table=_with_table(w, i0=w.a.blocks[0], i1=w.b.blocks[1]), context_len=5,
                         write_off=w.b.blocks[1] * BS),
         OwnershipError, (r"block_table\[0, 1\] = \d+ \(the block written\) belongs to "
                          r"sequence \d+, whose blocks are", "pass the writing sequence's own")),
    Case("raw_write_into_a_forked_block",
         lambda w: w.raw(table=_with_table(w, i0=w.b.blocks[0], i1=w.b.blocks[1]), context_len=6,
                         write_off=w.b.blocks[1] * BS + 1),
         OwnershipError, (r"is shared by 2 sequences after fork\(\)", "copy on write"),
         _fork_b),
    Case("raw_table_mixes_a_live_sequence_with_a_free_block",
         lambda w: w.raw(table=_with_table(w, i0=w.a.blocks[0], i1=_free_block(w)),
                         context_len=5, write_off=_free_block(w) * BS),
         OwnershipError, (r"is held by no sequence, but the table also lists block \d+ of a "
                          r"live sequence",)),
    Case("context_len_zero", lambda w: w.raw(context_len=0), BlockTableError,
         (r"context_len=0 outside \[1, 64\]", "pass the sequence length")),
    Case("context_len_past_cap", lambda w: w.raw(context_len=65), BlockTableError,
         (r"context_len=65 outside \[1, 64\]", "pass the sequence length")),
    Case("context_len_float", lambda w: w.raw(context_len=4.0), BlockTableError,
         (r"context_len=4\.0 outside", "pass the sequence length")),
    Case("write_off_inconsistent", lambda w: w.raw(write_off=w.raw_args()[2] + 1),
         WriteOffsetError, (r"write_off=\d+ does not match the block table at context_len - 1 "
                            r"= 3 \(block \d+, slot 3\)", r"pass \d+")),
    Case("write_off_negative", lambda w: w.raw(write_off=-1), WriteOffsetError,
         (r"write_off=-1 does not match", r"pass \d+")),
    Case("write_off_float", lambda w: w.raw(write_off=float(w.raw_args()[2])), WriteOffsetError,
         (r"write_off=\d+\.0 does not match", r"pass \d+")),
    Case("raw_token_outside_vocab", lambda w: w.raw(token=-3), TokenIdError,
         (r"token id -3 outside", TOKEN_FIX)),
    Case("raw_offset_rebind", lambda w: (w.session.bind_offset(5), w.raw()), OffsetRebindError,
         (r"already bound to 5 for this step, got \d+", "unbind_offset")),
    Case("raw_after_pool_cleared", lambda w: w.raw(session=w.stale), TopologyChanged,
         (r"allocation changed from \d+ to \d+", CLEARED), _clear_and_rebuild),
    # -- handles, pool topology and the write offset --------------------------------------------
    Case("released_handle", lambda w: w.session.realize_token(w.released, 3), HandleError,
         (r"sequence \d+: check_handle\(\) on a released handle", "pool.new_sequence()"),
         _released),
    Case("released_handle_prefill", lambda w: w.session.prefill(w.released, [1]), HandleError,
         (r"on a released handle", "pool.new_sequence()"), _released),
    Case("double_release", lambda w: w.released.release(), HandleError,
         (r"release\(\) on a released handle", "pool.new_sequence()"), _released),
    Case("handle_of_another_pool", lambda w: w.session.realize_token(w.foreign, 3), HandleError,
         (r"belongs to another KV pool \(allocation \d+\)", "this pool's new_sequence()"),
         _foreign),
    Case("not_a_handle", lambda w: w.session.realize_token(7, 3), HandleError,
         (r"expected a SessionHandle, got int", r"pool\.new_sequence\(\)")),
    Case("session_after_pool_cleared", lambda w: w.stale.realize_token(w.a, 3), TopologyChanged,
         (r"allocation changed from \d+ to \d+ \(pool cleared\)", CLEARED), _clear_and_rebuild),
    Case("handle_from_before_clear", lambda w: w.session.realize_token(w.old_a, 3), HandleError,
         (r"handle of pool allocation \d+, but the pool was cleared", "pool.new_sequence()"),
         _clear_and_rebuild),
    Case("session_after_pool_swapped", lambda w: w.stale.realize_token(w.a, 3), TopologyChanged,
         (r"swapped for another \(allocation \d+\)", "build a new session for the new pool"),
         _swap_pool),
    Case("offset_rebind", lambda w: (w.session.bind_offset(999), w.session.realize_token(w.a, 3)),
         OffsetRebindError, (r"already bound to 999 for this step, got \d+", "unbind_offset")),
    Case("offset_rebind_after_copy_on_write",
         lambda w: (w.session.bind_offset(999), w.session.realize_token(w.target, 3)),
         OffsetRebindError, (r"already bound to 999", "unbind_offset"), _fork_b),
    Case("reserve_negative", lambda w: w.a.reserve(-1), InputError,
         (r"n_tokens=-1: must be a non-negative integer", "pass the number of positions")),
    Case("truncate_past_length", lambda w: w.a.truncate_to(10), InputError,
         (r"truncate_to\(10\) needs 0 <= n <= length 4", "pass a length the sequence has")),
    Case("write_offset_unreserved", lambda w: w.a.write_offset(100), InputError,
         (r"position 100 is outside the reserved capacity \[0, 4\)", r"call reserve\(\) first")),
    # -- failures inside the VM become ExecutionError, and the step is undone -------------------
    Case("kernel_assert_behind_bypassed_check",
         lambda w: w.raw(table=_with_table(w, i0=NUM_BLOCKS), write_off=NUM_BLOCKS * BS + 3,
                         session=w.stale),
         ExecutionError, (r"write_off outside the pool", "check the step's inputs"),
         _unchecked_session),
    Case("vm_failure_in_decode", lambda w: w.stale.realize_token(w.a, 3), ExecutionError,
         (r"compiled decode .* failed: simulated TVM failure;", "the sequence was not advanced"),
         _failing_session),
    Case("vm_failure_after_copy_on_write", lambda w: w.stale.realize_token(w.target, 3),
         ExecutionError, (r"failed: simulated TVM failure", "check the step's inputs"),
         lambda w: (_fork_b(w), _failing_session(w))),
    Case("vm_failure_in_prefill", lambda w: w.stale.prefill(w.a, [1] * 6), ExecutionError,
         (r"compiled prefill .* failed: simulated", "the sequence was not advanced"),
         _failing_session),
    # -- sampling -------------------------------------------------------------------------------
    Case("temperature_nan", lambda w: SamplingParams(temperature=float("nan")), SamplingError,
         (r"temperature=nan", r"finite number >= 0")),
    Case("temperature_inf", lambda w: SamplingParams(temperature=float("inf")), SamplingError,
         (r"temperature=inf", r"finite number >= 0")),
    Case("temperature_negative", lambda w: SamplingParams(temperature=-0.5), SamplingError,
         (r"temperature=-0\.5", r"finite number >= 0 \(0 means greedy\)")),
    Case("temperature_str", lambda w: SamplingParams(temperature="0.7"), SamplingError,
         (r"temperature='0\.7'", r"finite number >= 0")),
    Case("top_p_zero", lambda w: SamplingParams(temperature=1.0, top_p=0.0), SamplingError,
         (r"top_p=0\.0", r"in \(0, 1\] \(1 disables top-p\)")),
    Case("top_p_above_one", lambda w: SamplingParams(top_p=1.5), SamplingError,
         (r"top_p=1\.5", r"in \(0, 1\]")),
    Case("top_p_nan", lambda w: SamplingParams(top_p=float("nan")), SamplingError,
         (r"top_p=nan", r"in \(0, 1\]")),
    Case("top_k_negative", lambda w: SamplingParams(top_k=-1), SamplingError,
         (r"top_k=-1", r"integer >= 0 \(0 disables top-k\)")),
    Case("top_k_float", lambda w: SamplingParams(top_k=2.5), SamplingError,
         (r"top_k=2\.5", r"integer >= 0")),
    Case("seed_negative", lambda w: SamplingParams(seed=-1), SamplingError,
         (r"seed=-1", r"None or an integer >= 0")),
    Case("nan_logits", lambda w: Sampler().sample(NAN_LOGITS), SamplingError,
         (r"NaN \(first at token 2\)", "check the weights and cache_dtype")),
    Case("nan_logits_sampled", lambda w: Sampler(SamplingParams(1.0, seed=0)).sample(NAN_LOGITS),
         SamplingError, (r"NaN \(first at token 2\)", "check the weights")),
    Case("inf_logits", lambda w: Sampler().sample(np.array([0, np.inf], np.float32)),
         SamplingError, (r"\+inf", "pass finite logits")),
    Case("logits_2d", lambda w: Sampler().sample(np.zeros((2, 4), np.float32)), SamplingError,
         (r"float32 of shape \(2, 4\)", "pass one row")),
    Case("logits_int", lambda w: Sampler().sample(np.arange(4)), SamplingError,
         (r"int64 of shape \(4,\)", "pass one row")),
    Case("sampler_params_dict", lambda w: Sampler({"temperature": 1.0}), SamplingError,
         (r"params must be SamplingParams, got dict", r"pass SamplingParams\(")),
    # -- Generator.stream arguments (checked before the first next()) ---------------------------
    Case("max_new_tokens_negative", lambda w: _stream(w, [1, 2], max_new_tokens=-1), InputError,
         (r"max_new_tokens=-1", "must be an int >= 0")),
    Case("max_new_tokens_float", lambda w: _stream(w, [1, 2], max_new_tokens=2.5), InputError,
         (r"max_new_tokens=2\.5", "must be an int >= 0")),
    Case("max_new_tokens_bool", lambda w: _stream(w, [1, 2], max_new_tokens=True), InputError,
         (r"max_new_tokens=True", "must be an int >= 0")),
    Case("max_new_tokens_str", lambda w: _stream(w, [1, 2], max_new_tokens="8"), InputError,
         (r"max_new_tokens='8'", "must be an int >= 0")),
    Case("stop_ids_none", lambda w: _stream(w, [1, 2], stop_ids=None), InputError,
         (r"stop_ids=None", r"pass \(\) for none")),
    Case("stop_id_float", lambda w: _stream(w, [1, 2], stop_ids=[1.5]), InputError,
         (r"stop_ids: 1\.5 is a float", "pass int token ids")),
    Case("generator_empty_prompt", lambda w: _stream(w, []), TokenIdError,
         (r"shape \(0,\)", PROMPT_FIX)),
    Case("generator_prompt_outside_vocab", lambda w: _stream(w, [300]), TokenIdError,
         (r"prompt token id 300 outside", TOKEN_FIX)),
    Case("generator_sampling_not_params", lambda w: _stream(w, [1], sampling={"top_p": 0.5}),
         SamplingError, (r"got dict", r"pass SamplingParams\(")),
    # -- artifact / weights / pool mismatches ---------------------------------------------------
    Case("weights_of_another_model",
         lambda w: load_weights(w.request.getfixturevalue("other_weights_dir"), w.artifact),
         WeightsError, (r"weights of model '.*' have another parameter layout than artifact "
                        r"tiny-.* of 'tiny' \(pack has \[", "use the weight pack prepare")),
    Case("weights_of_another_layout_in_session",
         lambda w: PagedDecodeSession(w.artifact, _other_layout(w.weights), w.pool),
         ValidityError, (r"another parameter layout", r"load_weights\(path, artifact\)")),
    Case("pool_block_size_differs", lambda w: PagedDecodeSession(w.artifact, w.weights,
                                                                 _pool(w, block_size=8)),
         ValidityError, (r"\(2, 8, 'float32', 2, 16\) does not fit artifact tiny-.* "
                         r"\(2, 4, 'float32', 2, 16\)", "allocate the pool with the artifact's")),
    Case("pool_cache_dtype_differs", lambda w: PagedDecodeSession(w.artifact, w.weights,
                                                                  _pool(w, cache_dtype="float16")),
         ValidityError, (r"'float16'", "allocate the pool with the artifact's values")),
    Case("pool_n_layers_differs", lambda w: PagedDecodeSession(w.artifact, w.weights,
                                                               _pool(w, n_layers=3)),
         ValidityError, (r"\(3, 4, 'float32', 2, 16\)", "allocate the pool with the artifact's")),
    Case("pool_head_dim_differs", lambda w: PagedDecodeSession(w.artifact, w.weights,
                                                               _pool(w, head_dim=8)),
         ValidityError, (r"\(2, 4, 'float32', 2, 8\)", "allocate the pool with the artifact's")),
]


def _rows(pool: PagedKVCache, blocks, n_positions=None) -> list[bytes]:
    """The pool bytes of ``blocks`` (or only of their first ``n_positions`` positions)."""
    if n_positions is None:
        pos = [(b, s) for b in blocks for s in range(BS)]
    else:
        pos = [(blocks[p // BS], p % BS) for p in range(n_positions)]
    blk = np.array([b for b, _ in pos], np.int64)
    slot = np.array([s for _, s in pos], np.int64)
    return [t.numpy()[blk, :, slot].tobytes() for t in pool.pools]  # (blocks, Hkv, bs, D)


def _state(w: World):
    """Everything a rejected call must leave as it was."""
    target = w.target
    others = {sid: _rows(w.pool, blocks) for sid, blocks in w.pool.owned_blocks().items()
              if sid != target.seq_id}
    _, refcounts = w.pool.allocator.state()
    return (w.pool.alloc_id, w.pool.num_free, refcounts, target.length, target.blocks,
            _rows(w.pool, target.blocks, target.length), others)


def test_corpus_is_large_and_typed():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    assert all(issubclass(c.error, PagedDecodeError) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tiny, control_logits, request):
    w = World.build(*tiny, request=request)
    if case.setup is not None:
        case.setup(w)
    before = _state(w)
    with pytest.raises(PagedDecodeError) as info:
        result = case.action(w)
        if hasattr(result, "__next__"):  # a stream that did not check its arguments up front
            next(result)
    error = info.value
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    for pattern in case.match:
        assert re.search(pattern, str(error)), f"{pattern!r} not in: {error}"
    assert _state(w) == before
    w.pool.allocator.check_invariants()
    w.session.unbind_offset()
    for handle in w.extra:
        if handle.is_live:
            handle.release()
    np.testing.assert_array_equal(w.session.realize_token(w.a, FOLLOW), control_logits)


def test_vm_errors_chain_the_tvm_error(tiny):
    w = World.build(*tiny)
    _unchecked_session(w)
    table = _with_table(w, i0=NUM_BLOCKS)
    with pytest.raises(ExecutionError) as info:
        w.raw(table=table, write_off=NUM_BLOCKS * BS + 3, session=w.stale)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "write_off outside the pool" in str(info.value.__cause__)


def test_decode_raw_matches_realize_token(tiny, control_logits):
    """A caller-managed table (padding past the context is ignored, any value) decodes like the
    handle's own step."""
    w = World.build(*tiny)
    w.a.reserve(1)
    table = np.full((1, 16), -7, np.int32)  # padding: never read
    table[0, :2] = w.a.blocks
    logits = w.session.decode_raw(FOLLOW, table, 5, w.a.write_offset(4))
    np.testing.assert_array_equal(logits, control_logits)
    assert w.session.realize_count == 1


def test_rejected_step_on_a_fork_keeps_sharing(tiny):
    """A failed step after copy-on-write gives the private copy back and re-shares the block."""
    w = World.build(*tiny)
    fork = w.b.fork()
    shared = w.b.blocks
    free = w.pool.num_free
    w.session.bind_offset(999)
    with pytest.raises(OffsetRebindError):
        w.session.realize_token(fork, 3)
    assert fork.blocks == shared and w.pool.num_free == free
    assert [w.pool.allocator.refcount(b) for b in shared] == [2, 2]


def test_generator_with_a_swapped_pool_frees_the_old_sequence(tiny):
    """Swapping a Generator's pool mid-stream re-prefills into the new pool and gives the old
    sequence's blocks back to the old pool."""
    artifact, weights = tiny
    old, new = make_pool(artifact, 8), make_pool(artifact, 8)
    reference = Generator(artifact, weights, make_pool(artifact, 8)).generate([3, 4, 5], 8)
    gen = Generator(artifact, weights, old)
    stream = gen.stream([3, 4, 5], max_new_tokens=8)
    got = [next(stream) for _ in range(3)]
    gen.pool = new
    got += list(stream)
    assert got == reference and gen.stats.reprefills == 1
    assert old.num_free == old.num_blocks and new.num_free == new.num_blocks


# -- undoing a failed step (SessionHandle.snapshot / restore) ------------------------------------

def _small_pool(num_blocks=6):
    return PagedKVCache(1, 1, 2, BS, "float32", num_blocks=num_blocks)


def test_restore_frees_blocks_reserved_since_the_snapshot():
    pool = _small_pool()
    h = pool.new_sequence()
    h.reserve(3)
    h.advance(3)
    snap, free = h.snapshot(), pool.num_free
    h.reserve(6)  # two more blocks
    h.restore(snap)
    assert (h.blocks, h.length, pool.num_free) == ((0,), 3, free)
    pool.allocator.check_invariants()


def test_restore_does_not_take_back_a_block_allocated_again():
    """The fork's old block was released by its other owner and handed to a new sequence: the
    fork keeps its private copy instead of sharing the newcomer's block."""
    pool = _small_pool()
    a = pool.new_sequence()
    a.reserve(2)
    a.advance(2)
    fork = a.fork()
    snap = fork.snapshot()
    fork.reserve(1)  # copy-on-write: the fork now owns a private copy
    copy = fork.blocks[0]
    a.release()  # the shared block is free now...
    newcomer = pool.new_sequence()
    newcomer.reserve(1)  # ...and allocated again (LIFO free list)
    assert newcomer.blocks == snap[0][0][:1]
    fork.restore(snap)
    assert fork.blocks == (copy,) and newcomer.blocks == snap[0][0][:1]
    assert pool.allocator.refcount(copy) == pool.allocator.refcount(newcomer.blocks[0]) == 1
    pool.allocator.check_invariants()
