"""Kernels against independent numpy references (paged attention, KV write, linear, norms)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm

from paged_decode.compile.kernels.cpu.attention import (MAX_PARTS, PARALLEL_MIN_WORK, PART_ROWS,
                                                    paged_attention_decode,
                                                    paged_attention_prefill, split_parts)
from paged_decode.compile.kernels.cpu.simd import K_BLOCK_LAYOUT
from paged_decode.compile.kernels.cpu.gemv import gemv, gemv_swiglu, row_pairs, x_dtype
from paged_decode.compile.kernels.cpu.linear import TILES, linear, linear_swiglu
from paged_decode.compile.kernels.registry import kernels_for
from paged_decode.compile.kernels.cpu.norm import embedding, rmsnorm
from paged_decode.compile.kernels.cpu.rope_kv import rope_kv_write_decode, rope_kv_write_prefill
from paged_decode.compile.targets import resolve_target
from paged_decode.runtime.kv_pool import k_rows

from .conftest import TOL

HQ, HKV, D, BS, CAP, NB = 4, 2, 16, 4, 6, 11


@functools.lru_cache(maxsize=None)
def _compiled(factory, *args):
    func = factory(*args)
    lib = tvm.compile(func, target=resolve_target(None).target)
    return lib[func.attrs["global_symbol"]]


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def slots(pool):
    """A V pool ``(blocks, Hkv, block_size, D)`` viewed as ``(blocks, block_size, Hkv, D)``:
    index ``[block, slot]`` for one position's heads."""
    return pool.transpose(0, 2, 1, 3)


def k_slots(pool):
    """``slots`` of a K pool as the CPU kernels store it (``K_BLOCK_LAYOUT``, read through the
    runtime's ``k_rows``): a writable view."""
    return slots(k_rows(pool, K_BLOCK_LAYOUT))


