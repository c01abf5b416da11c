"""Sliding-window attention, logit soft-capping and the score scale in every attention kernel
(CPU decode, decode_dev, prefill, batch; the GPU ones through OpenCL) against numpy.

A query at position q sees the positions p with q - window < p <= q.  Every position outside
the window(s) a call reads holds inf (K) / nan (V), and every table entry before the first
window's first block points past the pool: a kernel that read such a block rather than
skipping it, or did not mask the out-of-window rows of the block it starts in, fails the
comparison or its table check.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm

from paged_decode.compile.kernels.cpu.attention import (PARALLEL_MIN_WORK,
                                                        paged_attention_decode,
                                                        paged_attention_decode_dev,
                                                        paged_attention_prefill)
from paged_decode.compile.kernels.cpu.batch import paged_attention_batch
from paged_decode.compile.kernels.gpu import attention as gpu
from paged_decode.compile.kernels.signatures import attention_options
from paged_decode.compile.targets import resolve_target
from paged_decode.runtime.errors import ConfigError

from .conftest import TOL
from .test_kernels import _t, k_slots, slots

# (Hq, Hkv, D, block_size): GQA on small heads; one query head per kv head; Gemma 3 270M's
# heads (head_dim 256, 4 query heads on 1 kv head) with 16-token blocks and with the CPU
# default of 64
SMALL, GQA1, GEMMA16, GEMMA = (4, 2, 16, 4), (2, 2, 16, 4), (4, 1, 256, 16), (4, 1, 256, 64)
OPTS = ("window", "softcap", "scale")
_BUILT: dict = {}  # global_symbol -> the compiled kernel


@functools.lru_cache(maxsize=None)
def _kernel(factory, geo: tuple, opts: tuple):
    """``factory(*geo, window=, softcap=, scale=)`` compiled for this CPU, once per symbol."""
    func = factory(*geo, **dict(zip(OPTS, opts)))
    symbol = func.attrs["global_symbol"]
    if symbol not in _BUILT:
        _BUILT[symbol] = tvm.compile(func, target=resolve_target(None).target)[symbol]
    return _BUILT[symbol]


def ref_attention(q, k, v, table, ctx, window=0, softcap=0.0, scale=0.0, gpu_layout=False):
    """q (Hq, D) at position ctx - 1 against positions [max(0, ctx - window), ctx) (all of
    [0, ctx) for window 0) gathered through the table, in float64; K blocks as the CPU kernels
    store them, or ``[slot, dim]`` as the GPU ones do (``gpu_layout``)."""
    hq, (_, hkv, bs, d) = q.shape[0], k.shape
    pos = np.arange(max(0, ctx - window) if window else 0, ctx)
    k_view = slots(k) if gpu_layout else k_slots(k)
    kk = k_view[table[pos // bs], pos % bs].astype(np.float64)  # (positions, Hkv, D)
    vv = slots(v)[table[pos // bs], pos % bs].astype(np.float64)
    out = np.empty((hq, d))
    for h in range(hq):
        s = kk[:, h // (hq // hkv)] @ q[h].astype(np.float64) * (scale or 1 / np.sqrt(d))
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv[:, h // (hq // hkv)]
    return out.reshape(-1)


def _rows(window: int, bs: int) -> int:
    """The positions a test table holds: four windows, at least three blocks."""
    return -(-max(4 * window, 3 * bs) // bs) * bs


def _pools(rng, shape, cdt, blocks: int):
    _, hkv, d, bs = shape
    k = rng.standard_normal((blocks, hkv, bs, d)).astype(cdt)
    v = rng.standard_normal((blocks, hkv, bs, d)).astype(cdt)
    return k, v


def _poison(k, v, table, lo: int, hi: int, gpu_layout=False):
    """In place: every position of ``table`` outside [lo, hi) inf in K and nan in V; the
    entries before the block of ``lo`` past the pool (a copy of the table is returned)."""
    bs, table = k.shape[2], table.copy()
    pos = np.concatenate([np.arange(0, lo), np.arange(hi, table.shape[0] * bs)])
    (slots(k) if gpu_layout else k_slots(k))[table[pos // bs], pos % bs] = np.inf
    slots(v)[table[pos // bs], pos % bs] = np.nan
    table[: lo // bs] = k.shape[0] + 1000
    return table


def _contexts(window: int, rows: int) -> list[int]:
    """Before, at and just past the window, and several windows long."""
    return sorted({c for c in (1, window - 1, window, window + 1, 2 * window + 3, rows - 5, rows)
                   if 1 <= c <= rows})


# -- CPU decode / decode_dev ---------------------------------------------------------------------

def _check_decode(factory, shape, cdt, window, softcap=0.0, scale=0.0, dev=False, seed=0):
    hq, hkv, d, bs = shape
    rows = _rows(window or 3 * bs, bs)
    cap = rows // bs
    fn = _kernel(factory, (hq, hkv, d, bs, cap, cdt), (window, softcap, scale))
    rng = np.random.default_rng(seed)
    k, v = _pools(rng, shape, cdt, cap + 3)
    table = rng.permutation(cap + 3)[:cap].astype(np.int32)
    for ctx in _contexts(window or rows, rows):
        lo = max(0, ctx - window) if window else 0
        kp, vp = k.copy(), v.copy()
        tp = _poison(kp, vp, table, lo, ctx)
        q = 2 * rng.standard_normal((1, hq * d)).astype(np.float32)  # peaked softmax too
        out = _t(np.zeros((1, hq * d), np.float32))
        fn(_t(q), _t(kp), _t(vp), _t(tp[None]),
           _t(np.array([ctx], np.int64)) if dev else ctx, out)
        want = ref_attention(q[0].reshape(hq, d), k, v, table, ctx, window, softcap, scale)
        np.testing.assert_allclose(out.numpy()[0], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"context {ctx}, window {window}")


@pytest.mark.parametrize("shape,window,cdt", [
    (SMALL, 7, "float32"), (SMALL, 7, "float16"), (SMALL, 1, "float32"), (GQA1, 6, "float16"),
    (GEMMA16, 25, "float32"), (GEMMA, 97, "float32"), (GEMMA, 97, "float16"),
    (GEMMA, 1, "float16")])
def test_decode_window(shape, window, cdt):
    """Windows not a multiple of the block size, of one position; contexts up to four windows
    long.  GEMMA16's 25-position window reads 2-3 blocks, below and above the serial / parallel
    threshold; GEMMA's reads 2-3 64-token blocks in 2 parallel parts."""
    _check_decode(paged_attention_decode, shape, cdt, window)


