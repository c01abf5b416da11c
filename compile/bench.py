"""``paged-bench``: decode and prefill speed against the bandwidth floor and the baselines.

One run measures, on the same weights: the machine's read bandwidth (streaming-read kernel,
median of repeats) and the floor it implies (bytes read per token / bandwidth); our decode
(median ms/token after warm-up at several context lengths), prefill tokens/s, compile and
cache-hit load seconds, paged (scattered blocks) vs contiguous (identity table), plan-once vs
re-plan per token, host overhead on the tiny model; and HF transformers eager and llama.cpp where
installed.  Results go to JSON, a Markdown table and a PNG.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from . import baselines
from .api import prepare
from .weights import resolve_model

FULL = dict(contexts=(16, 256, 1024), n_tokens=64, prompts=(128, 512), bw_mb=512, replan=8)
QUICK = dict(contexts=(16, 64), n_tokens=8, prompts=(16, 32), bw_mb=64, replan=4)


MAX_WARMUP = 48  # calls; each decode warm-up call grows the sequence by a token


def _median_ms(fn, n: int, warmup: int = 3, warmup_s: float = 1.0) -> float:
    """Median ms of ``n`` calls after ``warmup`` calls, continued up to ``warmup_s`` seconds or
    MAX_WARMUP calls (a large model's first tokens after loading run slower)."""
    t_end = time.perf_counter() + warmup_s
    for i in range(MAX_WARMUP):
        if i >= warmup and time.perf_counter() >= t_end:
            break
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def measure_bandwidth(mb: int, repeats: int = 7) -> float:
    """GB/s of a parallel streaming read over ``mb`` MiB (median of ``repeats``)."""
    import tvm

    from .kernels.common import VL
    from .kernels.stream import CHUNKS, ROW, stream_read
    from .targets import resolve_target

    n_rows = mb * (1 << 20) // (4 * ROW * CHUNKS)
    fn = tvm.compile(stream_read(n_rows), target=resolve_target(None).target)[
        f"stream_read_{n_rows}"]
    src = tvm.runtime.tensor(np.ones((CHUNKS, n_rows, ROW), np.float32))
    dst = tvm.runtime.tensor(np.zeros((CHUNKS, VL), np.float32))
    ms = _median_ms(lambda: fn(src, dst), repeats, warmup=2)
    return CHUNKS * n_rows * ROW * 4 / (ms / 1e3) / 1e9


def bytes_per_token(m: dict, weights, ctx: int) -> int:
    """Weights read once per token (the embedding only a row unless tied) + K/V up to ``ctx``."""
    names = [p[0] for p in m["params"]]
    total = sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in weights.params)
    if "lm_head" in names:  # untied: the embedding table is gathered, not streamed
        emb = weights.params[names.index("embed")]
        total -= int(np.prod(emb.shape)) * np.dtype(emb.dtype).itemsize
    kv = 2 * m["n_layers"] * ctx * m["n_kv_heads"] * m["head_dim"] * np.dtype(m["cache_dtype"]).itemsize
    return total + kv