def ref_attention(q, k_pool, v_pool, table, ctx):
    """q (Hq, D) against positions [0, ctx) gathered through the block table (shapes from the
    arguments: pools ``(blocks, Hkv, block_size, D)``)."""
    hq, (_, hkv, bs, d) = q.shape[0], k_pool.shape
    pos = np.arange(ctx)
    k = k_slots(k_pool)[table[pos // bs], pos % bs].astype(np.float64)  # (ctx, Hkv, D)
    v = slots(v_pool)[table[pos // bs], pos % bs].astype(np.float64)
    out = np.empty((hq, d))
    for h in range(hq):
        s = k[:, h // (hq // hkv)] @ q[h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // (hq // hkv)]
    return out.reshape(-1)


def ref_rope(x, pos, inv_freq):
    x = x.reshape(-1, D).astype(np.float64)
    ang = pos * inv_freq.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[:, : D // 2], x[:, D // 2:]
    return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], -1)


@pytest.fixture
def pools(request):
    cdt = request.param
    rng = np.random.default_rng(7)
    k = rng.standard_normal((NB, HKV, BS, D)).astype(cdt)
    v = rng.standard_normal((NB, HKV, BS, D)).astype(cdt)
    table = np.zeros((1, CAP), np.int32)
    table[0] = rng.permutation(NB)[:CAP]  # non-contiguous, permuted physical blocks
    return cdt, k, v, table


@pytest.mark.parametrize("pools", ["float32", "float16"], indirect=True)
@pytest.mark.parametrize("ctx", [1, BS - 1, BS, BS + 1, 3 * BS + 2, CAP * BS])
def test_paged_attention_decode(pools, ctx):
    cdt, k, v, table = pools
    q = np.random.default_rng(ctx).standard_normal((1, HQ * D)).astype(np.float32)
    out = _t(np.zeros((1, HQ * D), np.float32))
    _compiled(paged_attention_decode, HQ, HKV, D, BS, CAP, cdt)(
        _t(q), _t(k), _t(v), _t(table), ctx, out)
    ref = ref_attention(q[0].reshape(HQ, D), k, v, table[0], ctx)
    np.testing.assert_allclose(out.numpy()[0], ref, atol=TOL["float32"], rtol=0)


@pytest.mark.parametrize("cdt", ["float32", "float16"])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 64), (9, 3, 64), (32, 4, 64),
                                      (24, 2, 64), (16, 1, 64), (8, 2, 128), (4, 2, 256)])
def test_paged_attention_sixteen_row_blocks(cdt, hq, hkv, d):
    """The shapes the models use (16-token blocks; 1, 3, 4, 8, 12 and 16 query heads per kv head,
    so the kernel's head grouping meets remainders and several groups; head_dim 64, 128 and 256),
    decode and prefill.  Rows past the context hold inf / nan (a block's unused slots keep
    whatever a freed sequence left there): they must not reach the output."""
    bs, cap = 16, 6
    rng = np.random.default_rng(hq)
    k = rng.standard_normal((cap + 2, hkv, bs, d)).astype(cdt)
    v = rng.standard_normal((cap + 2, hkv, bs, d)).astype(cdt)
    table = rng.permutation(cap + 2)[:cap].astype(np.int32)[None]
    for ctx in (1, bs - 1, bs, bs + 1, 3 * bs + 5, cap * bs):
        kc, vc = k.copy(), v.copy()
        pos = np.arange(ctx, cap * bs)
        k_slots(kc)[table[0, pos // bs], pos % bs] = np.inf
        slots(vc)[table[0, pos // bs], pos % bs] = np.nan
        q = rng.standard_normal((2, hq * d)).astype(np.float32)
        out = _t(np.zeros((1, hq * d), np.float32))
        _compiled(paged_attention_decode, hq, hkv, d, bs, cap, cdt)(
            _t(q[:1]), _t(kc), _t(vc), _t(table), ctx, out)
        ref = ref_attention(q[0].reshape(hq, d), k, v, table[0], ctx)
        np.testing.assert_allclose(out.numpy()[0], ref, atol=TOL["float32"], rtol=0)
        if ctx >= 2:  # prefill of the last two positions through the same blocks
            pre = _t(np.zeros((2, hq * d), np.float32))
            _compiled(paged_attention_prefill, hq, hkv, d, bs, cap, cdt)(
                _t(q), _t(kc), _t(vc), _t(table), ctx - 2, pre)
            for i in range(2):
                ref = ref_attention(q[i].reshape(hq, d), k, v, table[0], ctx - 1 + i)
                np.testing.assert_allclose(pre.numpy()[i], ref, atol=TOL["float32"], rtol=0)


@pytest.mark.parametrize("cdt", ["float32", "float16"])
@pytest.mark.parametrize("hq,hkv,d,bs", [(12, 12, 64, 16), (32, 4, 64, 16), (4, 2, 128, 16),
                                         (12, 12, 64, 64), (32, 4, 64, 32), (32, 4, 64, 64),
                                         (9, 3, 64, 64)])
def test_paged_attention_decode_split_over_blocks(cdt, hq, hkv, d, bs):
    """Long contexts, where decode splits the blocks among parallel parts and merges their
    softmax states: one block (one part) where that is long enough for the parallel path, two
    parts, uneven parts, and more blocks than MAX_PARTS full parts hold; with 64-token blocks a
    part is PART_ROWS // 64 = 2 blocks.  Rows past the context hold inf / nan."""
    part_rows = PART_ROWS
    ctxs = [part_rows, part_rows + 1, 3 * part_rows + 5, MAX_PARTS * part_rows + 3 * bs + 7]
    if bs * hq * d >= PARALLEL_MIN_WORK:
        ctxs.append(bs)
    assert min(ctxs) * hq * d >= PARALLEL_MIN_WORK  # all of them take the parallel path
    cap = -(-max(ctxs) // bs)
    rng = np.random.default_rng(hq + d)
    k = rng.standard_normal((cap + 3, hkv, bs, d)).astype(cdt)
    v = rng.standard_normal((cap + 3, hkv, bs, d)).astype(cdt)
    table = rng.permutation(cap + 3)[:cap].astype(np.int32)[None]
    fn = _compiled(paged_attention_decode, hq, hkv, d, bs, cap, cdt)
    for ctx in ctxs:
        kc, vc = k.copy(), v.copy()
        pos = np.arange(ctx, cap * bs)
        k_slots(kc)[table[0, pos // bs], pos % bs] = np.inf
        slots(vc)[table[0, pos // bs], pos % bs] = np.nan
        q = 2 * rng.standard_normal((1, hq * d)).astype(np.float32)  # peaked softmax too
        out = _t(np.zeros((1, hq * d), np.float32))
        fn(_t(q), _t(kc), _t(vc), _t(table), ctx, out)
        ref = ref_attention(q[0].reshape(hq, d), k, v, table[0], ctx)
        np.testing.assert_allclose(out.numpy()[0], ref, atol=TOL["float32"], rtol=0)


@pytest.mark.parametrize("bs", [4, 16, 32, 48, 64, 128, 256])
def test_split_parts_bounds_each_part_in_rows(bs):
    """Decode attention's parts: at most PART_ROWS // bs blocks each (one for bs > PART_ROWS)
    unless MAX_PARTS parts are reached, at least two where there are two blocks, never more than
    the blocks; so 128-token blocks at context 1024 (8 blocks) use 8 parts, not one."""
    part_blocks = max(1, PART_ROWS // bs)
    for n in range(1, 300):
        parts = split_parts(n, bs)
        assert 1 <= parts <= min(MAX_PARTS, n) and parts >= min(2, n), (n, parts)
        if parts < MAX_PARTS:
            assert -(-n // parts) <= part_blocks, (n, parts)
    assert split_parts(1024 // 128, 128) == 8 and split_parts(512 // 64, 64) == 4


@pytest.mark.parametrize("pools", ["float32"], indirect=True)
def test_padded_table_equals_exact_width_table(pools):
    """Entries past the context are never read: garbage padding gives identical output."""
    cdt, k, v, table = pools
    ctx = BS + 2
    q = _t(np.random.default_rng(1).standard_normal((1, HQ * D)).astype(np.float32))
    exact, garbage = table.copy(), table.copy()
    exact[0, 2:] = 0
    garbage[0, 2:] = NB - 1
    outs = []
    for tab in (exact, garbage):
        out = _t(np.zeros((1, HQ * D), np.float32))
        _compiled(paged_attention_decode, HQ, HKV, D, BS, CAP, cdt)(
            q, _t(k), _t(v), _t(tab), ctx, out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("pools", ["float32", "float16"], indirect=True)
def test_paged_attention_prefill_causal(pools):
    cdt, k, v, table = pools
    n, start = 9, 3
    q = np.random.default_rng(3).standard_normal((n, HQ * D)).astype(np.float32)
    out = _t(np.zeros((n, HQ * D), np.float32))
    _compiled(paged_attention_prefill, HQ, HKV, D, BS, CAP, cdt)(
        _t(q), _t(k), _t(v), _t(table), start, out)
    for i in range(n):
        ref = ref_attention(q[i].reshape(HQ, D), k, v, table[0], start + i + 1)
        np.testing.assert_allclose(out.numpy()[i], ref, atol=TOL["float32"], rtol=0)


@pytest.mark.parametrize("pools", ["float32", "float16"], indirect=True)
@pytest.mark.parametrize("ctx", [1, BS, BS + 1, 3 * BS + 2])
def test_kv_write_lands_exactly_at_offset(pools, ctx):
    cdt, k, v, table = pools
    rng = np.random.default_rng(ctx)
    qkv = rng.standard_normal((1, (HQ + 2 * HKV) * D)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    pos = ctx - 1
    off = int(table[0, pos // BS]) * BS + pos % BS
    kt, vt, q_rot = _t(k), _t(v), _t(np.zeros((1, HQ * D), np.float32))
    _compiled(rope_kv_write_decode, HQ, HKV, D, BS, CAP, cdt)(
        _t(qkv), kt, vt, _t(inv_freq), _t(table), off, ctx, q_rot)
    k2, v2 = k_slots(kt.numpy()), slots(vt.numpy())
    blk, slot = divmod(off, BS)
    tol = TOL[cdt]
    np.testing.assert_allclose(k2[blk, slot], ref_rope(qkv[0, HQ * D:(HQ + HKV) * D], pos, inv_freq),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(v2[blk, slot], qkv[0, (HQ + HKV) * D:].reshape(HKV, D),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(q_rot.numpy()[0], ref_rope(qkv[0, :HQ * D], pos, inv_freq).reshape(-1),
                               atol=TOL["float32"], rtol=0)
    untouched = np.ones((NB, BS), bool)
    untouched[blk, slot] = False
    assert k2[untouched].tobytes() == k_slots(k)[untouched].tobytes()
    assert v2[untouched].tobytes() == slots(v)[untouched].tobytes()


@pytest.mark.parametrize("pools", ["float32"], indirect=True)
@pytest.mark.parametrize("bad", ["offset_mismatch", "offset_outside", "ctx_zero", "ctx_past_cap"])
def test_kv_write_rejects_bad_indices_without_writing(pools, bad):
    cdt, k, v, table = pools
    ctx = 5
    off = int(table[0, (ctx - 1) // BS]) * BS + (ctx - 1) % BS
    off, ctx = {"offset_mismatch": (off + 1, ctx), "offset_outside": (NB * BS, ctx),
                "ctx_zero": (off, 0), "ctx_past_cap": (off, CAP * BS + 1)}[bad]
    kt, vt = _t(k), _t(v)
    with pytest.raises(Exception):
        _compiled(rope_kv_write_decode, HQ, HKV, D, BS, CAP, cdt)(
            _t(np.ones((1, (HQ + 2 * HKV) * D), np.float32)), kt, vt,
            _t(np.ones(D // 2, np.float32)), _t(table), off, ctx,
            _t(np.zeros((1, HQ * D), np.float32)))
    assert kt.numpy().tobytes() == k.tobytes() and vt.numpy().tobytes() == v.tobytes()


@pytest.mark.parametrize("pools", ["float16"], indirect=True)
def test_kv_write_prefill_through_table(pools):
    cdt, k, v, table = pools
    n, start = 6, 2
    qkv = np.random.default_rng(5).standard_normal((n, (HQ + 2 * HKV) * D)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    kt, vt, q_rot = _t(k), _t(v), _t(np.zeros((n, HQ * D), np.float32))
    _compiled(rope_kv_write_prefill, HQ, HKV, D, BS, CAP, cdt)(
        _t(qkv), kt, vt, _t(inv_freq), _t(table), start, q_rot)
    k2 = k_slots(kt.numpy())
    touched = np.zeros((NB, BS), bool)
    for i in range(n):
        blk, slot = table[0, (start + i) // BS], (start + i) % BS
        touched[blk, slot] = True
        np.testing.assert_allclose(k2[blk, slot], ref_rope(qkv[i, HQ * D:(HQ + HKV) * D], start + i,
                                                           inv_freq), atol=TOL[cdt], rtol=TOL[cdt])
    assert k2[~touched].tobytes() == k_slots(k)[~touched].tobytes()


def _ref_norm(x, g, eps=1e-5):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * g


# the register tiles of AVX-512 (4 x 4) and AVX2 (2 x 2) targets
LINEAR_TILES = sorted({t for by in TILES.values() for t in by.values()})


@pytest.mark.parametrize("wdt", ["float32", "float16"])
@pytest.mark.parametrize("n", [1, 4, 7, 70, 131])  # 70, 131: several 64-token blocks
@pytest.mark.parametrize("epilogue", ["none", "bias", "residual"])
@pytest.mark.parametrize("tile", LINEAR_TILES)
def test_prefill_linear(wdt, n, epilogue, tile):
    N, K = 40, 72  # K not a multiple of the vector width: exercises the tail
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(wdt)
    extra = {"bias": rng.standard_normal(N).astype(np.float32),
             "residual": rng.standard_normal((n, N)).astype(np.float32)}.get(epilogue)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (0 if extra is None else extra)
    y = _t(np.zeros((n, N), np.float32))
    args = [_t(x), _t(w)] + ([] if extra is None else [_t(extra)])
    _compiled(linear, N, K, wdt, epilogue, tile)(*args, y)
    np.testing.assert_allclose(y.numpy(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("N", [41, 42])  # tiles of one and two weight rows
@pytest.mark.parametrize("n", [3, 9])  # a 4-token tile and single-token passes
@pytest.mark.parametrize("tile", LINEAR_TILES)
def test_prefill_linear_narrow_tiles(N, n, tile):
    K = 48
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float16)
    res = rng.standard_normal((n, N)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + res
    y = _t(np.zeros((n, N), np.float32))
    _compiled(linear, N, K, "float16", "residual", tile)(_t(x), _t(w), _t(res), y)
    np.testing.assert_allclose(y.numpy(), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("wdt", ["float32", "float16"])
# serial; 63 lanes of one 16-row unit, the last unit partial; 64 lanes of 2-3 units, last partial
@pytest.mark.parametrize("N,K", [(40, 72), (1000, 520), (2500, 300)])
@pytest.mark.parametrize("epilogue,norm", [("none", False), ("none", True), ("bias", True),
                                           ("residual", False)])
def test_decode_gemv(wdt, N, K, epilogue, norm):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.standard_normal(K).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(wdt)
    extra = {"bias": rng.standard_normal(N).astype(np.float32),
             "residual": rng.standard_normal((1, N)).astype(np.float32)}.get(epilogue)
    xn = _ref_norm(x, g) if norm else x.astype(np.float64)
    ref = xn @ w.astype(np.float64).T + (0 if extra is None else extra)
    y = _t(np.zeros((1, N), np.float32))
    args = [_t(x)] + ([_t(g)] if norm else []) + [_t(w)] + ([] if extra is None else [_t(extra)])
    _compiled(gemv, N, K, wdt, epilogue, 1e-5 if norm else None)(*args, y)
    np.testing.assert_allclose(y.numpy(), ref, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_decode_gemv_large_k_reads_x_in_half_for_half_weights(norm):
    """K > 4096 with float16 weights: the input vector (normalised or not) is rounded to float16
    once, then every product is exact in float32 -- against numpy doing the same rounding."""
    N, K = 300, 4608
    assert x_dtype(K, "float16") == "float16" and x_dtype(K, "float32") == "float32"
    assert x_dtype(4096, "float16") == "float32"
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.standard_normal(K).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float16)
    res = rng.standard_normal((1, N)).astype(np.float32)
    xs = (_ref_norm(x, g) if norm else x).astype(np.float16).astype(np.float64)
    ref = xs @ w.astype(np.float64).T + (0 if norm else res)
    y = _t(np.zeros((1, N), np.float32))
    if norm:
        _compiled(gemv, N, K, "float16", "none", 1e-5)(_t(x), _t(g), _t(w), y)
    else:
        _compiled(gemv, N, K, "float16", "residual", None)(_t(x), _t(w), _t(res), y)
    np.testing.assert_allclose(y.numpy(), ref, atol=2e-3, rtol=1e-5)
    full = (_ref_norm(x, g) if norm else x.astype(np.float64)) @ w.astype(np.float64).T
    assert np.abs(y.numpy() - (0 if norm else res) - full).max() < 0.5  # rounding, not garbage


@pytest.mark.parametrize("N", [301, 2048])  # 301: a last 16-row unit of 13 rows, one without a pair
@pytest.mark.parametrize("K", [4608, 4616])  # 4616: a tail after the vector blocks
def test_decode_gemv_large_k_float32_reads_rows_in_pairs(N, K):
    """K > 4096 with float32 weights: two rows per pass over x, every row still exact."""
    assert row_pairs(K, "float32") and not row_pairs(K, "float16")
    assert not row_pairs(4096, "float32")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    res = rng.standard_normal((1, N)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + res
    y = _t(np.zeros((1, N), np.float32))
    _compiled(gemv, N, K, "float32", "residual", None)(_t(x), _t(w), _t(res), y)
    np.testing.assert_allclose(y.numpy(), ref, atol=5e-4, rtol=1e-5)


def _gate_up(gate, up):
    """The kernels' W, by hand: runs of 16 gate rows, each run followed by its up rows."""
    return np.concatenate([part for r in range(0, len(gate), 16)
                           for part in (gate[r:r + 16], up[r:r + 16])])


def _ref_swiglu(xn, gate, up):
    g = xn.astype(np.float64) @ gate.astype(np.float64).T
    return g / (1 + np.exp(-g)) * (xn.astype(np.float64) @ up.astype(np.float64).T)


@pytest.mark.parametrize("n", [1, 6, 70])
@pytest.mark.parametrize("inter", [24, 36])
@pytest.mark.parametrize("tile", LINEAR_TILES)
def test_prefill_swiglu(n, inter, tile):
    K = 40
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, K)).astype(np.float32)
    gate, up = rng.standard_normal((2, inter, K)).astype(np.float32)
    y = _t(np.zeros((n, inter), np.float32))
    _compiled(linear_swiglu, inter, K, "float32", tile)(_t(x), _t(_gate_up(gate, up)), y)
    np.testing.assert_allclose(y.numpy(), _ref_swiglu(x, gate, up), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("inter,K", [(24, 40), (600, 136), (1100, 72)])
def test_decode_norm_swiglu(inter, K):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = rng.standard_normal(K).astype(np.float32)
    gate, up = (rng.standard_normal((2, inter, K)) * 0.1).astype(np.float32)
    y = _t(np.zeros((1, inter), np.float32))
    _compiled(gemv_swiglu, inter, K, "float32", 1e-5)(_t(x), _t(g), _t(_gate_up(gate, up)), y)
    np.testing.assert_allclose(y.numpy(), _ref_swiglu(_ref_norm(x, g), gate, up), atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("last_only", [False, True])
def test_rmsnorm(last_only):
    H, n = 72, 5
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    ref = ref[-1:] if last_only else ref
    y = _t(np.zeros(ref.shape, np.float32))
    _compiled(rmsnorm, H, 1e-5, None, last_only)(_t(x), _t(w), y)
    np.testing.assert_allclose(y.numpy(), ref, atol=1e-5, rtol=1e-5)


def test_embedding_gathers_and_rejects_out_of_range_ids():
    V, H = 30, 20
    table = np.random.default_rng(3).standard_normal((V, H)).astype(np.float16)
    ids = np.array([0, 29, 4], np.int32)
    x = _t(np.zeros((3, H), np.float32))
    fn = _compiled(embedding, V, H, "float16", None)
    fn(_t(ids), _t(table), x)
    np.testing.assert_array_equal(x.numpy(), table[ids].astype(np.float32))
    for bad in (V, -1):
        with pytest.raises(Exception, match="out of range"):
            fn(_t(np.array([1, bad, 2], np.int32)), _t(table), x)


@pytest.mark.parametrize("mcpu,tile", [("znver3", (2, 2)), ("haswell", (2, 2)),
                                       ("znver4", (4, 4)), ("sapphirerapids", (4, 4))])
def test_the_matmul_tile_follows_the_targets_vector_registers(mcpu, tile):
    """AVX2 has 16 vector registers: a 4 x 4 tile of 16-lane accumulators would spill there."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    kernels = kernels_for("llvm", target)
    assert kernels.linear.__self__.linear_tile == tile
    assert kernels.linear_swiglu.__self__.swiglu_tile == tile


@pytest.mark.parametrize("mcpu,l2_formats", [
    ("znver4", {"float16", "q4_k", "q4_kx8", "q5_kx8", "q6_kx8"}), ("znver3", set()),
    ("sapphirerapids", set())])
def test_the_gemv_prefetch_hint_follows_the_target(mcpu, l2_formats):
    """Zen 4 prefetches float16, Q4_K and Q5_K / Q6_K interleaved into L2 (prefetcht1); every
    other format there (Q5_K / Q6_K rows too), and every format elsewhere, keeps the
    non-temporal prefetch;
    the generated code says so."""
    from paged_decode.compile.formats import FORMATS
    from paged_decode.compile.kernels.cpu import prefetch_locality
    from paged_decode.compile.kernels.cpu.simd import L2, NTA

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    kernels = kernels_for("llvm", target)
    l2 = kernels.gemv.__self__.l2_formats
    for wfmt in FORMATS:
        assert prefetch_locality(wfmt, l2) == (L2 if wfmt in l2_formats else NTA), wfmt
    want, other = ("prefetcht1", "prefetchnta") if "float16" in l2_formats else (
        "prefetchnta", "prefetcht1")
    for fn in (kernels.gemv(64, 256, "float16", "none"),
               kernels.linear_rows(64, 256, "float16", "none", 4)):  # and the small-batch GEMV
        asm = tvm.compile(fn, target=target).mod.inspect_source("asm")
        assert want in asm and other not in asm