@pytest.mark.parametrize("cdt", ["float16"])
def test_decode_window_over_many_parts(cdt):
    """A 300-position window over 16-token blocks: 19-20 blocks read, split in 3 parallel parts,
    at contexts up to 1200."""
    hq, _, d, _ = GEMMA16
    assert 300 * hq * d >= PARALLEL_MIN_WORK
    _check_decode(paged_attention_decode, GEMMA16, cdt, 300)


@pytest.mark.parametrize("shape,window,cdt", [(SMALL, 7, "float32"), (GEMMA, 97, "float16")])
def test_decode_dev_window(shape, window, cdt):
    _check_decode(paged_attention_decode_dev, shape, cdt, window, dev=True)


@pytest.mark.parametrize("shape,window,softcap,scale,cdt", [
    (SMALL, 0, 3.0, 0.0, "float32"), (SMALL, 0, 0.0, 0.3, "float32"),
    (SMALL, 7, 3.0, 0.3, "float16"), (GEMMA, 97, 3.0, 0.3, "float32"),
    (GQA1, 6, 2.0, 0.0, "float32")])
def test_decode_softcap_and_scale(shape, window, softcap, scale, cdt):
    """Soft-capping (scores around +-3 and past, so tanh bends them) and the scale, alone and
    together, with and without a window, serial (SMALL) and in parallel parts (GEMMA)."""
    _check_decode(paged_attention_decode, shape, cdt, window, softcap, scale, seed=1)


# -- CPU prefill -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,window,softcap,scale,cdt", [
    (SMALL, 7, 0.0, 0.0, "float32"), (SMALL, 7, 0.0, 0.0, "float16"),
    (SMALL, 1, 0.0, 0.0, "float32"), (GEMMA, 97, 0.0, 0.0, "float16"),
    (SMALL, 6, 3.0, 0.3, "float32")])
