"""paged-bench on the tiny preset: a smoke test that JSON, table and PNG are well-formed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from click.testing import CliRunner

from paged_decode.cli import bench_cmd
from paged_decode.bench import report as bench_report, roofs, run as bench
from paged_decode.compile.kernels.cpu.simd import VL
from paged_decode.bench.stream import CHUNKS, stream_words
from paged_decode.compile.targets import resolve_target
from paged_decode.compile.weights import resolve_model

from .conftest import TINY_LONG


# The two runs of the tiny preset below take test_batch_invariance's float32 build of it
# (conftest.TINY_LONG): its 16-token blocks (the --block-size the first checks, not the CPU's
# 64) and a prompt past tiny's vocabulary (what the second checks) as long as makes
# paged-bench's context its 640 positions.
BLOCK_SIZE = ("--block-size", str(TINY_LONG["block_size"]))


@pytest.fixture
def prompts_past_the_vocabulary(monkeypatch) -> int:
    """The quick settings' prompt lengths made one longer than tiny's 256-token vocabulary
    (the full settings' 512 are), of TINY_LONG's context less paged-bench's room for the new
    tokens; returns that length."""
    cfg = dict(bench.QUICK, batch=dict(bench.batch.QUICK))
    room = bench._max_context(dict(cfg, prompts=(10_000,))) - 10_000
    n = TINY_LONG["max_context"] - room
    assert n > resolve_model("tiny").config.vocab_size
    monkeypatch.setitem(bench.QUICK, "prompts", (n,))
    return n


def test_bench_quick_writes_json_markdown_png(tmp_path, artifact_root,
                                              prompts_past_the_vocabulary):
    out = tmp_path / "bench"
    result = CliRunner().invoke(bench_cmd, [
        "--model", "tiny", "--quick", "--rounds", "3", "--dtype", "float32", "--section",
        "decode", "--section", "batch", *BLOCK_SIZE, "--out", str(out),
        "--artifacts", str(artifact_root)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["sections"] == ["decode", "batch"]
    (run,) = report["runs"]
    assert run["block_size"] == TINY_LONG["block_size"]
    assert run["bandwidth_gbps"] > 0
    ours = run["ours"]
    contexts = [str(c) for c in report["settings"]["contexts"]]
    assert sorted(ours["decode_ms"]) == sorted(contexts)
    assert all(v > 0 for v in ours["decode_ms"].values())
    assert all(run["floor_ms"][c] > 0 for c in contexts)
    rounds = report["settings"]["rounds"]
    assert rounds == 3
    retries = report["settings"]["retries"]
    n_pairs = sum(len(run["pairs"][c]) for c in contexts)
    assert len(run["bandwidth_samples"]) == 2 * n_pairs
    for c in contexts:
        pairs = run["pairs"][c]
        # each round: unstable attempts, then a stable one or the last allowed attempt
        assert [p["attempt"] for p in pairs].count(0) == rounds
        for pair, after in zip(pairs, pairs[1:] + [None]):
            assert len(pair["ours_ms"]) == 2 and len(pair["bandwidth_gbps"]) == 2
            assert pair["stable"] == bench._stable(pair)
            assert pair["read_stable"] == bench._read_stable(pair)
            want_floor = ours["bytes_per_token"][c] / (np.mean(pair["bandwidth_gbps"]) * 1e9)
            assert pair["floor_ms"] == pytest.approx(want_floor * 1e3)
            want_read = ours["weights_read"]["bytes"] / (np.mean(pair["bandwidth_gbps"]) * 1e9)
            assert pair["read_floor_ms"] == pytest.approx(want_read * 1e3)
            redone = after is not None and after["attempt"] > 0
            assert redone == (not pair["stable"] and pair["attempt"] < retries)
        frac = ours["floor_fraction"][c]
        assert 0 < frac["min"] <= frac["median"] <= frac["max"]
        assert frac["pairs"] == len(pairs) and 0 <= frac["stable"] <= rounds
        by = ours["floor_fraction_by_regime"][c]
        assert run["regime_split_gbps"] is not None or by == {}
        split_counted = frac["stable"] if run["regime_split_gbps"] else 0
        assert sum(v["pairs"] for v in by.values()) == split_counted
    big = max(contexts, key=int)
    paged = [p["paged"] for p in run["pairs"][big]]  # interleaved: every pair counts
    for p in paged:
        assert p["ratio"] == pytest.approx(p["scattered_ms"] / p["contiguous_ms"])
    assert ours["paged_vs_contiguous"]["values"] == [p["ratio"] for p in paged]
    assert ours["paged_vs_contiguous"]["context"] == int(big) and ours["replan"]["ratio"] > 0
    assert ours["host_overhead"]["python_step_us"] > 0
    read = ours["weights_read"]  # the read-only step, timed in every pair
    assert read["bytes"] == matrix_bytes(resolve_model("tiny").config, 4)
    every = [p for c in contexts for p in run["pairs"][c]]
    assert all(p["weights_read_ms"] > 0 for p in every)
    stable = [p for p in every if p["read_stable"]] or every
    assert read["floor_fraction"]["median"] == pytest.approx(np.median(
        [read["bytes"] / (np.mean(p["bandwidth_gbps"]) * 1e6) / p["weights_read_ms"]
         for p in stable]))
    for c in contexts:
        pairs = [p for p in run["pairs"][c] if p["read_stable"]] or run["pairs"][c]
        assert read["ours_over"][c]["median"] == pytest.approx(np.median(
            [np.sqrt(np.prod(p["ours_ms"])) / p["weights_read_ms"] for p in pairs]))
    for engine in ("llama.cpp", "hf-eager"):  # timed, or skipped with a reason
        res = run["baselines"][engine]
        assert ("decode_ms" in res) != bool(res.get("skipped")), res
    if "decode_ms" in run["baselines"]["llama.cpp"]:  # ratios within each stable pair
        for c in contexts:
            frac = run["baselines"]["llama.cpp"]["floor_fraction"][c]
            assert 0 < frac["min"] <= frac["median"] <= frac["max"]
            pairs = [p for p in run["pairs"][c] if p["stable"]] or run["pairs"][c]
            want = np.median([p["llama.cpp_ms"] / np.sqrt(np.prod(p["ours_ms"])) for p in pairs])
            assert ours["vs_llamacpp"]["decode"][c]["median"] == pytest.approx(want)
    else:
        assert "vs_llamacpp" not in ours
    rss = ours["peak_rss_mb"]  # a process of its own: its peak includes the weights and pool
    assert rss["peak_rss_mb"] > rss["before_load_mb"] > 0
    assert ours["weights"] == {"weight_dtype": "float32"}
    assert set(report["machine"]) >= {"cpu_model", "vector_extensions"}
    md = (out / "bench.md").read_text()
    assert "| tiny | float32 | paged-decode |" in md and "| tiny | float32 | floor |" in md
    assert f"| tiny | float32 | float32 | {rss['peak_rss_mb']:.0f} MB" in md
    assert md.startswith("CPU: ")
    assert f"KV-cache blocks of {TINY_LONG['block_size']} tokens" in md
    read_table = md[md.index("Read-only step"):]
    assert f"| tiny | float32 | {read['bytes'] / 1e6:.1f} | " in read_table
    _check_batch_section(report, md)
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def matrix_bytes(cfg, itemsize: int) -> int:
    """Bytes of the weight matrices one decode step streams, from the model's shape: per layer
    q/k/v, o, gate and up, down; then the LM head (the embedding itself when tied; untied, the
    embedding is gathered a row per token)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.n_q_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = (q + 2 * kv) * h + h * q + 2 * inter * h + h * inter
    return (cfg.n_layers * layer + cfg.vocab_size * h) * itemsize


@pytest.mark.parametrize("n", [1, 17, 4096 * 16 + 5, 300_000])
def test_stream_words_reads_every_word(n):
    """The read-only kernel's partial sums add up to the buffer's (wrapping int32) sum: every
    word read once, the remainder by the last chunk."""
    fn = tvm.compile(stream_words(n), target=resolve_target(None).target)[f"stream_words_{n}"]
    words = np.random.default_rng(n).integers(-2**31, 2**31, n, dtype=np.int64)
    out = tvm.runtime.tensor(np.zeros((CHUNKS, VL), np.int32))
    fn(tvm.runtime.tensor(words.astype(np.int32)), out)
    assert int(out.numpy().astype(np.int64).sum()) % 2**32 == int(words.sum()) % 2**32


def _pair(ours, bw, lc=None):
    pair = {"ours_ms": list(ours), "bandwidth_gbps": list(bw), "llama.cpp_ms": lc}
    pair["stable"] = bench._stable(pair)
    return pair


def test_a_pair_across_a_regime_flip_is_not_stable():
    assert _pair((10.0, 10.5), (33.0, 35.0))["stable"]
    assert not _pair((10.0, 15.0), (33.0, 35.0))["stable"]  # ours moved: a flip
    assert not _pair((10.0, 10.2), (33.0, 55.0))["stable"]  # the bandwidth moved: a flip


@pytest.mark.parametrize("lc_ms, stable", [(12.0, True), (9.0, True), (7.0, False)])
def test_a_reading_far_below_the_floor_is_a_flip(lc_ms, stable):
    """Floor 10 ms: llama.cpp at 9 ms (1.11x the floor) is within the estimate's error; at 7 ms
    (1.43x) the memory sped up under its reading, though both brackets agree."""
    pair = {"ours_ms": [10.5, 10.6], "bandwidth_gbps": [33.0, 33.5], "llama.cpp_ms": lc_ms,
            "floor_ms": 10.0}
    assert bench._stable(pair) is stable
    assert bench._stable({**pair, "ours_ms": [8.0, 8.1], "llama.cpp_ms": 12.0}) is False
    del pair["floor_ms"]  # no floor kept: the brackets alone decide
    assert bench._stable(pair)


@pytest.mark.parametrize("read_ms, read_floor_ms, read_stable", [
    (9.0, 8.5, True),    # the read-only step a little under ours, near its floor
    (10.5, 8.5, True),   # ours 5 % faster than the read-only step: within the 8 %
    (11.5, 8.5, False),  # our step 1.15x faster than reading its own weights: a flip
    (7.0, 8.5, False),   # the read-only step 1.21x faster than its floor: a flip
    (9.0, None, True)])  # no floor kept: only the comparison with ours
def test_a_read_only_reading_in_another_regime_leaves_only_the_read_only_statistics(
        read_ms, read_floor_ms, read_stable):
    pair = {"ours_ms": [10.0, 10.2], "bandwidth_gbps": [33.0, 33.5], "llama.cpp_ms": 12.0,
            "weights_read_ms": read_ms}
    if read_floor_ms is not None:
        pair["read_floor_ms"] = read_floor_ms
    pair["stable"] = bench._stable(pair)
    assert pair["stable"]  # the headline ratios keep the pair either way
    pair["read_stable"] = bench._read_stable(pair)
    assert pair["read_stable"] is read_stable
    assert not bench._read_stable({**pair, "stable": False})
    ratio = lambda p: p["weights_read_ms"]  # noqa: E731
    assert bench._over_pairs([pair], ratio, "read_stable")["stable"] == int(read_stable)


def test_ratios_use_stable_pairs_and_split_by_regime():
    ratio = lambda p: p["llama.cpp_ms"] / bench._ours_ms(p)  # noqa: E731
    pairs = [_pair((10.0, 10.0), (55.0, 57.0), lc=11.0),  # fast, 1.1
             _pair((16.0, 16.0), (33.0, 33.0), lc=16.0),  # slow, 1.0
             _pair((10.0, 16.0), (55.0, 33.0), lc=30.0)]  # flip: left out
    over = bench._over_pairs(pairs, ratio)
    assert (over["stable"], over["pairs"]) == (2, 3)
    assert over["median"] == pytest.approx(1.05) and over["max"] == pytest.approx(1.1)
    by = bench._by_regime(pairs, 44.0, ratio)
    assert by["fast"]["values"] == [pytest.approx(1.1)] and by["slow"]["values"] == [1.0]
    assert bench._by_regime(pairs, None, ratio) == {}
    unstable = [pairs[2]]  # none stable: all pairs, and the count says so
    assert bench._over_pairs(unstable, ratio)["stable"] == 0
    assert bench._over_pairs(unstable, ratio)["median"] == pytest.approx(30 / np.sqrt(160))


def test_unstable_pairs_are_redone_up_to_the_retry_limit(monkeypatch):
    script = iter([False, True,  # round 1: one redo
                   False, False, False,  # round 2: gives up after 2 retries
                   True])  # round 3
    monkeypatch.setattr(bench, "_pair", lambda *a, **k: {"stable": next(script)})

    class Ours:
        def prefill_tps(self, n):
            return 1.0

    cfg = dict(contexts=(16,), n_tokens=1, rounds=3, retries=2, prompts=(), bw_mb=1)
    pairs = bench._bracketed_rounds(Ours(), None, cfg, lambda _m: None)["pairs"][16]
    assert [(p["attempt"], p["stable"]) for p in pairs] == [
        (0, False), (1, True), (0, False), (1, False), (2, False), (0, True)]


def test_regime_split_needs_both_regimes():
    assert bench.regime_split([33.0, 34.0, 35.0]) is None  # one regime: no split
    assert bench.regime_split([33.0, 58.0, 60.0]) == pytest.approx(np.sqrt(33.0 * 60.0))


def _regime_run(name, ff_fast, ff_slow, lc=True):
    by = lambda f, s: {16: {"fast": {"median": f, "pairs": 2}, "slow": {"median": s, "pairs": 1}}}  # noqa: E731
    run = {"model": name, "dtype": "float32", "regime_split_gbps": 44.5,
           "ours": {"floor_fraction_by_regime": by(ff_fast, ff_slow)}, "baselines": {}}
    if lc:
        run["ours"]["vs_llamacpp"] = {"decode_by_regime": {16: {"slow": {"median": 1.07,
                                                                         "pairs": 3}}}}
        run["baselines"]["llama.cpp"] = {"floor_fraction_by_regime": by(0.61, 0.83)}
    run["baselines"]["hf-eager"] = {"skipped": "not installed"}
    return run


def test_markdown_splits_ratios_and_floor_fractions_by_regime():
    report = {"runs": [_regime_run("a", 0.78, 0.93), _regime_run("b", 0.70, 0.90, lc=False),
                       {**_regime_run("c", 0.5, 0.5), "regime_split_gbps": None}]}
    lines = bench_report._regime_lines(report, [16])
    assert "| a | float32 | 44.5 | — | 1.07 (3) |" in lines  # no fast pair: a dash
    assert "| a | float32 | 44.5 | paged-decode | 0.78 (2) | 0.93 (1) |" in lines
    assert "| a | float32 | 44.5 | llama.cpp | 0.61 (2) | 0.83 (1) |" in lines
    assert [line for line in lines if line.startswith("| b |")] == [  # no llama.cpp: no ratio
        "| b | float32 | 44.5 | paged-decode | 0.70 (2) | 0.90 (1) |"]
    assert not any(line.startswith("| c |") for line in lines)  # one regime only
    one = {"runs": [{**_regime_run("c", 0.5, 0.5), "regime_split_gbps": None}]}
    assert bench_report._regime_lines(one, [16]) == []


def test_each_model_is_resolved_once_and_passed_through(monkeypatch, tmp_path):
    calls, seen = [], []
    real = bench.resolve_model
    monkeypatch.setattr(bench, "resolve_model", lambda m: calls.append(m) or real(m))
    monkeypatch.setattr(bench, "_run_one", lambda model, source, dtype, *a: seen.append(
        (model, source, dtype)) or {})
    monkeypatch.setattr(bench_report, "write_outputs", lambda report, out: report)
    bench.run_bench(["tiny", "llama-160m"], tmp_path / "out", quick=True)
    assert calls == ["tiny", "llama-160m"]
    assert [(m, s.config.name, d) for m, s, d in seen] == [
        ("tiny", "tiny", "float32"), ("tiny", "tiny", "float16"),
        ("llama-160m", "llama-160m", "float32"), ("llama-160m", "llama-160m", "float16")]
    assert seen[0][1] is seen[1][1]  # the same resolved source for both dtypes
    assert bench.resolve_model(seen[0][1]) is seen[0][1]  # a resolved source is kept as it is


def test_contexts_and_prefill_lengths_replace_the_defaults(monkeypatch, tmp_path):
    seen, passed = [], []
    real = bench.run_bench
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: passed.append(kw) or real(*a, **kw))
    monkeypatch.setattr(bench, "_run_one", lambda model, source, dtype, cfg, *a: seen.append(
        cfg) or {})
    monkeypatch.setattr(bench_report, "write_outputs", lambda report, out: dict(
        markdown="", json="j", md="m", png="p"))
    result = CliRunner().invoke(bench_cmd, ["--model", "tiny", "--dtype", "float32",
                                            "--contexts", "16,1024,4096", "--prefill", "512",
                                            "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert passed[0]["contexts"] == (16, 1024, 4096) and passed[0]["prompts"] == (512,)
    (cfg,) = seen
    assert cfg["contexts"] == (16, 1024, 4096) and cfg["prompts"] == (512,)
    assert bench._max_context(cfg) >= 4096 + cfg["n_tokens"]
    bad = CliRunner().invoke(bench_cmd, ["--contexts", "16,0", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "positive integers" in bad.output


def test_hf_batched_runs_once_per_model_and_is_shared_by_its_dtypes(monkeypatch, tmp_path):
    """HF generate runs float32 whatever the dtype: the batch section measures it for a model's
    first dtype and hands that result to the others."""
    given = []

    def fake_run_batch(prepared, source, dtype, cfg, lc, say, in_child, hf=None):
        given.append((source.config.name, dtype, hf))
        return {"hf_ms": hf if hf is not None else {"measured_for": (source.config.name, dtype)}}

    monkeypatch.setattr(bench, "_prepare", lambda *a: (None, None))
    monkeypatch.setattr(bench, "_start_llamacpp", lambda *a: (None, "not here"))
    monkeypatch.setattr(bench.batch, "run_batch", fake_run_batch)
    monkeypatch.setattr(bench_report, "write_outputs", lambda report, out: report)
    report = bench.run_bench(["tiny", "llama-160m"], tmp_path / "out", quick=True,
                             sections=("batch",))
    assert given == [("tiny", "float32", None),
                     ("tiny", "float16", {"measured_for": ("tiny", "float32")}),
                     ("llama-160m", "float32", None),
                     ("llama-160m", "float16", {"measured_for": ("llama-160m", "float32")})]
    assert [r["hf_ms"]["measured_for"] for r in report["batch_runs"]] == [
        ("tiny", "float32"), ("tiny", "float32"), ("llama-160m", "float32"),
        ("llama-160m", "float32")]


def test_bench_quantized_kinds_name_what_they_need(tmp_path):
    """``--dtype gguf`` measures a GGUF's own file: a preset has none, and the error says what
    to use instead."""
    with pytest.raises(ValueError, match="--dtype gguf measures a GGUF model's own file.*q4_k_m"):
        bench._bench_gguf(resolve_model("tiny"), "gguf", tmp_path, lambda _m: None)


def test_cpu_model_lists_vector_extensions():
    info = bench.cpu_model()
    assert set(info["vector_extensions"]) <= set(bench.VECTOR_FLAGS)
    flags = open("/proc/cpuinfo").read().split()
    assert ("avx2" in info["vector_extensions"]) == ("avx2" in flags)


def _check_batch_section(report: dict, md: str) -> None:
    """``--section batch`` (quick: b = 1, 2): per b, groups bracketed by roof readings, each
    group's roof recomputed from its readings and the step's cost, ours and the baselines timed
    or skipped with a reason, the table written."""
    (run,) = report["batch_runs"]
    cfg = resolve_model("tiny").config
    rows = [str(b) for b in bench.batch.QUICK["rows"]]
    assert list(run["per_b"]) == rows and run["context"] == bench.batch.QUICK["context"]
    kv = 2 * cfg.n_layers * run["context"] * cfg.n_kv_heads * cfg.head_dim * 4
    attention = 4 * run["context"] * cfg.n_q_heads * cfg.head_dim * cfg.n_layers
    for b in rows:
        cost = run["costs"][b]  # the weights once (tied: the embedding is the LM head) with
        # the norm gains, K/V per row
        norms = (2 * cfg.n_layers + 1) * cfg.hidden_size * 4
        assert cost["bytes"] == matrix_bytes(cfg, 4) + norms + int(b) * kv
        assert cost["flops"] == int(b) * (2 * matrix_bytes(cfg, 1) + attention)
        groups = run["groups"][b]
        assert len(groups) == report["settings"]["batch"]["rounds"] == 3  # --rounds: both
        for g in groups:
            assert len(g["ours_ms"]) == 2 and all(t > 0 for t in g["ours_ms"])
            assert len(g["bandwidth_gbps"]) == len(g["fma_gflops"]) == 2
            want = bench.batch.roof_tps(cost, int(b), np.mean(g["bandwidth_gbps"]),
                                        np.mean(g["fma_gflops"]))
            assert g["roof"]["tps"] == pytest.approx(want["tps"])
        row = run["per_b"][b]
        assert row["tps"] == pytest.approx(np.median(
            [int(b) / (t / 1e3) for g in groups for t in g["ours_ms"]]))
        assert row["over_b1"] == pytest.approx(row["tps"] / run["per_b"]["1"]["tps"])
        assert 0 < row["roof_fraction"]["min"] <= row["roof_fraction"]["max"]
    assert ("skipped" in run["llama.cpp"]) != ("vs_llamacpp" in run["per_b"]["1"])
    assert ("skipped" in run["hf_ms"]) != ("hf_tps" in run["per_b"]["1"])
    assert run["goals"] == {}  # the quick rows reach none of the goals' b
    host = run["host_sampling"]  # sampling one step's logits at the largest b
    assert host["b"] == 2 and host["step_ms"] == pytest.approx(2 / run["per_b"]["2"]["tps"] * 1e3)
    assert set(host["ms"]) == set(bench.batch.SAMPLING) and all(v > 0 for v in host["ms"].values())
    assert host["fraction"]["greedy"] == pytest.approx(host["ms"]["greedy"] / host["step_ms"])
    assert "Host sampling per step at b = 2" in md
    assert "Batched decode, tiny float32" in md
    assert f"| 2 | {run['per_b']['2']['tps']:.0f} | " in md


def test_a_step_is_bound_by_the_slower_roof():
    cost = {"bytes": 2e9, "flops": 4e11}  # 0.1 s at 20 GB/s; 2 s at 200 GFLOP/s
    slow = bench.batch.roof_tps(cost, 8, bandwidth_gbps=20.0, peak_gflops=200.0)
    assert slow == {"tps": pytest.approx(8 / 2.0), "bound": "arithmetic"}
    fast = bench.batch.roof_tps(cost, 8, bandwidth_gbps=20.0, peak_gflops=1e5)
    assert fast == {"tps": pytest.approx(8 / 0.1), "bound": "bandwidth"}


def _group(ours_ms, lc_ms=None, roof=100.0):
    g = {"ours_ms": list(ours_ms), "roof": {"tps": roof, "bound": "bandwidth"}}
    return g if lc_ms is None else {**g, "llama.cpp_ms": lc_ms}


def test_batch_summary_ratios_and_goals():
    """b = 8 at 4.5x b = 1 meets its goal; b = 16 at 1.5x llama.cpp misses its one; a goal whose
    b was not measured is left out."""
    groups = {1: [_group((10.0, 10.0), 10.0)], 8: [_group((17.0, 18.0), 50.0)],
              16: [_group((40.0, 40.0), 60.0, roof=1000.0)]}
    s = bench.batch.summarize(groups, {1: 20.0, 8: 40.0, 16: 80.0})
    per_b = s["per_b"]
    assert per_b[1]["tps"] == pytest.approx(100.0)
    assert per_b[8]["tps"] == pytest.approx(np.median([8000 / 17, 8000 / 18]))
    assert per_b[8]["over_b1"] == pytest.approx(per_b[8]["tps"] / 100.0)
    geo16 = 16 / 0.040
    assert per_b[16]["vs_llamacpp"]["median"] == pytest.approx(geo16 / (16 / 0.060))
    assert per_b[16]["roof_fraction"]["median"] == pytest.approx(geo16 / 1000.0)
    assert per_b[16]["hf_tps"] == pytest.approx(16 / 0.080)
    assert per_b[8]["over_b1_per_round"]["median"] == pytest.approx(
        8 / np.sqrt(0.017 * 0.018) / 100.0)  # against the same round's b = 1 group
    goals = s["goals"]
    assert goals["over_b1 b=8"]["met"] and not goals["vs_llamacpp b=16"]["met"]
    assert goals["roof_fraction b=16"]["got"] == pytest.approx(0.4)
    assert "over_b1 b=32" not in goals
    no_one = bench.batch.summarize({8: groups[8], 16: groups[16]}, None)
    assert no_one["per_b"][8]["over_b1"] is None  # never against another b
    assert no_one["per_b"][8]["over_b1_per_round"] is None
    assert "over_b1 b=8" not in no_one["goals"] and "roof_fraction b=16" in no_one["goals"]


def test_fma_peak_kernel_runs_every_chain():
    """The peak kernel's sums equal the recurrence computed in numpy (float32, exact), so every
    chain and chunk does its multiply-adds; the measured rate is positive."""
    fn = tvm.compile(roofs.fma_peak(3, chunks=4, steps=5),
                     target=resolve_target(None).target)["fma_peak_3"]
    a, b = np.float32(0.5), np.float32(1.0)
    out = tvm.runtime.tensor(np.zeros((4, VL), np.float32))
    fn(tvm.runtime.tensor(np.full(VL, a)), tvm.runtime.tensor(np.full(VL, b)), out)
    want = np.zeros((4, VL), np.float32)
    for c in range(4):
        for u in range(3):
            x = np.float32(c + u)
            for _ in range(5):
                x = np.float32(x * a + b)
            want[c] += x
    np.testing.assert_array_equal(out.numpy(), want)
    assert roofs.measure_fma_peak(repeats=3) > 0


def test_serve_section_loads_the_server_and_replays_a_trace(tmp_path, artifact_root, llama_ckpt,
                                                            monkeypatch):
    """``--section serve --quick``: paged-serve on an HF checkpoint under 1 and 4 streaming
    clients and a 6-request Poisson trace, each with tokens/s and TTFT / ITL percentiles; a
    preset (no tokenizer) and ``gguf`` of a non-GGUF model are skipped with the reason."""
    monkeypatch.setenv("PAGED_DECODE_ARTIFACTS", str(artifact_root))  # the server's builds
    out = tmp_path / "bench"
    result = CliRunner().invoke(bench_cmd, [
        "--model", str(llama_ckpt.path), "--model", "tiny", "--quick", "--dtype", "float32",
        "--dtype", "gguf", "--section", "serve", "--out", str(out),
        "--artifacts", str(artifact_root)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    name = llama_ckpt.path.name  # a model given as a path is named by its folder
    runs = {(r["model"], r["dtype"]): r for r in report["serve_runs"]}
    assert sorted(runs) == sorted([(name, "float32"), (name, "gguf"), ("tiny", "float32"),
                                   ("tiny", "gguf")])
    assert "not a GGUF" in runs[name, "gguf"]["skipped"]
    assert "no tokenizer" in runs["tiny", "float32"]["skipped"]
    served = runs[name, "float32"]
    loads = served["result"]["paged-serve"]
    assert sorted(loads) == ["1", "4"] and all(s["tokens_per_s"] > 0 for s in loads.values())
    trace = served["trace"]["paged-serve"]
    assert 0 < trace["ttft_ms_p50"] <= trace["ttft_ms_p99"]
    assert 0 < trace["itl_ms_p50"] <= trace["itl_ms_p99"]
    assert "no GGUF" in served["meta"]["llama.cpp_skipped"]
    assert (out / f"serve-{name}-float32" / "serve.json").is_file()
    md = (out / "bench.md").read_text()
    assert "Poisson trace: 6 requests" in md and "Serving, tiny float32: skipped" in md


def test_every_section_runs_on_the_default_preset_with_prompts_past_its_vocabulary(
        tmp_path, artifact_root, prompts_past_the_vocabulary):
    """``paged-bench --model tiny`` (the default) with the smallest settings, and prompts
    longer than tiny's 256-token vocabulary (the full settings' 512): every prompt a section
    builds stays inside the vocabulary, and each section reports or says why it skipped (the
    batch section on tiny: ``test_bench_quick_writes_json_markdown_png``, whose build this
    one's block size shares)."""
    n = prompts_past_the_vocabulary
    out = tmp_path / "bench"
    result = CliRunner().invoke(bench_cmd, [
        "--quick", "--rounds", "1", "--dtype", "float32", "--section", "decode", "--section",
        "serve", *BLOCK_SIZE, "--out", str(out), "--artifacts", str(artifact_root)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    (run,) = report["runs"]
    assert run["model"] == "tiny"
    assert run["ours"]["prefill_tps"][str(n)] > 0
    assert run["ours"]["peak_rss_mb"]["peak_rss_mb"] > 0
    (served,) = report["serve_runs"]
    assert "no tokenizer" in served["skipped"]
