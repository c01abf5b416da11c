"""``paged-bench --section start``: what a start costs, from a fresh process as a shell runs it.

Per round, one after the other (so machine noise lands on every engine alike): a warm
``paged-run --prompt hi --max-new-tokens 1`` (wall time and peak RSS of the process), a
``paged-serve`` until ``/health`` answers 200 (ready time, then its RSS idle, then the time to
first token of its first request: a one-token streamed completion of the same prompt), and for
a GGUF model llama.cpp's Python binding loading the same file and producing one token
(``llama_cpp.Llama(model_path, n_ctx)``, its default context of 512).  One untimed start before
the rounds builds (or finds) the artifact and remembers the request, so every timed start is
warm.  Against llama.cpp the report gives each round's ratios (paired, so a busy machine slows
both): paged-run's wall time and peak RSS over llama.cpp's, and paged-serve's idle RSS over
llama.cpp's peak (issue goals: at most 1 and 2).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

PROMPT = "hi"
SERVED_NAME = "start-bench"  # the first request needs no GET /v1/models (which builds the
# grammar index, serve/app.py) to learn the model's name
LLAMA_N_CTX = 512  # llama_cpp.Llama's default
READY_TIMEOUT_S = 600.0
# the child writes its own peak RSS (VmHWM: this process image only; a fork's rusage would
# also count the pages it shared with this benchmark before its exec)
HWM = """
import atexit, os
def _hwm():
    with open("/proc/self/status") as f:
        kib = next(l.split()[1] for l in f if l.startswith("VmHWM:"))
    with open(os.environ["PAGED_BENCH_HWM"], "w") as f:
        f.write(kib)
