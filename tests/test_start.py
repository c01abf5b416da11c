"""Start-up: a cold ``paged-run`` in a fresh process compiles (and says its steps), a warm one
finds the artifact through the request index and loads neither TVM's compiler library nor
torch; ``paged-serve`` answers 503 "loading" until its model is ready."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .conftest import BUCKETS

# argv: report path, then paged-run's arguments.  What the process loaded, read from inside.
DRIVER = """
import json, sys
from pathlib import Path
from paged_decode.cli import run_cmd
try:
    run_cmd(sys.argv[2:], standalone_mode=False)
finally:
    maps = Path("/proc/self/maps").read_text()
    Path(sys.argv[1]).write_text(json.dumps({
        "compiler_lib": "libtvm_compiler" in maps, "runtime_lib": "libtvm_runtime" in maps,
        "torch": sys.modules.get("torch") is not None,
        "compile": sorted(m for m in sys.modules if m.startswith("paged_decode.compile")),
        "gguf": "gguf" in sys.modules}))
"""

RUN = ["--model", "tiny", "--block-size", "4", "--max-context", "32", "--batch-buckets", "none",
       "--prompt", "hello", "--max-new-tokens", "3"]


def _run(tmp_path: Path, root: Path, args: list[str]) -> tuple[str, dict]:
    report = tmp_path / f"report-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_USE_RUNTIME_LIB",
                                                             "PAGED_DECODE_CACHE")}
    env["PAGED_DECODE_ARTIFACTS"] = str(root)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(report), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr, json.loads(report.read_text())


def test_cold_run_compiles_in_a_fresh_process_and_the_warm_one_loads_no_compiler(tmp_path):
    """Three starts on one root: cold, warm, and other options naming the same artifact."""
    root = tmp_path / "root"
    cold_err, cold = _run(tmp_path, root, RUN)
    # the build side was imported before the runtime, so TVM came with its compiler
    assert cold["compiler_lib"] and cold["compile"]
    assert "[1/3] compile:" in cold_err and "[3/3] compile:" in cold_err
    assert f"cached for next time under {root}" in cold_err
    assert "(built or checked now)" in cold_err
    assert len(list((root / ".index").glob("*.json"))) == 1  # the request is remembered

    warm_err, warm = _run(tmp_path, root, RUN)
    assert "(cache hit)" in warm_err and "compile:" not in warm_err
    assert warm["runtime_lib"] and not warm["compiler_lib"]
    assert warm["compile"] == [] and warm["torch"] is False
    artifact = next(line for line in warm_err.splitlines() if "artifact:" in line)
    assert str(root) in artifact

    # the index answers only for the options as given: --max-blocks-cap 8 names the same
    # artifact as --max-context 32, and that start asks the build side (which finds it cached)
    err, other = _run(tmp_path, root, [*RUN[:4], "--max-blocks-cap", "8", *RUN[6:]])
    assert other["compile"] and "compile:" not in err and "(cache hit)" in err
    assert len(list((root / ".index").glob("*.json"))) == 2


# argv: gate file, then paged-serve's arguments.  The model's load waits for the gate file, so
# the test sees the server while it is loading for as long as it needs to.
SERVE_DRIVER = """
import sys, time
from pathlib import Path
import paged_decode.cli as cli
gate = Path(sys.argv[1])
real = cli._serve_engine
def gated(*args, **kwargs):
    while not gate.exists():
        time.sleep(0.05)
    return real(*args, **kwargs)
cli._serve_engine = gated
cli.serve_cmd(sys.argv[2:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, dict] | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    except OSError:
        return None
    finally:
        conn.close()


def _poll(port: int, path: str, until, tries: int = 1200):
    """GET ``path`` every 0.1 s until ``until(answer)``; the last answer."""
    answer = None
    for _ in range(tries):
        answer = _get(port, path)
        if until(answer):
            return answer
        time.sleep(0.1)
    return answer


def test_serve_answers_loading_until_the_model_is_ready(tmp_path, build, artifact_root):
    build("tiny", block_size=4, max_context=64, batch_buckets=BUCKETS)  # tests/test_serve.py's
    port, gate = _free_port(), tmp_path / "gate"
    args = ["--model", "tiny", "--block-size", "4", "--max-context", "64", "--batch-buckets",
            ",".join(map(str, BUCKETS)), "--artifacts", str(artifact_root), "--port", str(port),
            "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-c", SERVE_DRIVER, str(gate), *args],
                            stderr=subprocess.PIPE, text=True)
    try:
        loading = _poll(port, "/health", lambda a: a is not None)
        assert loading == (503, {"status": "loading"})
        status, body = _get(port, "/v1/models")
        assert status == 503 and body["error"]["code"] == 503
        gate.write_text("go")
        assert _poll(port, "/health", lambda a: a is not None and a[0] == 200)[0] == 200
        status, body = _get(port, "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "/health answers 503 until the model is loaded" in err
    assert "(cache hit)" in err and "ready after" in err