def test_prefill_window(shape, window, softcap, scale, cdt):
    """Each row over its own window: a prompt from position 0 several windows long, and a
    chunk starting mid-sequence (start_pos past a window), through one kernel."""
    hq, hkv, d, bs = shape
    rows = _rows(window, bs)
    cap = rows // bs
    fn = _kernel(paged_attention_prefill, (hq, hkv, d, bs, cap, cdt), (window, softcap, scale))
    rng = np.random.default_rng(window)
    k, v = _pools(rng, shape, cdt, cap + 3)
    table = rng.permutation(cap + 3)[:cap].astype(np.int32)
    mid = 2 * window + bs // 2 + 1
    for start, n in ((0, rows - bs - 1), (mid, rows - mid - 1), (rows - 3, 3)):
        kp, vp = k.copy(), v.copy()
        tp = _poison(kp, vp, table, max(0, start + 1 - window), start + n)
        q = 2 * rng.standard_normal((n, hq * d)).astype(np.float32)
        out = _t(np.zeros((n, hq * d), np.float32))
        fn(_t(q), _t(kp), _t(vp), _t(tp[None]), start, out)
        for i in range(n):
            want = ref_attention(q[i].reshape(hq, d), k, v, table, start + i + 1, window,
                                 softcap, scale)
            np.testing.assert_allclose(out.numpy()[i], want, atol=TOL["float32"], rtol=0,
                                       err_msg=f"start {start}, row {i}")


# -- CPU batch -------------------------------------------------------------------------------------

