"""``paged-bench --section start`` on the tiny preset: one bounded round, its JSON and table."""

from __future__ import annotations

from paged_decode.bench.start import markdown, run_start

from .conftest import BUCKETS

# tests/test_serve.py's artifact: paged-run and paged-serve both find it built
ARGS = ("--block-size", "4", "--max-context", "64", "--batch-buckets",
        ",".join(map(str, BUCKETS)))


def test_start_section_measures_fresh_processes(build, artifact_root):
    build("tiny", block_size=4, max_context=64, batch_buckets=BUCKETS)
    said = []
    run = run_start("tiny", None, 1, artifact_root, said.append, ARGS)
    for key in ("run_s", "run_rss_mib", "serve_ready_s", "serve_idle_rss_mib",
                "serve_first_token_ms"):
        assert len(run[key]["values"]) == 1 and run[key]["median"] > 0, key
    # a whole Python process with numpy and TVM's runtime: tens of MiB at least
    assert run["run_rss_mib"]["median"] > 20 and run["serve_idle_rss_mib"]["median"] > 20
    assert "llama_s" not in run and run["llama_missing"] == "the model is no GGUF file"
    assert "run_rss_over_llama" not in run  # ratios only where llama.cpp ran
    assert said == ["start: one untimed start builds or finds the artifact",
                    "start: round 1 of 1"]
    table = "\n".join(markdown([run]))
    assert "| tiny | 1 |" in table and "llama.cpp not measured (the model is no GGUF file)" \
        in table
