"""The ragged batched decode kernels against numpy: every row its own table, context length and
write offset; padding rows (context_len 0) write nothing and give zeros."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.compile.kernels.cpu.batch import (SMALL_ROWS, gemv_rows, gemv_rows_swiglu,
                                                    paged_attention_batch, rope_kv_write_batch)
from paged_decode.compile.params import GATE_UP_ROWS, gate_up_row

from .conftest import TOL
from .test_kernels import (BS, CAP, D, HKV, HQ, NB, _compiled, _t, k_slots, ref_attention,
                           ref_rope, slots)

CTXS = [5, 0, 1, CAP * BS, 3 * BS + 2]  # ragged, one padding row


def _tables(rng, rows: int) -> np.ndarray:
    """Each row's own permutation of the pool's blocks (rows may share blocks: reads only)."""
    return np.stack([rng.permutation(NB)[:CAP] for _ in range(rows)]).astype(np.int32)


@pytest.mark.parametrize("cdt", ["float32", "float16"])
@pytest.mark.parametrize("hq,hkv", [(HQ, HKV), (HQ, HQ), (HQ, 1)])
def test_batched_attention_is_each_rows_own(cdt, hq, hkv):
    rng = np.random.default_rng(3)
    k = rng.standard_normal((NB, hkv, BS, D)).astype(cdt)
    v = rng.standard_normal((NB, hkv, BS, D)).astype(cdt)
    tables, ctx = _tables(rng, len(CTXS)), np.array(CTXS, np.int64)
    q = rng.standard_normal((len(CTXS), hq * D)).astype(np.float32)
    out = _t(np.full((len(CTXS), hq * D), 7.0, np.float32))
    _compiled(paged_attention_batch, hq, hkv, D, BS, CAP, cdt, len(CTXS))(
        _t(q), _t(k), _t(v), _t(tables), _t(ctx), out)
    for r, c in enumerate(CTXS):
        want = (ref_attention(q[r].reshape(hq, D), k, v, tables[r], c) if c
                else np.zeros(hq * D))
        np.testing.assert_allclose(out.numpy()[r], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"row {r}, context {c}")


@pytest.mark.parametrize("cdt", ["float32", "float16"])
def test_batched_kv_write_lands_at_each_rows_offset_and_nowhere_else(cdt):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((NB, HKV, BS, D)).astype(cdt)
    v = rng.standard_normal((NB, HKV, BS, D)).astype(cdt)
    rows = len(CTXS)
    perm = rng.permutation(NB)  # distinct written blocks: each row writes its own
    tables = _tables(rng, rows)
    offs = np.zeros(rows, np.int64)
    for r, c in enumerate(CTXS):
        if c:
            tables[r, (c - 1) // BS] = perm[r]
            offs[r] = perm[r] * BS + (c - 1) % BS
    qkv = rng.standard_normal((rows, (HQ + 2 * HKV) * D)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    kt, vt, q_rot = _t(k), _t(v), _t(np.full((rows, HQ * D), 7.0, np.float32))
    _compiled(rope_kv_write_batch, HQ, HKV, D, BS, CAP, cdt, rows)(
        _t(qkv), kt, vt, _t(inv_freq), _t(tables), _t(offs), _t(np.array(CTXS, np.int64)), q_rot)
    k2, v2 = k_slots(kt.numpy()), slots(vt.numpy())
    untouched = np.ones((NB, BS), bool)
    tol = TOL[cdt]
    for r, c in enumerate(CTXS):
        if not c:
            assert not q_rot.numpy()[r].any()
            continue
        blk, slot = divmod(int(offs[r]), BS)
        untouched[blk, slot] = False
        np.testing.assert_allclose(k2[blk, slot], ref_rope(qkv[r, HQ * D:(HQ + HKV) * D], c - 1,
                                                           inv_freq), atol=tol, rtol=tol)
        np.testing.assert_allclose(v2[blk, slot], qkv[r, (HQ + HKV) * D:].reshape(HKV, D),
                                   atol=tol, rtol=tol)
        np.testing.assert_allclose(q_rot.numpy()[r], ref_rope(qkv[r, :HQ * D], c - 1,
                                                              inv_freq).reshape(-1),
                                   atol=TOL["float32"], rtol=0)
    assert k2[untouched].tobytes() == k_slots(k)[untouched].tobytes()
    assert v2[untouched].tobytes() == slots(v)[untouched].tobytes()


@pytest.mark.parametrize("bad", ["offset_mismatch", "ctx_past_cap", "table_outside"])
def test_batched_kv_write_rejects_any_bad_row_without_writing(bad):
    rng = np.random.default_rng(9)
    k = rng.standard_normal((NB, HKV, BS, D)).astype("float32")
    v = rng.standard_normal((NB, HKV, BS, D)).astype("float32")
    tables = _tables(rng, 2)
    ctx = np.array([5, 6], np.int64)
    offs = np.array([tables[r, (c - 1) // BS] * BS + (c - 1) % BS for r, c in enumerate(ctx)],
                    np.int64)
    if bad == "offset_mismatch":
        offs[1] += 1
    elif bad == "ctx_past_cap":
        ctx[1] = CAP * BS + 1
    else:
        tables[1, 0] = NB
    kt, vt = _t(k), _t(v)
    with pytest.raises(Exception):
        _compiled(rope_kv_write_batch, HQ, HKV, D, BS, CAP, "float32", 2)(
            _t(np.ones((2, (HQ + 2 * HKV) * D), np.float32)), kt, vt,
            _t(np.ones(D // 2, np.float32)), _t(tables), _t(offs), _t(ctx),
            _t(np.zeros((2, HQ * D), np.float32)))
    assert kt.numpy().tobytes() == k.tobytes() and vt.numpy().tobytes() == v.tobytes()


# -- small-batch GEMVs (buckets of at most SMALL_ROWS rows, float weights) ------------------------
@pytest.mark.parametrize("B", [2, 3, 4, SMALL_ROWS])
@pytest.mark.parametrize("N,K,wdt,epilogue", [
    (40, 72, "float32", "bias"),  # fewer rows than a task; K not a multiple of the 8 * KU step
    (37, 90, "float16", "residual"),  # a task's rows cut short; a tail of 26 (B = 2) wraps
    (70, 768, "float16", "none")])
def test_small_batch_gemv_matches_numpy(B, N, K, wdt, epilogue):
    rng = np.random.default_rng(N + B)
    x = rng.standard_normal((B, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(wdt)
    extra = {"bias": [rng.standard_normal(N).astype(np.float32)],
             "residual": [rng.standard_normal((B, N)).astype(np.float32)], "none": []}[epilogue]
    y = _t(np.full((B, N), np.nan, np.float32))
    _compiled(gemv_rows, N, K, wdt, epilogue, B)(_t(x), _t(w), *map(_t, extra), y)
    want = x.astype(np.float64) @ w.astype(np.float64).T + (extra[0] if extra else 0)
    np.testing.assert_allclose(y.numpy(), want, atol=TOL["float32"] * np.sqrt(K), rtol=1e-5)


@pytest.mark.parametrize("B", [2, 5])
def test_small_batch_swiglu_gemv_matches_numpy(B):
    inter, K = 2 * GATE_UP_ROWS + 24, 72  # a partial run of gate / up rows at the end
    rng = np.random.default_rng(B)
    x = rng.standard_normal((B, K)).astype(np.float32)
    w = rng.standard_normal((2 * inter, K)).astype(np.float16)
    act = _t(np.full((B, inter), np.nan, np.float32))
    _compiled(gemv_rows_swiglu, inter, K, "float16", B)(_t(x), _t(w), act)
    gate, up = (w[[gate_up_row(i, inter, which) for i in range(inter)]].astype(np.float64)
                for which in (False, True))
    g, u = x.astype(np.float64) @ gate.T, x.astype(np.float64) @ up.T
    np.testing.assert_allclose(act.numpy(), g / (1 + np.exp(-g)) * u, atol=1e-3, rtol=1e-4)