class _Ours:
    """Our engine over one artifact: sessions on scratch pools, no tokenizer needed."""

    def __init__(self, prepared):
        from paged_decode.runtime.artifact import load_artifact, load_weights

        t0 = time.perf_counter()
        self.artifact = load_artifact(prepared.artifact_dir)
        self.weights = load_weights(prepared.weights_dir, self.artifact)
        self.load_seconds = time.perf_counter() - t0
        self.m = self.artifact.manifest

    def pool(self, num_blocks: int):
        from paged_decode.runtime.kv_pool import PagedKVCache

        m = self.m
        return PagedKVCache(m["n_layers"], m["n_kv_heads"], m["head_dim"], m["block_size"],
                            m["cache_dtype"], num_blocks=num_blocks)

    def session(self, pool):
        from paged_decode.runtime.session import PagedDecodeSession

        return PagedDecodeSession(self.artifact, self.weights, pool)

    def decode_ms(self, ctx: int, n_tokens: int, scattered: bool = False) -> float:
        """Median ms/token decoding at context ``ctx`` (identity or scattered block table)."""
        cap = self.m["max_blocks_cap"]
        pool = self.pool(2 * cap if scattered else cap)
        if scattered:  # interleave a filler sequence so our blocks are non-contiguous
            filler = pool.new_sequence()
        handle = pool.new_sequence()
        for _ in range(-(-(ctx + n_tokens + MAX_WARMUP + 4) // self.m["block_size"])):
            if scattered:
                filler.reserve(self.m["block_size"])
                filler.advance(self.m["block_size"])
            handle.reserve(self.m["block_size"])
            handle.advance(self.m["block_size"])
        handle.truncate_to(ctx - 1)
        session = self.session(pool)
        return _median_ms(lambda: session.realize_token(handle, 1), n_tokens)

    def prefill_tps(self, n: int) -> float:
        pool = self.pool(self.m["max_blocks_cap"])
        session = self.session(pool)
        ids = np.random.default_rng(0).integers(0, self.m["vocab_size"], n)
        session.prefill(pool.new_sequence(), ids[:8])  # warm-up
        handle = pool.new_sequence()
        t0 = time.perf_counter()
        session.prefill(handle, ids)
        return n / (time.perf_counter() - t0)

    def replan_ratio(self, n_tokens: int) -> dict:
        """Per-token time with a fresh session (plan) every token vs the bound session."""
        pool = self.pool(self.m["max_blocks_cap"])
        handle = pool.new_sequence()
        session = self.session(pool)
        session.prefill(handle, [1, 2, 3])
        once = _median_ms(lambda: session.realize_token(handle, 1), n_tokens)
        replan = _median_ms(lambda: self.session(pool).realize_token(handle, 1), n_tokens)
        return {"plan_once_ms": once, "replan_ms": replan, "ratio": replan / once}

    def host_overhead_us(self) -> dict:
        """Whole Python step vs the VM's own time evaluator on the same arguments."""
        pool = self.pool(self.m["max_blocks_cap"])
        handle = pool.new_sequence()
        session = self.session(pool)
        session.prefill(handle, [1, 2, 3])
        n = self.m["max_blocks_cap"] * self.m["block_size"] - 60
        py_us = _median_ms(lambda: session.realize_token(handle, 1), n, warmup=50) * 1e3
        pos = handle.length
        handle.reserve(1)
        args = (session._token, session._table, pos + 1, handle.write_offset(pos), pool.pools,
                self.weights.params)
        te = self.artifact.vm.time_evaluator("decode", self.artifact.device, number=200, repeat=5)
        vm_us = float(np.median(te(*args).results) * 1e6)
        return {"python_step_us": py_us, "vm_call_us": vm_us, "python_overhead_us": py_us - vm_us}


def _ours(model: str, dtype: str, cfg: dict, artifacts, say) -> dict:
    max_ctx = max(max(cfg["contexts"]), max(cfg["prompts"])) + cfg["n_tokens"] + MAX_WARMUP + 16
    prepared = prepare(model, block_size=16, max_context=max_ctx, cache_dtype=dtype,
                       weight_dtype=dtype, artifacts=artifacts)
    ours = _Ours(prepared)
    m = ours.m
    res = {"compile_seconds": m["compile_seconds"], "cache_hit": prepared.cache_hit,
           "load_seconds": ours.load_seconds, "library_mb": m["library_bytes"] / 1e6}
    say(f"  decode at contexts {cfg['contexts']}")
    res["decode_ms"] = {c: ours.decode_ms(c, cfg["n_tokens"]) for c in cfg["contexts"]}
    res["prefill_tps"] = {n: ours.prefill_tps(n) for n in cfg["prompts"]}
    ctx = max(cfg["contexts"])
    scattered = ours.decode_ms(ctx, cfg["n_tokens"], scattered=True)
    res["paged_vs_contiguous"] = {"context": ctx, "contiguous_ms": res["decode_ms"][ctx],
                                  "scattered_ms": scattered,
                                  "ratio": scattered / res["decode_ms"][ctx]}
    res["replan"] = ours.replan_ratio(cfg["replan"])
    res["bytes_per_token"] = {c: bytes_per_token(m, ours.weights, c) for c in cfg["contexts"]}
    if m["name"] == "tiny":
        res["host_overhead"] = ours.host_overhead_us()
    res["_params"] = ours.weights  # dropped before writing; the baselines reuse the weights
    return res


def _in_child(fn, *args):
    """Run ``fn(*args)`` in a fresh process: another engine's thread pool (TVM's workers spin
    after each call) must not share cores with the one being timed."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def _llamacpp_child(model: str, dtype: str, cfg: dict, workdir: str) -> dict:
    source = resolve_model(model)
    gguf = baselines.write_gguf(source.config, source.load_params("float32"),
                                Path(workdir) / f"bench-{dtype}.gguf", dtype)
    try:
        return baselines.time_llamacpp(gguf, cfg["contexts"], cfg["n_tokens"], cfg["prompts"],
                                       os.cpu_count() or 1, dtype)
    finally:
        gguf.unlink()


def _hf_child(model: str, cfg: dict) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    source = resolve_model(model)
    model_hf = baselines.hf_model(source.config, source.load_params("float32"), "float32")
    return baselines.time_hf(model_hf, cfg["contexts"], max(cfg["n_tokens"] // 4, 4),
                             cfg["prompts"])


def _baselines(model: str, dtype: str, cfg: dict, say, workdir: Path) -> dict:
    """llama.cpp (same dtype) and HF eager (float32) on the same weights, each in a child."""
    out = {}
    reason = baselines.llamacpp_available()
    if reason:
        out["llama.cpp"] = {"skipped": reason}
    else:
        say(f"  llama.cpp {dtype}")
        out["llama.cpp"] = _in_child(_llamacpp_child, model, dtype, cfg, str(workdir))
    if importlib.util.find_spec("transformers") is None:
        out["hf-eager"] = {"skipped": "transformers is not installed (pip install -e '.[bench]')"}
    elif dtype != "float32":
        out["hf-eager"] = {"skipped": "HF eager float16 on CPU has no fast kernels; float32 only"}
    else:
        say("  HF transformers eager float32")
        out["hf-eager"] = _in_child(_hf_child, model, cfg)
    return out


def run_bench(models: list[str], out_dir: Path, *, quick: bool = False, artifacts=None,
              dtypes=("float32", "float16"), progress: Callable[[str], None] | None = None) -> dict:
    """Run every measurement for each model x dtype; write bench.json, bench.md, bench.png."""
    say = progress or (lambda _m: None)
    cfg = QUICK if quick else FULL
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "threads": os.environ.get("TVM_NUM_THREADS")},
              "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
              "runs": []}
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            for dtype in dtypes:
                say(f"{model} {dtype}")
                ours = _ours(model, dtype, cfg, artifacts, say)
                ours.pop("_params")
                # the shared machine's bandwidth drifts: measure it next to each run
                say(f"  read bandwidth over {cfg['bw_mb']} MiB")
                bw = measure_bandwidth(cfg["bw_mb"])
                floor = {c: b / (bw * 1e9) * 1e3 for c, b in ours["bytes_per_token"].items()}
                run = {"model": model, "dtype": dtype, "bandwidth_gbps": bw, "ours": ours,
                       "floor_ms": floor,
                       "baselines": _baselines(model, dtype, cfg, say, Path(work))}
                report["runs"].append(run)
    from .bench_report import write_outputs

    return write_outputs(report, out_dir)