def _batch_case(rng, shape, cdt, window, ctxs, gpu_layout=False):
    """Row r over its own blocks (disjoint, so each row's out-of-window positions can be
    poisoned): pools, the poisoned pools, each row's clean and poisoned table."""
    hq, _, d, bs = shape
    cap = -(-max(ctxs) // bs)
    k, v = _pools(rng, shape, cdt, len(ctxs) * cap + 2)
    perm = rng.permutation(k.shape[0]).astype(np.int32)
    tables = np.stack([perm[r * cap:(r + 1) * cap] for r in range(len(ctxs))])
    kp, vp = k.copy(), v.copy()
    poisoned = np.stack([_poison(kp, vp, tables[r], max(0, c - window) if window else 0, c,
                                 gpu_layout) for r, c in enumerate(ctxs)])
    q = 2 * rng.standard_normal((len(ctxs), hq * d)).astype(np.float32)
    return cap, q, (k, v, tables), (kp, vp, poisoned)


@pytest.mark.parametrize("shape,window,softcap,scale,cdt", [
    (SMALL, 7, 0.0, 0.0, "float32"), (SMALL, 7, 0.0, 0.0, "float16"),
    (GQA1, 1, 0.0, 0.0, "float32"), (GEMMA, 97, 3.0, 0.0, "float16")])
def test_batch_window(shape, window, softcap, scale, cdt):
    """Rows of different lengths (a padding row, one inside the window, one at it, several
    windows long) in one call: each row over its own window."""
    hq, hkv, d, bs = shape
    ctxs = [5, 0, 1, 4 * window + bs, 2 * window + 3, window]
    rng = np.random.default_rng(3)
    cap, q, (k, v, tables), (kp, vp, tp) = _batch_case(rng, shape, cdt, window, ctxs)
    fn = _kernel(paged_attention_batch, (hq, hkv, d, bs, cap, cdt, len(ctxs)),
                 (window, softcap, scale))
    out = _t(np.full((len(ctxs), hq * d), 7.0, np.float32))
    fn(_t(q), _t(kp), _t(vp), _t(tp), _t(np.array(ctxs, np.int64)), out)
    for r, c in enumerate(ctxs):
        want = (ref_attention(q[r].reshape(hq, d), k, v, tables[r], c, window, softcap, scale)
                if c else np.zeros(hq * d))
        np.testing.assert_allclose(out.numpy()[r], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"row {r}, context {c}")


# -- names and options -----------------------------------------------------------------------------

FACTORIES = [(paged_attention_decode, ()), (paged_attention_decode_dev, ()),
             (paged_attention_prefill, ()), (paged_attention_batch, (4,)),
             (gpu.paged_attention_decode, ()), (gpu.paged_attention_decode_dev, ()),
             (gpu.paged_attention_prefill, ()), (gpu.paged_attention_batch, (4,))]


@pytest.mark.parametrize("factory,extra", FACTORIES)
def test_options_name_the_kernel(factory, extra):
    """At the defaults (or an explicit 1 / sqrt(D)) a kernel is today's, under today's name;
    with options the name carries them, so a sliding and a full layer's kernels can sit in one
    module."""
    geo = (4, 1, 16, 4, 8, "float16") + extra  # head_dim 16, 32 positions
    kind = {"paged_attention_decode": "dec", "paged_attention_decode_dev": "dec",
            "paged_attention_prefill": "pre", "paged_attention_batch": "bat4"}[factory.__name__]
    dev = "_dev" if factory.__name__.endswith("_dev") else ""
    gpu_ = "gpu_" if ".gpu." in factory.__module__ else ""
    base = factory(*geo)
    assert base.attrs["global_symbol"] == f"{gpu_}attn_{kind}_q4kv1d16_bs4_cap8_f16{dev}"
    same = factory(*geo, window=32, softcap=0.0, scale=0.25)
    assert same.attrs["global_symbol"] == base.attrs["global_symbol"]
    assert same.script() == base.script()
    assert factory(*geo, window=5, softcap=30.0, scale=0.1).attrs["global_symbol"] == (
        f"{gpu_}attn_{kind}_q4kv1d16_bs4_cap8_f16_win5_softcap30p0_scale0p1{dev}")


def test_option_tags_tell_kernels_apart():
    """Each option alone and together gives its own tag; the defaults, an explicit 1 / sqrt(D)
    and a window of at least the table's positions (no query sees further back) give none."""
    tags = [attention_options(16, 32, *opts)[3] for opts in (
        (0, 0.0, 0.0), (5, 0.0, 0.0), (6, 0.0, 0.0), (31, 0.0, 0.0), (0, 30.0, 0.0),
        (0, 0.0, 0.1), (5, 30.0, 0.0), (5, 30.0, 0.1), (0, 50.0, 0.0), (0, 0.0, 1e-5))]
    assert len(set(tags)) == len(tags), tags
    assert tags[0] == "" and tags[-1] == "_scale1em05"
    for same in ((32, 0.0, 0.25), (1000, 0.0, 0.0), (0, 0.0, 0.25)):
        assert attention_options(16, 32, *same) == (0, 0.0, 0.25, "")
    assert attention_options(16, 32, 5, 30, 0.0) == (5, 30.0, 0.25, "_win5_softcap30p0")


@pytest.mark.parametrize("kw,field", [
    (dict(window=-1), "window -1"), (dict(window=2.5), "window 2.5"),
    (dict(softcap=-1.0), "softcap -1.0"), (dict(scale=float("nan")), "scale nan"),
    (dict(scale=float("inf")), "scale inf")])
def test_bad_options_are_refused(kw, field):
    for factory, extra in FACTORIES:
        with pytest.raises(ConfigError, match=f"attention {field} must be"):
            factory(4, 1, 16, 4, 8, "float16", *extra, **kw)


# -- GPU kernels, run on an OpenCL device (pocl on the CPU; float32, see test_targets) -----------

def _ocl():
    from .test_targets import _launch

    return _launch


@pytest.mark.parametrize("shape,window,softcap,scale", [
    ((4, 2, 16, 4), 7, 0.0, 0.0), ((4, 1, 256, 16), 25, 3.0, 0.3), ((9, 3, 64, 16), 200, 0.0, 0.0)])
def test_gpu_decode_window_on_opencl(shape, window, softcap, scale):
    """The GPU decode and decode_dev kernels over the window's positions only (several
    128-position chunks where the window is long), against numpy."""
    launch = _ocl()
    hq, hkv, d, bs = shape
    rows = _rows(window, bs)
    cap = rows // bs
    rng = np.random.default_rng(window)
    k, v = _pools(rng, shape, "float32", cap + 3)
    table = rng.permutation(cap + 3)[:cap].astype(np.int32)
    kw = dict(window=window, softcap=softcap, scale=scale)
    dec = gpu.paged_attention_decode(hq, hkv, d, bs, cap, "float32", **kw)
    dev = gpu.paged_attention_decode_dev(hq, hkv, d, bs, cap, "float32", **kw)
    nt = max(1, 128 // d) * d
    for ctx in (window - 1, window + 1, rows - 1):
        kp, vp = k.copy(), v.copy()
        tp = _poison(kp, vp, table, max(0, ctx - window), ctx, gpu_layout=True)
        q = 2 * rng.standard_normal((1, hq * d)).astype(np.float32)
        want = ref_attention(q[0].reshape(hq, d), k, v, table, ctx, **kw, gpu_layout=True)
        arrays = dict(q=q, k_pool=kp, v_pool=vp, bt=tp[None], out=np.zeros_like(q))
        got = launch(dec, arrays, dict(context_len=ctx, num_blocks=k.shape[0]), (hq, 1, 1),
                     (nt, 1, 1))["out"]
        np.testing.assert_allclose(got[0], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"context {ctx}")
        arrays["context_len"] = np.array([ctx], np.int64)
        got = launch(dev, arrays, dict(num_blocks=k.shape[0]), (hq, 1, 1), (nt, 1, 1))["out"]
        np.testing.assert_allclose(got[0], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"dev, context {ctx}")


def test_gpu_prefill_and_batch_window_on_opencl():
    """GPU prefill from mid-sequence (each row its own window) and a ragged batch with a
    padding row, window 7 over 4-position blocks, soft-capped and scaled."""
    launch = _ocl()
    shape, window, kw = (4, 2, 16, 4), 7, dict(window=7, softcap=3.0, scale=0.3)
    hq, hkv, d, bs = shape
    rng = np.random.default_rng(11)
    rows = _rows(window, bs)
    cap, (start, n) = rows // bs, (17, 9)
    k, v = _pools(rng, shape, "float32", cap + 3)
    table = rng.permutation(cap + 3)[:cap].astype(np.int32)
    kp, vp = k.copy(), v.copy()
    tp = _poison(kp, vp, table, start + 1 - window, start + n, gpu_layout=True)
    q = 2 * rng.standard_normal((n, hq * d)).astype(np.float32)
    got = launch(gpu.paged_attention_prefill(hq, hkv, d, bs, cap, "float32", **kw),
                 dict(q=q, k_pool=kp, v_pool=vp, bt=tp[None], out=np.zeros_like(q)),
                 dict(start_pos=start, num_blocks=k.shape[0], n=n), (hq, n, 1), (128, 1, 1))
    for i in range(n):
        want = ref_attention(q[i].reshape(hq, d), k, v, table, start + i + 1, **kw,
                             gpu_layout=True)
        np.testing.assert_allclose(got["out"][i], want, atol=TOL["float32"], rtol=0)
    ctxs = [5, 0, 1, rows, 2 * window + 3]
    cap, q, (k, v, tables), (kp, vp, tp) = _batch_case(rng, shape, "float32", window, ctxs,
                                                       gpu_layout=True)
    got = launch(gpu.paged_attention_batch(hq, hkv, d, bs, cap, "float32", len(ctxs), **kw),
                 dict(q=q, k_pool=kp, v_pool=vp, bt=tp, context_lens=np.array(ctxs, np.int64),
                      out=np.full_like(q, np.nan)),
                 dict(num_blocks=k.shape[0]), (hq, len(ctxs), 1), (128, 1, 1))["out"]
    for r, c in enumerate(ctxs):
        want = (ref_attention(q[r].reshape(hq, d), k, v, tables[r], c, **kw, gpu_layout=True)
                if c else np.zeros(hq * d))
        np.testing.assert_allclose(got[r], want, atol=TOL["float32"], rtol=0,
                                   err_msg=f"row {r}, context {c}")


@pytest.mark.parametrize("factory,extra", FACTORIES[4:])
def test_gpu_window_kernels_lower_for_cuda(factory, extra):
    """The CUDA build of a sliding, soft-capped, scaled kernel (Gemma 3's heads) generates
    device code; running it needs a GPU (test_targets' gpu-marked matrix)."""
    func = factory(4, 1, 256, 16, 32, "float16", *extra, window=512, softcap=50.0, scale=0.0625)
    target = resolve_target("cuda")
    if target.missing_toolchain():
        pytest.skip(target.missing_toolchain())
    lib = tvm.compile(func, target=target.target)
    assert "tanh" in lib.mod.imports[0].inspect_source("")