atexit.register(_hwm)
"""
RUN = HWM + "from paged_decode.cli import run_cmd; run_cmd()"
SERVE = "from paged_decode.cli import serve_cmd; serve_cmd()"
LLAMA = HWM + """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), verbose=False)
llm(sys.argv[3], max_tokens=1)
"""


def _timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of a child process (``HWM`` + its code) run to its end."""
    with tempfile.TemporaryDirectory() as work:
        hwm, log = Path(work) / "hwm", Path(work) / "log"
        with open(log, "wb") as err:  # a file, not a pipe: nothing blocks the child
            t0 = time.perf_counter()
            code = subprocess.call(argv, env={**env, "PAGED_BENCH_HWM": str(hwm)},
                                   stdout=subprocess.DEVNULL, stderr=err)
            wall = time.perf_counter() - t0
        if code != 0:
            raise RuntimeError(f"{argv[:3]} ... exited {code}: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        return wall, int(hwm.read_text()) / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _first_token_ms(port: int) -> float:
    """Milliseconds to the first streamed token of a one-token completion of PROMPT."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1,
                           "stream": True, "temperature": 0})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        while line := response.readline():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                return (time.perf_counter() - t0) * 1e3
        raise RuntimeError(f"paged-serve streamed no token (status {response.status})")
    finally:
        conn.close()


def _serve_ready(argv: list[str], env: dict) -> tuple[float, float, float]:
    """(seconds from spawn to /health 200, RSS MiB idle right after, ms to the first token of
    the first request) of a paged-serve, stopped after."""
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([*argv, "--port", str(port), "--log-level", "warning",
                             "--served-model-name", SERVED_NAME], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while _health(port) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"paged-serve exited {proc.returncode} before it was ready")
            if time.perf_counter() - t0 > READY_TIMEOUT_S:
                raise RuntimeError(f"paged-serve not ready after {READY_TIMEOUT_S:g} s")
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        time.sleep(0.5)  # idle: the engine's thread waits for requests
        idle = _rss_mib(proc.pid)
        return ready, idle, _first_token_ms(port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def run_start(model: str | None, gguf: Path | None, rounds: int, artifacts,
              say: Callable[[str], None], build_args: tuple[str, ...] = ()) -> dict:
    """The start section for one model (``None``: the default); ``gguf``: the file llama.cpp
    loads, None where the model is no GGUF file; ``build_args``: build options both commands
    take (``--block-size 16``)."""
    env = dict(os.environ)
    if artifacts is not None:
        env["PAGED_DECODE_ARTIFACTS"] = str(artifacts)
    pick = ([] if model is None else ["--model", model]) + list(build_args)
    run = [sys.executable, "-c", RUN, *pick, "--prompt", PROMPT, "--max-new-tokens", "1"]
    serve = [sys.executable, "-c", SERVE, *pick]
    say("start: one untimed start builds or finds the artifact")
    _timed(run, env)
    _serve_ready(serve, env)  # a serving artifact may differ (batch buckets)
    llama = _llama_missing(gguf)
    cols: dict[str, list[float]] = {"run_s": [], "run_rss_mib": [], "serve_ready_s": [],
                                    "serve_idle_rss_mib": [], "serve_first_token_ms": [],
                                    "llama_s": [], "llama_rss_mib": []}
    for i in range(rounds):
        say(f"start: round {i + 1} of {rounds}")
        wall, rss = _timed(run, env)
        cols["run_s"].append(wall)
        cols["run_rss_mib"].append(rss)
        ready, idle, first = _serve_ready(serve, env)
        cols["serve_ready_s"].append(ready)
        cols["serve_idle_rss_mib"].append(idle)
        cols["serve_first_token_ms"].append(first)
        if llama is None:
            wall, rss = _timed([sys.executable, "-c", LLAMA, str(gguf), str(LLAMA_N_CTX),
                                PROMPT], env)
            cols["llama_s"].append(wall)
            cols["llama_rss_mib"].append(rss)
    result = {"model": model or "default", "build_args": list(build_args), "rounds": rounds,
              "prompt": PROMPT,
              "llama_n_ctx": LLAMA_N_CTX, "llama_missing": llama,
              **{k: _summary(v) for k, v in cols.items() if v}}
    if llama is None:
        for name, ours, theirs in (("run_over_llama", "run_s", "llama_s"),
                                   ("run_rss_over_llama", "run_rss_mib", "llama_rss_mib"),
                                   ("serve_idle_over_llama_rss", "serve_idle_rss_mib",
                                    "llama_rss_mib")):
            result[name] = _summary([a / b for a, b in zip(cols[ours], cols[theirs])])
    return result


def _llama_missing(gguf: Path | None) -> str | None:
    """Why llama.cpp is not measured (None: it is)."""
    if gguf is None:
        return "the model is no GGUF file"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama_cpp is not importable (pip install '.[bench]')"
    return None


def markdown(runs: list[dict]) -> list[str]:
    """The section's table: median (min-max) per engine and model."""
    if not runs:
        return []
    lines = ["", "Start from a fresh process, warm caches (median (min-max) over the rounds; "
             f"prompt {PROMPT!r}, one new token; llama.cpp: llama_cpp.Llama, n_ctx "
             f"{LLAMA_N_CTX}, load + first token):", "",
             "| model | rounds | paged-run s | paged-run peak RSS MiB | paged-serve ready s | "
             "paged-serve idle RSS MiB | its first request's TTFT ms | llama.cpp s | "
             "llama.cpp peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cells = [_cell(r, k) for k in ("run_s", "run_rss_mib", "serve_ready_s",
                                       "serve_idle_rss_mib", "serve_first_token_ms", "llama_s",
                                       "llama_rss_mib")]
        lines.append(f"| {r['model']} | {r['rounds']} | " + " | ".join(cells) + " |")
    for r in runs:
        if r.get("llama_missing"):
            lines.append(f"\n{r['model']}: llama.cpp not measured ({r['llama_missing']}).")
        elif "run_rss_over_llama" in r:
            lines.append(f"\n{r['model']}, paired per round against llama.cpp (median "
                         "(min-max)): paged-run wall " + _ratio(r, "run_over_llama") +
                         ", peak RSS " + _ratio(r, "run_rss_over_llama") +
                         "; paged-serve idle RSS over llama.cpp's peak " +
                         _ratio(r, "serve_idle_over_llama_rss") + ".")
    return lines


def _ratio(run: dict, key: str) -> str:
    s = run[key]
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _cell(run: dict, key: str) -> str:
    s = run.get(key)
    if s is None:
        return "-"
    fmt = "{:.0f}" if key.endswith(("mib", "ms")) else "{:.2f}"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
