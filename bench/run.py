"""``paged-bench``: decode and prefill speed against the bandwidth floor and the baselines.

One run measures, on the same weights: the machine's read bandwidth (streaming-read kernel,
median of repeats) and the floor it implies (bytes read per token / bandwidth); our decode
(median ms/token after warm-up at several context lengths), prefill tokens/s, compile and
cache-hit load seconds, paged (scattered blocks) vs contiguous (identity table), plan-once vs
re-plan per token, host overhead on the tiny model, a read-only step (the weight matrices a step
streams, each read by a read-only kernel: what the kernel boundaries alone leave of the floor);
and HF transformers eager and llama.cpp where installed.  Results go to JSON, a Markdown table
and a PNG.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from . import baselines, batch
from .baselines import median_ms, spread, warm_up
from .roofs import kv_bytes, measure_bandwidth, streamed_bytes, streamed_params
from paged_decode.compile.api import prepare
from paged_decode.compile.weights import ModelSource, resolve_model

# Each run alternates ``rounds`` rounds of: per context a bracketed pair (bandwidth, ours,
# llama.cpp, ours, bandwidth), redone up to ``retries`` times while it straddles a regime flip,
# then both prefills.  Ratios are taken within a pair, and their median over the pairs that
# stayed in one bandwidth regime is reported: this shared machine's bandwidth jumps by 30-80 %
# between two regimes, sometimes seconds apart, so numbers measured even a minute apart do not
# compare.
FULL = dict(contexts=(16, 256, 1024), n_tokens=32, rounds=4, retries=2, prompts=(128, 512),
            bw_mb=512, replan=8)
QUICK = dict(contexts=(16, 64), n_tokens=8, rounds=2, retries=1, prompts=(16, 32), bw_mb=64,
             replan=4)
SECTIONS = ("decode", "batch", "serve", "start", "speculative")
FIRST_WARMUP_S, LATER_WARMUP_S = 1.0, 0.3  # a model's first tokens after loading run slower


def prompt_ids(n: int, vocab_size: int) -> np.ndarray:
    """``int32 [n]``: a seeded prompt of ids drawn inside the vocabulary (a prompt longer than a
    small preset's vocabulary repeats ids, never leaves it)."""
    return np.random.default_rng(0).integers(0, vocab_size, n, dtype=np.int32)


def bytes_per_token(m, weights, ctx: int) -> int:
    """Weights read once per token (the embedding only a row unless tied) + K/V up to ``ctx``."""
    return streamed_bytes(m, weights) + kv_bytes(m, ctx)


def streamed_matrices(m, weights) -> list:
    """The matrices among ``streamed_params`` (each a stream of its own in a decode step; the
    1-D norm gains and biases are read inside the GEMVs)."""
    return [t for t in streamed_params(m, weights) if len(t.shape) == 2]


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

        return PagedKVCache.for_artifact(self.artifact, num_blocks=num_blocks)

    def session(self, pool):
        from paged_decode.runtime.session import PagedDecodeSession

        return PagedDecodeSession(self.artifact, self.weights, pool)

    def _decoding(self, ctx: int, n_tokens: int, scattered: bool):
        """One decode step (a callable) at context ``ctx`` on a fresh pool, the sequence cut to
        ``ctx - 1`` tokens with room for ``n_tokens`` + 52 more, through an identity block table
        or a scattered one (a filler sequence's blocks between ours)."""
        cap, bs = self.m.max_blocks_cap, self.m.block_size
        pool = self.pool(2 * cap if scattered else cap)
        filler = pool.new_sequence() if scattered else None
        handle = pool.new_sequence()
        for _ in range(-(-(ctx + n_tokens + 52) // bs)):  # 48 warm-up calls
            if filler is not None:
                filler.reserve(bs)
                filler.advance(bs)
            handle.reserve(bs)
            handle.advance(bs)
        handle.truncate_to(ctx - 1)
        session = self.session(pool)
        return lambda: session.realize_token(handle, 1)

    def decode_ms(self, ctx: int, n_tokens: int, warmup_s: float) -> float:
        """Median ms/token decoding at context ``ctx`` (identity block table)."""
        return median_ms(self._decoding(ctx, n_tokens, scattered=False), n_tokens, warmup_s)

    def paged_ratio(self, ctx: int, n_tokens: int, warmup_s: float) -> dict:
        """Scattered over identity block table at context ``ctx``: two sessions on two pools,
        their tokens timed alternately (each scattered token next to an identity one, so a
        bandwidth regime flip moves both), ``n_tokens`` each after the warm-up; the ratio of the
        medians."""
        steps = [self._decoding(ctx, n_tokens, scattered) for scattered in (False, True)]
        warm_up(lambda: [step() for step in steps], warmup_s)
        times = [[], []]
        for _ in range(n_tokens):
            for i, step in enumerate(steps):
                t0 = time.perf_counter()
                step()
                times[i].append(time.perf_counter() - t0)
        contiguous, scattered = (float(np.median(t) * 1e3) for t in times)
        return {"contiguous_ms": contiguous, "scattered_ms": scattered,
                "ratio": scattered / contiguous}

    @functools.cached_property
    def _weights_read(self):
        """``(step, bytes)``: a compiled VM function that reads every matrix a decode step
        streams, each with its own read-only kernel (``stream_words``), in the artifact's
        parameter order; the decode step with its arithmetic, attention and host work taken
        out."""
        import tvm
        from tvm import relax

        from paged_decode.runtime.host_memory import to_tvm

        from paged_decode.compile.build import EXEC_MODE, relax_pipeline
        from paged_decode.compile.kernels.cpu.simd import VL
        from .stream import CHUNKS, stream_words
        from paged_decode.compile.targets import resolve_target

        words = []  # each matrix's bytes as int32 words, in place (no copy)
        for t in streamed_matrices(self.m, self.weights):
            raw = np.from_dlpack(t).reshape(-1).view(np.uint8)
            words.append(to_tvm(raw[:raw.size // 4 * 4].view(np.int32)))
        bb, kernels = relax.BlockBuilder(), {}
        params = [relax.Var(f"w{i}", relax.TensorType([w.shape[0]], "int32"))
                  for i, w in enumerate(words)]
        with bb.function("read_weights", params):
            with bb.dataflow():
                outs = []
                for p, w in zip(params, words):
                    n = w.shape[0]
                    if n not in kernels:
                        kernels[n] = bb.add_func(stream_words(n), f"stream_words_{n}")
                    outs.append(bb.emit(relax.call_tir(
                        kernels[n], [p], relax.TensorType([CHUNKS, VL], "int32"))))
                out = bb.emit_output(relax.Tuple(outs))
            bb.emit_func_output(out)
        target = resolve_target(None).target
        ex = relax.build(bb.get(), target, relax_pipeline=relax_pipeline(target),
                         exec_mode=EXEC_MODE)
        fn = relax.VirtualMachine(ex, tvm.cpu())["read_weights"]
        return (lambda: fn(*words)), 4 * sum(w.shape[0] for w in words)

    @property
    def weights_read_bytes(self) -> int:
        return self._weights_read[1]

    def weights_read_ms(self, n: int) -> float:
        """Median ms of the read-only step (``_weights_read``) over ``n`` calls."""
        return median_ms(self._weights_read[0], n, 0.0)

    def prefill_tps(self, n: int) -> float:
        """Tokens/s of an ``n``-token prefill, after an untimed one of the same length (as for
        llama.cpp, whose first batch of a size after decoding re-plans its compute graph)."""
        pool = self.pool(self.m.max_blocks_cap)
        session = self.session(pool)
        ids = prompt_ids(n, self.m.vocab_size)
        warm = pool.new_sequence()
        session.prefill(warm, ids)
        warm.release()
        handle = pool.new_sequence()
        t0 = time.perf_counter()
        session.prefill(handle, ids)
        return n / (time.perf_counter() - t0)

    def replan_ratio(self, n_tokens: int) -> dict:
        """Per-token time with a fresh session (plan) every token vs the bound session."""
        pool = self.pool(self.m.max_blocks_cap)
        handle = pool.new_sequence()
        session = self.session(pool)
        session.prefill(handle, [1, 2, 3])
        once = median_ms(lambda: session.realize_token(handle, 1), n_tokens, LATER_WARMUP_S)
        replan = median_ms(lambda: self.session(pool).realize_token(handle, 1), n_tokens,
                           LATER_WARMUP_S)
        return {"plan_once_ms": once, "replan_ms": replan, "ratio": replan / once}

    def host_overhead_us(self, ctx: int = 16, n: int = 400) -> dict:
        """Whole Python step vs the VM's own time evaluator on the same arguments, at contexts
        ``ctx`` to ``ctx + 32`` (the fixed cost, not attention over a long context)."""
        pool = self.pool(self.m.max_blocks_cap)
        handle = pool.new_sequence()
        session = self.session(pool)
        session.prefill(handle, list(range(1, ctx)))
        times = []
        for i in range(n):
            if i % 32 == 0:
                handle.truncate_to(ctx - 1)
            t0 = time.perf_counter()
            session.realize_token(handle, 1)
            times.append(time.perf_counter() - t0)
        py_us = float(np.median(times[50:]) * 1e6)
        handle.truncate_to(ctx - 1)
        handle.reserve(1)
        args = (session._token, session._table, ctx, handle.write_offset(ctx - 1), pool.pools,
                self.weights.params)
        te = self.artifact.vm.time_evaluator("decode", self.artifact.device, number=200, repeat=5)
        vm_us = float(np.median(te(*args).results) * 1e6)
        return {"context": ctx, "python_step_us": py_us, "vm_call_us": vm_us,
                "python_overhead_us": py_us - vm_us}


# the vector extensions that decide which kernels fit a CPU (reported with each run)
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw",
                "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


def cpu_model() -> dict:
    """``{"cpu_model", "vector_extensions"}`` from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": platform.processor() or None, "vector_extensions": []}
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name"),
            "vector_extensions": [f for f in VECTOR_FLAGS if f in flags]}




# quantized kinds: "gguf" (a GGUF model's own file, as stored) and llama.cpp's quantizer's
# outputs from one float16 GGUF of the model; both engines read the same file, KV cache float16
QUANT_KINDS = ("gguf", *baselines.LLAMA_FTYPES)


def _bench_gguf(source: ModelSource, kind: str, workdir: Path, say) -> Path:
    """The GGUF both engines read for quantized ``kind``."""
    if kind == "gguf":
        if source.kind != "gguf":
            raise ValueError(f"--dtype gguf measures a GGUF model's own file; {source.path} "
                             f"is a {source.kind} model: use --dtype {'/'.join(QUANT_KINDS[1:])}")
        return source.path
    reason = baselines.llamacpp_available()
    if reason:
        raise ValueError(f"--dtype {kind} is made by llama.cpp's quantizer: {reason}")
    f16 = workdir / f"bench-{source.config.name}-float16.gguf"
    if not f16.exists():
        baselines.write_gguf(source.config, source.load_params("float32"), f16, "float16")
    out = workdir / f"bench-{source.config.name}-{kind}.gguf"
    if not out.exists():
        say(f"  llama.cpp quantizer: {f16.name} -> {out.name}")
        baselines.quantize_gguf(f16, out, kind, os.cpu_count() or 1)
    return out


def _start_llamacpp(source: ModelSource, dtype: str, n_ctx: int, workdir: Path, say,
                    gguf: Path | None = None):
    """(engine, None), or (None, reason) when llama.cpp cannot run; ``gguf``: the quantized
    file both engines read (float16 KV cache), else one written in ``dtype``."""
    reason = baselines.llamacpp_available()
    if reason:
        return None, reason
    if gguf is None:
        gguf = baselines.write_gguf(source.config, source.load_params("float32"),
                                    workdir / f"bench-{dtype}.gguf", dtype)
    cache = "float16" if dtype in QUANT_KINDS else dtype
    say(f"  llama.cpp {dtype} on {gguf.name}")
    return baselines.LlamaCpp(gguf, n_ctx, os.cpu_count() or 1, cache), None


def _ours_rss_child(artifact_dir: str, weights_dir: str, prompt: int, n_tokens: int) -> dict:
    """In a fresh process: load the artifact and weights, prefill ``prompt`` tokens on a pool of
    the artifact's capacity and decode ``n_tokens``; peak RSS then, and before loading (MB)."""
    before = baselines.peak_rss_mb()
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.session import PagedDecodeSession

    artifact = load_artifact(artifact_dir)
    weights = load_weights(weights_dir, artifact)
    pool = PagedKVCache.for_artifact(artifact, num_blocks=artifact.manifest.max_blocks_cap)
    session, handle = PagedDecodeSession(artifact, weights, pool), pool.new_sequence()
    logits = session.prefill(handle, prompt_ids(prompt, artifact.manifest.vocab_size))
    for _ in range(n_tokens):
        logits = session.realize_token(handle, int(np.argmax(logits)))
    return {"peak_rss_mb": baselines.peak_rss_mb(), "before_load_mb": before}


def _bracketed_rounds(ours: _Ours, lc, cfg: dict, say, bpt: dict | None = None) -> dict:
    """``cfg["rounds"]`` rounds; in each, per context, one bracketed pair (:func:`_pair`), redone
    up to ``cfg["retries"]`` times while it is not stable; then both prefills back to back.  The
    readings of ours and of the bandwidth on both sides of llama.cpp's tell whether the machine
    stayed in one regime for the pair (:func:`_stable`)."""
    ctxs, n, big = cfg["contexts"], cfg["n_tokens"], max(cfg["contexts"])
    pairs = {c: [] for c in ctxs}
    prefill = {"ours": {p: [] for p in cfg["prompts"]},
               "llama.cpp": {p: [] for p in cfg["prompts"]}}
    for r in range(cfg["rounds"]):
        say(f"  round {r + 1}/{cfg['rounds']}")
        warm = FIRST_WARMUP_S if r == 0 else LATER_WARMUP_S
        for c in ctxs:
            for attempt in range(1 + cfg["retries"]):  # a pair that straddled a flip is redone
                pair = _pair(ours, lc, c, n, warm if attempt == 0 else LATER_WARMUP_S,
                             cfg["bw_mb"], paged=c == big, floor_bytes=(bpt or {}).get(c))
                pair["attempt"] = attempt
                pairs[c].append(pair)
                if pair["stable"]:
                    break
        for p in cfg["prompts"]:
            prefill["ours"][p].append(ours.prefill_tps(p))
            if lc is not None:
                baselines.pause()
                prefill["llama.cpp"][p].append(lc.prefill_tps(p))
                baselines.pause()
    return {"pairs": pairs, "prefill_tps": prefill}


def _pair(ours: _Ours, lc, c: int, n: int, warm: float, bw_mb: int, paged: bool,
          floor_bytes: int | None = None) -> dict:
    """One bracketed pair at context ``c``: bandwidth, ours, the read-only step
    (``weights_read_ms``), [with ``paged``: identity and scattered block tables interleaved
    (``paged_ratio``)], llama.cpp, ours, bandwidth.  With ``floor_bytes`` (bytes read per token)
    the pair also keeps its floor, the ms/token at its mean bandwidth reading, and the read-only
    step's (``read_floor_ms``, for the bytes it reads)."""
    pair = {"bandwidth_gbps": [measure_bandwidth(bw_mb)], "ours_ms": [ours.decode_ms(c, n, warm)],
            "weights_read_ms": ours.weights_read_ms(n)}
    if paged:
        pair["paged"] = ours.paged_ratio(c, n, warm)
    if lc is not None:
        baselines.pause()
        pair["llama.cpp_ms"] = lc.decode_ms(c, n, warm)
        baselines.pause()
    pair["ours_ms"].append(ours.decode_ms(c, n, LATER_WARMUP_S))
    pair["bandwidth_gbps"].append(measure_bandwidth(bw_mb))
    if floor_bytes is not None:  # ms at the mean reading: bytes / (GB/s * 1e6)
        mean_bw = np.mean(pair["bandwidth_gbps"])
        pair["floor_ms"] = floor_bytes / (mean_bw * 1e6)
        pair["read_floor_ms"] = ours.weights_read_bytes / (mean_bw * 1e6)
    pair["stable"] = _stable(pair)
    pair["read_stable"] = _read_stable(pair)
    return pair


STABLE_MS, STABLE_BW = 1.08, 1.15  # max/min within a pair that still counts as one regime
MAX_FLOOR_FRACTION = 1.15  # an engine "faster than the floor" by more: the memory sped up


def _stable(pair: dict) -> bool:
    """Our two readings within 8 % and the two bandwidth readings within 15 %: no regime flip
    inside the pair (a flip moves either by 30-80 % on this machine).  Where the pair keeps its
    floor, no reading may beat it by more than ``MAX_FLOOR_FRACTION``: that catches a flip
    into the fast regime and back inside llama.cpp's reading, which the brackets miss."""
    a, bw = pair["ours_ms"], pair["bandwidth_gbps"]
    readings = a + ([pair["llama.cpp_ms"]] if pair.get("llama.cpp_ms") else [])
    beats_floor = "floor_ms" in pair and pair["floor_ms"] / min(readings) > MAX_FLOOR_FRACTION
    return max(a) / min(a) <= STABLE_MS and max(bw) / min(bw) <= STABLE_BW and not beats_floor


def _read_stable(pair: dict) -> bool:
    """A stable pair whose read-only reading also stayed in the pair's regime: it beats the floor
    for its bytes by at most ``MAX_FLOOR_FRACTION``, and our step beats it by at most 8 % (a
    reading of our own weights; the two share the work out differently, so ours may come out a
    little faster).  Only the read-only statistics use it: the headline ratios do not depend on
    how the read-only kernels suit the machine."""
    read, a = pair["weights_read_ms"], pair["ours_ms"]
    return bool(pair["stable"] and read / min(a) <= STABLE_MS
                and pair.get("read_floor_ms", 0.0) / read <= MAX_FLOOR_FRACTION)


def _ours_ms(pair: dict) -> float:
    """Our ms/token in a pair: the geometric mean of the readings on both sides of llama.cpp's."""
    return float(np.sqrt(pair["ours_ms"][0] * pair["ours_ms"][1]))


def _over_pairs(pairs: list, value, key: str = "stable") -> dict:
    """Median and min-max of ``value(pair)`` over the stable pairs (``pair[key]``; over all pairs
    when none is stable); ``stable`` counts the stable ones."""
    use = [p for p in pairs if p[key]] or pairs
    return {**spread([value(p) for p in use]),
            "stable": sum(p[key] for p in pairs), "pairs": len(pairs)}


TWO_REGIMES = 1.3  # highest / lowest bandwidth reading above which a run saw both regimes


def regime_split(readings) -> float | None:
    """The GB/s that separates the two regimes: the geometric mean of the lowest and highest
    reading, or None when the run saw one regime only (max / min below ``TWO_REGIMES``)."""
    lo, hi = min(readings), max(readings)
    return float(np.sqrt(lo * hi)) if hi / lo >= TWO_REGIMES else None


def _by_regime(pairs: list, split: float | None, value, key: str = "stable") -> dict:
    """``value`` over the stable pairs (``pair[key]``) above and below ``split`` GB/s (the pair's
    mean reading)."""
    if split is None:
        return {}
    out = {}
    for name, keep in (("fast", lambda b: b >= split), ("slow", lambda b: b < split)):
        use = [p for p in pairs if p[key] and keep(np.mean(p["bandwidth_gbps"]))]
        if use:
            out[name] = {**spread([value(p) for p in use]), "pairs": len(use)}
    return out


def _max_context(cfg: dict) -> int:
    """The artifacts' context: room for both sections, so they share one build."""
    decode = max(max(cfg["contexts"]), max(cfg["prompts"])) + cfg["n_tokens"] + 64
    batched = cfg["batch"]["context"] + 48 + cfg["batch"]["steps"] + 64
    return max(decode, batched)


def _prepare(source: ModelSource, dtype: str, cfg: dict, artifacts, say, workdir: Path):
    """``(prepared, gguf)``: our artifact for ``dtype`` and, for a quantized kind, the GGUF both
    engines read (its own formats, as llama.cpp reads it), else None."""
    max_ctx = _max_context(cfg)
    gguf = _bench_gguf(source, dtype, workdir, say) if dtype in QUANT_KINDS else None
    if gguf is not None:
        prepared = prepare(resolve_model(str(gguf)), block_size=cfg["block_size"],
                           max_context=max_ctx, cache_dtype="float16", weight_dtype="auto",
                           artifacts=artifacts)
    else:
        prepared = prepare(source, block_size=cfg["block_size"], max_context=max_ctx,
                           cache_dtype=dtype, weight_dtype=dtype, artifacts=artifacts)
    return prepared, gguf


def _run_batch(model: str, source: ModelSource, dtype: str, cfg: dict, artifacts, say,
               workdir: Path, hf_by_model: dict) -> dict:
    """The batched section for one model x dtype (``batch.run_batch``); HF's float32 timings
    are measured once per model (``hf_by_model``) and shared by its dtypes."""
    prepared, gguf = _prepare(source, dtype, cfg, artifacts, say, workdir)
    bcfg = cfg["batch"]
    lc, lc_skip = _start_llamacpp(source, dtype, _max_context(cfg) + 64, workdir, say, gguf)
    try:
        res = batch.run_batch(prepared, source, dtype, bcfg, lc, say, _in_child,
                              hf=hf_by_model.get(model))
    finally:
        if lc is not None:
            lc.close()
    hf_by_model.setdefault(model, res["hf_ms"])
    res["llama.cpp"] = {"skipped": lc_skip} if lc is None else {
        "n_seq_max": max(bcfg["rows"]), "kv_unified": False}
    return {**_run_names(model, dtype), **res}


def _run_names(model: str, dtype: str) -> dict:
    """A run's model and dtype: tables name a model given as a path by its file or folder
    name; the path stays in JSON (``model_arg``)."""
    return {"model": Path(model).name if os.sep in model else model, "model_arg": model,
            "dtype": dtype}


def _run_one(model: str, source: ModelSource, dtype: str, cfg: dict, artifacts, say,
             workdir: Path) -> dict:
    """Everything for one model x dtype: compile/load, the bracketed rounds, re-plan, host overhead
    (tiny), HF eager."""
    max_ctx = _max_context(cfg)
    prepared, gguf = _prepare(source, dtype, cfg, artifacts, say, workdir)
    ours = _Ours(prepared)
    m = ours.m
    lc, lc_skip = _start_llamacpp(source, dtype, max_ctx + 64, workdir, say, gguf)
    ctxs, big = cfg["contexts"], max(cfg["contexts"])
    bpt = {c: bytes_per_token(m, ours.weights, c) for c in ctxs}
    ours.weights_read_bytes  # compiles the read-only step now, not inside the first pair
    try:
        raw = _bracketed_rounds(ours, lc, cfg, say, bpt)
        lc_rss = lc.rss() if lc is not None else None
    finally:
        if lc is not None:
            lc.close()
    rss_prompt = max(cfg["prompts"])
    ours_rss = _in_child(_ours_rss_child, str(prepared.artifact_dir), str(prepared.weights_dir),
                         rss_prompt, cfg["n_tokens"])
    pairs = raw["pairs"]
    bw = [b for c in ctxs for p in pairs[c] for b in p["bandwidth_gbps"]]
    o_pre = raw["prefill_tps"]["ours"]

    split = regime_split(bw)
    # each pair kept its floor (ms/token at its own bandwidth, see _pair)
    ours_ff = lambda p: p["floor_ms"] / _ours_ms(p)  # noqa: E731
    # the read-only step: its floor (kept in each pair, see _pair) over its time, and our step
    # over it
    read_ff = lambda p: p["read_floor_ms"] / p["weights_read_ms"]  # noqa: E731
    ours_over_read = lambda p: _ours_ms(p) / p["weights_read_ms"]  # noqa: E731
    every_pair = [p for c in ctxs for p in pairs[c]]
    rs = "read_stable"

    res = {"weights": {"weight_dtype": m.weight_dtype, **(m.key.get("weight_formats") or {})},
           "peak_rss_mb": ours_rss,
           "compile_seconds": m.compile_seconds, "cache_hit": prepared.cache_hit,
           "load_seconds": ours.load_seconds, "library_mb": m.library_bytes / 1e6,
           "decode_ms": {c: float(np.median([t for p in pairs[c] for t in p["ours_ms"]]))
                         for c in ctxs},
           "prefill_tps": {p: float(np.median(v)) for p, v in o_pre.items()},
           "bytes_per_token": bpt,
           # per pair: the floor (bytes / the pair's bandwidth) over our time
           "floor_fraction": {c: _over_pairs(pairs[c], ours_ff) for c in ctxs},
           "floor_fraction_by_regime": {c: _by_regime(pairs[c], split, ours_ff) for c in ctxs},
           # interleaved within each pair (``paged_ratio``): every pair counts, stable or not
           "paged_vs_contiguous": {"context": big, "pairs": len(pairs[big]), **spread(
               [p["paged"]["ratio"] for p in pairs[big]])},
           "replan": ours.replan_ratio(cfg["replan"]),
           # the read-only step (the streamed matrices, one read-only kernel each) in each
           # pair: its fraction of the floor for those bytes, and our step over it, over the
           # pairs whose read-only reading stayed in their regime too (``_read_stable``)
           "weights_read": {
               "bytes": ours.weights_read_bytes,
               "floor_fraction": _over_pairs(every_pair, read_ff, rs),
               "floor_fraction_by_regime": _by_regime(every_pair, split, read_ff, rs),
               "ours_over": {c: _over_pairs(pairs[c], ours_over_read, rs) for c in ctxs},
               "ours_over_by_regime": {c: _by_regime(pairs[c], split, ours_over_read, rs)
                                       for c in ctxs}}}
    if m.name == "tiny":
        res["host_overhead"] = ours.host_overhead_us()
    baselines_out = {}
    if lc is None:
        baselines_out["llama.cpp"] = {"skipped": lc_skip}
    else:
        l_pre = raw["prefill_tps"]["llama.cpp"]
        lc_ff = lambda p: p["floor_ms"] / p["llama.cpp_ms"]  # noqa: E731
        baselines_out["llama.cpp"] = {
            "decode_ms": {c: float(np.median([p["llama.cpp_ms"] for p in pairs[c]]))
                          for c in ctxs},
            "prefill_tps": {p: float(np.median(v)) for p, v in l_pre.items()},
            "peak_rss_mb": lc_rss,
            "floor_fraction": {c: _over_pairs(pairs[c], lc_ff) for c in ctxs},
            "floor_fraction_by_regime": {c: _by_regime(pairs[c], split, lc_ff) for c in ctxs}}
        # ours tok/s over llama.cpp's = their ms / ours, within each stable pair
        ratio = lambda p: p["llama.cpp_ms"] / _ours_ms(p)  # noqa: E731
        res["vs_llamacpp"] = {
            "decode": {c: _over_pairs(pairs[c], ratio) for c in ctxs},
            "decode_by_regime": {c: _by_regime(pairs[c], split, ratio) for c in ctxs},
            "prefill": {p: spread([o / lt for o, lt in zip(o_pre[p], l_pre[p])])
                        for p in cfg["prompts"]}}
    baselines_out["hf-eager"] = _hf(source, dtype, cfg, say)
    return {**_run_names(model, dtype), "block_size": m.block_size,
            "bandwidth_gbps": float(np.median(bw)),
            "bandwidth_samples": bw, "regime_split_gbps": split, "pairs": pairs, "ours": res,
            "floor_ms": {c: b / (np.median(bw) * 1e9) * 1e3 for c, b in bpt.items()},
            "baselines": baselines_out}


def _run_serve(model: str, source: ModelSource, dtype: str, quick: bool, out_dir: Path,
               say) -> dict:
    """The serving section for one model x dtype (``serve.run_serving``): paged-serve on the
    model, llama.cpp's server on the same GGUF where there is one (the model's own file for
    ``gguf``), concurrent clients and a Poisson trace; its files in ``serve-<model>-<dtype>``."""
    from . import serve

    run = _run_names(model, dtype)
    if dtype not in ("float32", "float16", "gguf"):
        return {**run, "skipped": "the serving section runs float32, float16 or gguf (the "
                                  "model's own GGUF file natively)"}
    if source.kind == "preset":
        return {**run, "skipped": "a preset has no tokenizer to serve text with: give an HF "
                                  "model directory or a GGUF file"}
    if dtype == "gguf" and source.kind != "gguf":
        return {**run, "skipped": "gguf: the model is not a GGUF file"}
    gguf = str(source.path) if source.kind == "gguf" else None
    args = ["--weight-dtype", dtype, "--cache-dtype", dtype] if dtype != "gguf" else []
    cfg = serve.QUICK if quick else serve.FULL
    say(f"  serving: paged-serve {' '.join(args)} "
        f"(llama.cpp {'on ' + gguf if gguf else 'skipped'})")
    res = serve.run_serving(model, out_dir / f"serve-{run['model']}-{dtype}", gguf=gguf,
                            paged_args=args, say=lambda m: say("  " + m), **cfg)
    return {**run, **res}


def _in_child(fn, *args):
    """Run ``fn(*args)`` in a fresh process: another engine's thread pool (TVM's workers spin
    after each call) must not share cores with the one being timed."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def _hf_child(source: ModelSource, cfg: dict) -> dict:
    return baselines.time_hf(baselines.hf_float32(source), cfg["contexts"],
                             max(cfg["n_tokens"] // 2, 4), cfg["prompts"])


def _hf(source: ModelSource, dtype: str, cfg: dict, say) -> dict:
    """HF transformers eager (float32 only), once, in a child."""
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed (pip install -e '.[bench]')"}
    if dtype != "float32":
        return {"skipped": "HF eager float16 / quantized on CPU has no fast kernels; float32 "
                "only"}
    say("  HF transformers eager float32")
    return _in_child(_hf_child, source, cfg)


def _run_start(model, source, cfg, rounds, artifacts, say) -> dict:
    from .start import run_start

    gguf = source.path if source.kind == "gguf" else None
    size = () if cfg["block_size"] is None else ("--block-size", str(cfg["block_size"]))
    return run_start(None if model == "default" else model, gguf, rounds, artifacts, say, size)


def run_bench(models: list[str], out_dir: Path, *, quick: bool = False, artifacts=None,
              dtypes=("float32", "float16"), rounds: int | None = None,
              block_size: int | None = None, sections=("decode",),
              contexts: tuple[int, ...] | None = None, prompts: tuple[int, ...] | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Run the ``sections`` ("decode": B = 1 decode and prefill; "batch": batched steps,
    ``batch.run_batch``; "serve": paged-serve under load, ``serve.run_serving``) for each model
    x dtype; write bench.json, bench.md, bench.png.  ``contexts`` / ``prompts`` replace the
    decode section's context lengths and timed prefill lengths."""
    say = progress or (lambda _m: None)
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        raise ValueError(f"sections {sorted(unknown) or '(none)'}: choose from {SECTIONS}")
    cfg = dict(QUICK if quick else FULL, block_size=block_size,
               batch=dict(batch.QUICK if quick else batch.FULL))
    if rounds is not None:
        cfg["rounds"] = cfg["batch"]["rounds"] = rounds
    cfg.update({k: tuple(v) for k, v in (("contexts", contexts), ("prompts", prompts)) if v})
    # resolved (and an HF or GGUF model's weights hashed) once: an unknown model fails before
    # anything is written or measured
    sources = {model: resolve_model(None if model == "default" else model) for model in models}
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "threads": os.environ.get("TVM_NUM_THREADS"), **cpu_model()},
              "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
              "sections": list(sections), "runs": [], "batch_runs": [], "serve_runs": [],
              "start_runs": [], "speculative_runs": []}
    hf_by_model: dict = {}
    with tempfile.TemporaryDirectory() as work:
        for model in models:
            if "start" in sections:  # a start builds the model's default formats: no dtype
                report["start_runs"].append(_run_start(model, sources[model], cfg,
                                                       rounds or (1 if quick else 3),
                                                       artifacts, say))
            if "speculative" in sections:  # the model's own formats, like a start
                from .speculative import run_speculative

                report["speculative_runs"].append(run_speculative(
                    None if model == "default" else model,
                    rounds or (1 if quick else 3), artifacts, say))
            for dtype in dtypes if set(sections) - {"start", "speculative"} else ():
                say(f"{model} {dtype}")
                if "decode" in sections:
                    report["runs"].append(_run_one(model, sources[model], dtype, cfg, artifacts,
                                                   say, Path(work)))
                if "batch" in sections:
                    report["batch_runs"].append(_run_batch(model, sources[model], dtype, cfg,
                                                           artifacts, say, Path(work),
                                                           hf_by_model))
                if "serve" in sections:
                    report["serve_runs"].append(_run_serve(model, sources[model], dtype, quick,
                                                           out_dir, say))
    from .report import write_outputs

    return write_outputs(report, out_dir)
