"""The CPU kernels' parallel work sharing (``claimed_units``) and scratch placement: every unit
runs under any thread count, repeated calls never leave a unit out, and no decode kernel takes a
heap workspace inside its parallel loop."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from paged_decode.compile.kernels.cpu.attention import paged_attention_decode
from paged_decode.compile.kernels.common import finalize
from paged_decode.compile.kernels.cpu.simd import MAX_LANES, claimed_units
from paged_decode.compile.kernels.cpu.gemv import gemv, gemv_swiglu
from paged_decode.compile.kernels.cpu.norm import embedding, rmsnorm
from paged_decode.compile.kernels.cpu.rope_kv import rope_kv_write_decode
from paged_decode.compile.targets import resolve_target

UNITS = [1, 5, MAX_LANES - 1, MAX_LANES, MAX_LANES + 1, 200]


def probe(units: int, parallel: bool, slow_below: int = 0):
    """A kernel whose unit ``u`` adds 1 to ``marks[lane, u]`` and writes ``out[u] = u + 1``;
    units below ``slow_below`` first spin ~20 us on ``spin[lane]``."""
    run, lanes = claimed_units(units, parallel)

    @T.macro
    def mark(lane, u, marks, out, spin):
        marks[lane, u] = marks[lane, u] + 1
        if u < slow_below:
            for k in range(20000):
                spin[lane] = spin[lane] * T.float32(0.999) + T.float32(1)
        out[u] = T.Cast("int32", u) + 1

    @T.prim_func(s_tir=True)
    def func(marks: T.Buffer((lanes, units), "int32"), out: T.Buffer((units,), "int32"),
             spin: T.Buffer((lanes,), "float32")):
        with T.sblock("root"):
            run(mark, marks, out, spin)

    name = f"probe_{units}_{int(parallel)}_{slow_below}"
    lib = tvm.compile(finalize(func, name), target=resolve_target(None).target)
    fn = lib[name]

    def call() -> tuple[np.ndarray, np.ndarray]:
        """(marks, out) of one call on zeroed buffers."""
        bufs = [tvm.runtime.tensor(np.zeros(shape, dt)) for shape, dt in
                (((lanes, units), np.int32), ((units,), np.int32), ((lanes,), np.float32))]
        fn(*bufs)
        return bufs[0].numpy(), bufs[1].numpy()

    return call, lanes


def check_probe(units: int, parallel: bool, calls: int) -> None:
    call, lanes = probe(units, parallel)
    for _ in range(calls):
        marks, out = call()
        np.testing.assert_array_equal(out, np.arange(1, units + 1))
        ran = marks.sum(0)
        assert ran.min() >= 1, f"units {np.flatnonzero(ran == 0)} never ran"
    assert lanes == (min(units, MAX_LANES) if parallel else 1)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("units", UNITS)
def test_every_unit_runs(units, parallel):
    check_probe(units, parallel, calls=50)


@pytest.mark.serial
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="stealing needs two cores")
def test_idle_thread_claims_the_slow_threads_units_without_duplicating_them():
    """Units are taken from lanes another thread owns, about a quarter of them per call, and
    seldom run twice.  Without the compiler barrier (claim loads hoisted out of their loops)
    the owners ran the taken units again (93 twice in 3 calls); with stealing off, none were
    taken."""
    assert tvm.runtime.num_threads() >= 2, "conftest starts TVM's pool on every core"
    units = 128
    # the lower half is slow: the highest thread (which may always steal: it has no next lane
    # to wait for) runs out of work first and must claim lower units
    call, lanes = probe(units, True, slow_below=units // 2)
    owner = np.repeat(np.arange(lanes), np.diff([w * units // lanes for w in range(lanes + 1)]))
    calls = twice = 0
    stealing = []  # units run by a lane that does not own them, in calls that stole an eighth+
    call()  # wake the pool
    while len(stealing) < 3 and calls < 40:  # a call where the OS kept one thread off its core
        calls += 1                           # cannot steal: up to 40 calls for 3 that could
        m, out = call()
        np.testing.assert_array_equal(out, np.arange(1, units + 1))
        assert m.sum(0).min() >= 1
        stolen = int(sum(m[lane, u] for u in range(units) for lane in range(lanes)
                         if lane != owner[u] and m[lane, u]))
        if stolen >= units // 8:  # about units // 4 when both threads run
            stealing.append(stolen)
        twice += int((m.sum(0) > 1).sum())
    assert len(stealing) == 3, f"{len(stealing)} of {calls} calls stole {units // 8}+ units"
    assert twice <= 2 * calls, f"{twice} units ran twice in {calls} calls"


@pytest.mark.parametrize("threads", [1, 3])
def test_every_unit_runs_under_other_thread_counts(threads):
    """The claims never rely on how many threads TVM's pool has (one: the last lane finds every
    unit claimed; three on two cores: threads pre-empted mid-unit)."""
    code = ("from tests.test_parallel_units import UNITS, check_probe\n"
            "for u in UNITS:\n    check_probe(u, True, calls=30)\nprint('ok')")
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _run(factory, *args):
    func = factory(*args)
    lib = tvm.compile(func, target=resolve_target(None).target)
    return lib[func.attrs["global_symbol"]]


def test_repeated_gemv_calls_fill_every_row():
    """A unit left out would keep the NaN the output starts with (200 calls, units met from both
    ends at a different place each time)."""
    N, K = 2500, 256
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    res = rng.standard_normal((1, N)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + res
    fn = _run(gemv, N, K, "float32", "residual", None)
    xt, wt, rt = (tvm.runtime.tensor(a) for a in (x, w, res))
    for _ in range(200):
        y = tvm.runtime.tensor(np.full((1, N), np.nan, np.float32))
        fn(xt, wt, rt, y)
        np.testing.assert_allclose(y.numpy(), ref, atol=2e-4, rtol=1e-5)


def test_repeated_swiglu_calls_fill_every_row():
    inter, K = 1100, 72
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = np.ones(K, np.float32)
    w = (rng.standard_normal((2 * inter, K)) * 0.1).astype(np.float32)
    fn = _run(gemv_swiglu, inter, K, "float32", 1e-5)
    args = [tvm.runtime.tensor(a) for a in (x, g, w)]
    first = None
    for _ in range(200):
        act = tvm.runtime.tensor(np.full((1, inter), np.nan, np.float32))
        fn(*args, act)
        out = act.numpy()
        assert np.isfinite(out).all()
        if first is None:
            first = out
        np.testing.assert_array_equal(out, first)  # whichever lane ran a unit, the same bits


DECODE_KERNELS = {
    "gemv_f16": (gemv, 2304, 768, "float16"),
    "gemv_norm_bias": (gemv, 2304, 768, "float32", "bias", 1e-5),
    "gemv_residual_pairs": (gemv, 768, 4608, "float32", "residual", None),
    "gemv_swiglu": (gemv_swiglu, 2048, 768, "float16", 1e-5),
    "attention_gqa": (paged_attention_decode, 32, 4, 64, 16, 70, "float16"),
    "attention_gqa_d256": (paged_attention_decode, 8, 4, 256, 16, 70, "float32"),
    "attention": (paged_attention_decode, 12, 12, 64, 16, 70, "float32"),
    "rope_kv": (rope_kv_write_decode, 12, 12, 64, 16, 70, "float32"),
    "rmsnorm": (rmsnorm, 768, 1e-5, 1),
    "embedding": (embedding, 32000, 768, "float32", 1),
}


@pytest.mark.parametrize("name", list(DECODE_KERNELS))
def test_decode_kernels_take_no_heap_scratch_inside_parallel_loops(name):
    """TVM turns a "local" buffer, a scalar assigned in a loop, or a scratch of 1 KiB or more into
    a TVMBackendAllocWorkspace + FreeWorkspace pair at every loop entry (``scratch_buffer``):
    the parallel bodies of the per-token kernels must have none, and the serial ones (a single
    token's RoPE, norm, embedding row) none at all."""
    factory, *args = DECODE_KERNELS[name]
    func = factory(*args)
    lib = tvm.compile(func, target=resolve_target(None).target)
    ll = lib.mod.inspect_source("ll")
    bodies = re.split(r"\ndefine ", ll)
    lambdas = [b for b in bodies if re.match(r"[^@]*@__tvm_parallel_lambda", b)]
    assert bool(lambdas) == name.startswith(("gemv", "attention")), "parallel loops changed"
    for body in lambdas or bodies:
        assert "TVMBackendAllocWorkspace" not in body, body[:2000]
