"""paged-bench on the tiny preset: a smoke test that JSON, table and PNG are well-formed."""

from __future__ import annotations

import json

from click.testing import CliRunner

from paged_decode.cli import bench_cmd


def test_bench_quick_writes_json_markdown_png(tmp_path, artifact_root):
    out = tmp_path / "bench"
    result = CliRunner().invoke(bench_cmd, ["--model", "tiny", "--quick", "--rounds", "3", "--dtype", "float32",
                                            "--out", str(out), "--artifacts", str(artifact_root)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    (run,) = report["runs"]
    assert run["bandwidth_gbps"] > 0
    ours = run["ours"]
    contexts = [str(c) for c in report["settings"]["contexts"]]
    assert sorted(ours["decode_ms"]) == sorted(contexts)
    assert all(v > 0 for v in ours["decode_ms"].values())
    assert all(run["floor_ms"][c] > 0 for c in contexts)
    rounds = report["settings"]["rounds"]
    assert rounds == 3
    assert len(run["bandwidth_rounds"]) == rounds
    assert all(len(v) == rounds for v in ours["decode_ms_rounds"].values())
    for c in contexts:
        frac = ours["floor_fraction"][c]
        assert 0 < frac["min"] <= frac["median"] <= frac["max"] and len(frac["rounds"]) == rounds
    assert ours["paged_vs_contiguous"]["ratio"] > 0 and ours["replan"]["ratio"] > 0
    assert ours["host_overhead"]["python_step_us"] > 0
    for engine in ("llama.cpp", "hf-eager"):  # timed, or skipped with a reason
        res = run["baselines"][engine]
        assert ("decode_ms" in res) != bool(res.get("skipped")), res
    if "decode_ms" in run["baselines"]["llama.cpp"]:  # paired per round with ours
        lc = run["baselines"]["llama.cpp"]
        for c in contexts:
            pair = ours["vs_llamacpp"]["decode"][c]
            assert len(pair["rounds"]) == rounds
            assert pair["rounds"][0] == lc["decode_ms_rounds"][c][0] / ours["decode_ms_rounds"][c][0]
    else:
        assert "vs_llamacpp" not in ours
    md = (out / "bench.md").read_text()
    assert "| tiny | float32 | paged-decode |" in md and "| tiny | float32 | floor |" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
