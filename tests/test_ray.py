"""paged-serve replicas under Ray Serve (serve/ray_deployment.py): a local Ray on 127.0.0.1,
started once for this module, with two replicas of the tiny model behind Ray's HTTP proxy.
Every request loop is bounded and every client has a timeout."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the `ray` extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")

from paged_decode.runtime.engine import Engine  # noqa: E402
from paged_decode.runtime.errors import EngineStoppedError  # noqa: E402
from paged_decode.serve.ray_deployment import (APP_NAME, RayServeConfig,  # noqa: E402
                                               ReplicaCore, run_application, start_ray)
from paged_decode.runtime.errors import ConfigError  # noqa: E402
from paged_decode.serve.ray_deployment import app_builder  # noqa: E402
from paged_decode.serve.ray_router import (REPLICA_HEADER, PrefixTable,  # noqa: E402
                                           prefix_hashes, routing_key)

from .conftest import BUCKETS, CHAT_TEMPLATE  # noqa: E402

# Ray's own processes need the cores; one Ray start for the whole module
pytestmark = [pytest.mark.ray, pytest.mark.serial]

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)  # tests/test_serve.py's build
WAIT_S = 60  # the most any bounded wait below lasts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayServed:
    """Two replicas of ``prepared`` under Ray Serve, and a solo reference engine."""

    def __init__(self, prepared):
        self.cfg = RayServeConfig(str(prepared.artifact_dir), str(prepared.weights_dir),
                                  "tiny", replicas=2, max_running=16, max_waiting=32,
                                  chat_template=CHAT_TEMPLATE, replica_cpus=1,
                                  chunk_chars=8, health_check_period_s=1.0)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        start_ray(num_cpus=2)
        run_application(self.cfg, "127.0.0.1", self.port)
        self.solo = Engine.load(prepared.artifact_dir, prepared.weights_dir)
        self.solo.tokenizer.set_chat_template(CHAT_TEMPLATE)
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=WAIT_S)

    def solo_text(self, prompt: str, max_tokens: int, chat: bool = False) -> str:
        return "".join(self.solo.stream_text(prompt, chat=chat, max_new_tokens=max_tokens))

    def replicas(self) -> set[str]:
        """The running replicas' ids, as the responses' header names them."""
        seen: set[str] = set()
        for _ in range(40):  # idle replicas tie, and ties are broken at random
            seen.add(self.http.get("/health").headers.get(REPLICA_HEADER))
            if len(seen - {None}) == self.cfg.replicas:
                break
        return seen - {None}

    def close(self) -> None:
        self.http.close()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def served(build):
    s = RayServed(build("tiny", **OPTS))
    yield s
    s.close()


def complete(http: httpx.Client, prompt: str, max_tokens: int) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                              "max_tokens": max_tokens, "temperature": 0})


def stream(url: str, prompt: str, max_tokens: int, pin: str | None = None,
           on_text=None) -> dict:
    """A streaming completion read to its end: text, replica, status, whether [DONE] came,
    and the error events it carried; ``on_text()`` runs at each piece of text."""
    out = {"text": "", "replica": None, "status": None, "done": False, "errors": []}
    headers = {REPLICA_HEADER: pin} if pin else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                          timeout=WAIT_S) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["errors"].append(event["error"])
                    else:
                        out["text"] += "".join(c["text"] for c in event["choices"])
                        if on_text is not None:
                            on_text()
    except httpx.HTTPError as e:  # a cut connection is an outcome too; a hang is not
        out["errors"].append(repr(e))
    return out


def test_16_concurrent_greedy_streams_equal_their_solo_runs(served):
    prompts = [f"hello {i}" if i % 2 else f"the fox {i}" for i in range(16)]
    want = [served.solo_text(p, 10) for p in prompts]
    got: list = [None] * 16
    barrier = threading.Barrier(16)

    def client(i):
        barrier.wait(WAIT_S)
        chunks = served.client.completions.create(model="tiny", prompt=prompts[i],
                                                  max_tokens=10, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert got == want


def test_chat_and_errors_keep_the_openai_routes(served):
    r = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0)
    assert r.choices[0].message.content == served.solo_text("hi", 6, chat=True)
    bad = served.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    assert [m.id for m in served.client.models.list().data] == ["tiny"]


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(served):
    for i in range(6):
        system = f"{i} is a helper"  # distinct from the first character on
        rows = []
        for user in ("hi there", "again"):
            r = served.http.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}]})
            assert r.status_code == 200, r.text
            rows.append((r.headers[REPLICA_HEADER],
                         r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        (first, _), (second, cached) = rows
        assert first == second
        assert cached > 0  # the second prefilled only past the shared system prompt


def test_prompts_without_a_shared_prefix_reach_both_replicas(served):
    seen = {complete(served.http, f"{i:02d} unrelated prompt", 1).headers[REPLICA_HEADER]
            for i in range(24)}
    assert len(seen) == 2 and seen == served.replicas()


def test_health_and_metrics_per_replica(served):
    ids = served.replicas()
    assert len(ids) == 2
    for rid in ids:
        pinned = {REPLICA_HEADER: rid}
        health = served.http.get("/health", headers=pinned)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert health.headers[REPLICA_HEADER] == rid
        metrics = served.http.get("/metrics", headers=pinned)
        assert metrics.headers[REPLICA_HEADER] == rid
        assert "paged_decode" in metrics.text
    gone = served.http.get("/health", headers={REPLICA_HEADER: "no-such-replica"})
    assert gone.status_code == 404 and "no-such-replica" in gone.json()["error"]["message"]


def test_check_health_fails_once_the_engine_has_stopped(served):
    core = ReplicaCore(served.cfg, "local")
    core.check_health()
    core.close()
    with pytest.raises(EngineStoppedError, match="local"):
        core.check_health()


def _replica_actor(rid: str):
    return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#EngineReplica#{rid}", namespace="serve")


def test_a_replica_killed_under_load_is_replaced_and_nothing_hangs(served):
    victim, survivor = sorted(served.replicas())
    prompts = [f"story {i}: once" for i in range(8)]
    want = {p: served.solo_text(p, 48) for p in prompts}
    results: list = []
    killed, streaming = threading.Event(), threading.Event()

    def survivor_client(i):  # streams one after another until the kill, and one more
        for _ in range(50):
            done = killed.is_set()
            results.append((i, survivor, stream(served.url, prompts[i], 48, pin=survivor)))
            if done:
                return

    def victim_client(i):  # 24 at once, more than the replica runs, so some wait in its
        # queue; each streams again until the kill, so the kill finds streams under way
        # however fast the replica is
        for _ in range(50):
            done = killed.is_set()
            results.append((i, victim, stream(served.url, prompts[i], 48, pin=victim,
                                              on_text=streaming.set)))
            if done:
                return

    threads = ([threading.Thread(target=survivor_client, args=(i,)) for i in range(4)]
               + [threading.Thread(target=victim_client, args=(i % 8,)) for i in range(24)])
    for t in threads:
        t.start()
    assert streaming.wait(WAIT_S)
    ray.kill(_replica_actor(victim), no_restart=True)
    killed.set()
    unpinned = [complete(served.http, f"after {i}", 4) for i in range(4)]
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads)
    cut = 0
    for i, pin, r in results:
        if r["status"] == 200 and r["done"]:  # finished: whole and right
            assert r["text"] == want[prompts[i]], r
        elif pin == survivor:
            pytest.fail(f"a stream on the surviving replica did not finish: {r}")
        elif r["status"] == 404:  # reached the ingress after the kill, pinned to the dead one
            assert r["replica"] == survivor
        else:  # cut by the kill: said so, never a silent short answer
            assert r["errors"] or r["status"] >= 500, r
            cut += 1
    assert cut >= 1  # the kill hit streams under way or waiting on the victim
    for i, r in enumerate(unpinned):  # sent again to the survivor, or refused with a 5xx
        assert (r.status_code == 200 and r.json()["choices"][0]["text"]
                == served.solo_text(f"after {i}", 4)) or r.status_code >= 500
    deadline = time.monotonic() + WAIT_S
    while victim in served.replicas() or len(served.replicas()) < 2:
        assert time.monotonic() < deadline, "Ray did not replace the killed replica"
        time.sleep(0.5)
    r = complete(served.http, "after the restart", 4)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == served.solo_text(
        "after the restart", 4)


# -- the pieces, without a cluster -------------------------------------------------------------

def test_routing_key_is_the_prompt_text():
    chat = json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text",
                                                                  "text": "hi"}]}]})
    key = routing_key("/v1/chat/completions", chat.encode())
    assert key.index("be brief") < key.index("hi")
    turn2 = json.dumps({"messages": json.loads(chat)["messages"]
                        + [{"role": "assistant", "content": "yes"}]})
    assert routing_key("/v1/chat/completions", turn2.encode()).startswith(key)
    assert routing_key("/v1/completions", b'{"prompt": ["ab", "cd"]}') == "ab"
    assert routing_key("/v1/completions", b'{"prompt": [5, 6]}') == "5 6"
    for path, body in (("/v1/completions", b"{not json"), ("/v1/completions", b"[1]"),
                       ("/health", b""), ("/v1/chat/completions", b'{"messages": 3}')):
        assert routing_key(path, body) == ""


def test_prefix_table_finds_the_longest_remembered_prefix():
    table = PrefixTable(capacity=8)
    table.record(prefix_hashes("aaaabbbb", 4), "r1")
    table.record(prefix_hashes("aaaacccc", 4), "r2")
    assert table.owner(prefix_hashes("aaaabbbbzz", 4), {"r1", "r2"}) == "r1"
    assert table.owner(prefix_hashes("aaaaxxxx", 4), {"r1", "r2"}) == "r2"  # latest "aaaa"
    assert table.owner(prefix_hashes("aaaabbbb", 4), {"r2"}) == "r2"  # r1 gone
    assert table.owner(prefix_hashes("zzzz", 4), {"r1", "r2"}) is None
    assert table.owner(prefix_hashes("aaa", 4), {"r1", "r2"}) is None  # no whole chunk
    table.record(prefix_hashes("".join(map(str, range(20))), 2), "r3")
    assert len(table.owners) == 8


def test_serve_arguments_are_checked():
    with pytest.raises(ConfigError, match="bogus"):
        app_builder({"artifact_dir": "a", "weights_dir": "b", "model_name": "m", "bogus": 1})
    with pytest.raises(ConfigError, match="model_name"):
        app_builder({"artifact_dir": "a"})
    with pytest.raises(ConfigError, match="replicas"):
        app_builder({"artifact_dir": "a", "weights_dir": "b", "model_name": "m",
                     "replicas": "0"})
    with pytest.raises(ConfigError, match="not int"):
        app_builder({"artifact_dir": "a", "weights_dir": "b", "model_name": "m",
                     "replicas": "two"})
